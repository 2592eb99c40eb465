"""The weighted-voting KV policy and its special cases.

Each :class:`Scorer` scores every cache slot (higher: more worth keeping);
the vote turns each score into a rank in ``[0, 1]`` (ties share their
average rank, so a constant scorer votes for nobody) and sums the ranks with
the configured weights (a weighted Borda count: scorers on different scales
vote on equal terms). The keep-set is then

1. the *forced* slots: the first ``sinks`` slots, the last ``recent`` slots
   (``recent = floor(recent_fraction * (budget - sinks))``) and every slot of
   a protected segment (system prompt, newest user turn);
2. with ``whole_segments``: unprotected segments are dropped whole, lowest
   mean vote first (older and less attended turns score lower), until the
   sequence fits; only slots outside every segment (generated tokens) are
   then evicted one by one. When whole turns cannot get the sequence under
   its budget (a turn longer than the budget holds the recent window while it
   is prefilled), that turn's unforced slots go one by one too, rather than
   stall the request;
3. otherwise the best-voted of the remaining slots fill the budget (ties: the
   more recent slot wins).

The named policies are configurations (:func:`make_policy`):

==========  =====================================  ===============  ==============
policy      weights                                recent_fraction  whole_segments
==========  =====================================  ===============  ==============
streaming   recency 1                              0                no
h2o         mass 1                                 1/2              no
rkv         mass 1, redundancy 1                   1/4              no
vote        ``--kv-vote-weights``                  1/4              no
segmented   recency 1 (+ mass if weighted)         1/4              yes
==========  =====================================  ===============  ==============

``streaming`` keeps the sinks and the ``budget - sinks`` most recent slots
(StreamingLLM); ``h2o`` keeps sinks, a recent half and the heaviest hitters
by accumulated attention mass (H2O); ``rkv`` combines importance (mass) with
redundancy, so that near-duplicate keys go first (R-KV).

Segments (and so protected turns) reach a request only under a policy that
``reads_segments`` (``segmented``, or a vote with a segment weight): the
others are the papers' token-level policies and see no turns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from engine.kv.policies.base import EvictionContext, KVPolicy


def tie_ranks(score: torch.Tensor) -> torch.Tensor:
    """Ranks in ``[0, 1]`` (lowest score 0, highest 1); ties get their average rank."""
    n = int(score.shape[0])
    if n <= 1:
        return torch.zeros(n, dtype=torch.float64)
    s = score.to(torch.float64)
    srt = torch.sort(s).values
    less = torch.searchsorted(srt, s, right=False)
    leq = torch.searchsorted(srt, s, right=True)
    return (less + leq - 1).to(torch.float64) / (2.0 * (n - 1))


class Scorer(ABC):
    """Scores every cache slot of an :class:`EvictionContext`: higher keeps."""

    name: str = "abstract"
    needs_mass = False
    needs_keys = False

    @abstractmethod
    def score(self, ctx: EvictionContext) -> torch.Tensor:
        """float ``[ctx.kv_len]``."""


class RecencyScorer(Scorer):
    """Newer slots score higher (the slot index: slots are in token order)."""

    name = "recency"

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        return ctx.token_index.to(torch.float64)


class MassScorer(Scorer):
    """Accumulated attention mass a slot's key received (heavy hitters score high)."""

    name = "mass"
    needs_mass = True

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        if ctx.mass is None:
            raise ValueError("the mass scorer needs the attention mass")
        return ctx.mass.to(torch.float64)


class RedundancyScorer(Scorer):
    """Minus each key's redundancy: its largest cosine similarity to a *later*
    key, averaged over layers. A near-duplicate of a newer key (the one more
    likely kept) scores lowest and goes first; the newest key is never
    redundant."""

    name = "redundancy"
    needs_keys = True

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        if ctx.keys is None:
            raise ValueError("the redundancy scorer needs the keys")
        k = ctx.keys.to(torch.float32)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        sim = torch.bmm(k, k.transpose(1, 2))  # [layers, n, n]
        n = ctx.kv_len
        later = torch.ones(n, n, dtype=torch.bool).triu(1)
        sim = sim.masked_fill(~later, -1.0)
        red = sim.max(dim=2).values.mean(dim=0)  # [n]
        red[n - 1] = -1.0
        return -red.to(torch.float64)


class SegmentScorer(Scorer):
    """Segment boundaries and protected segments score 1, everything else 0.

    A segment's first and last tokens (the role header and the end of turn
    the template puts there) anchor the turn; protected segments (system
    prompt, newest user turn) always score high."""

    name = "segment"

    def score(self, ctx: EvictionContext) -> torch.Tensor:
        seg = ctx.segment_ids()
        out = torch.zeros(ctx.kv_len, dtype=torch.float64)
        for i, s in enumerate(ctx.segments):
            inside = seg == i
            if i in ctx.protected:
                out[inside] = 1.0
            out[(ctx.token_index == s.start) | (ctx.token_index == s.end - 1)] = 1.0
        return out


SCORERS: dict[str, type[Scorer]] = {
    c.name: c for c in (RecencyScorer, MassScorer, RedundancyScorer, SegmentScorer)
}


class VotePolicy(KVPolicy):
    """Weighted voting of scorers over the slots that are not forced (module doc)."""

    def __init__(
        self,
        weights: Mapping[str, float],
        recent_fraction: float = 0.25,
        whole_segments: bool = False,
        name: str = "vote",
    ) -> None:
        unknown = set(weights) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown KV vote scorers: {', '.join(sorted(unknown))}")
        if not 0.0 <= recent_fraction <= 1.0:
            raise ValueError("recent_fraction must be in [0, 1]")
        self.name = name
        self.weights = {k: float(w) for k, w in weights.items() if w > 0}
        if not self.weights:
            raise ValueError("a vote needs at least one positive weight")
        self.scorers = [SCORERS[k]() for k in self.weights]
        self.recent_fraction = recent_fraction
        self.whole_segments = whole_segments

    @property
    def needs_mass(self) -> bool:
        return any(s.needs_mass for s in self.scorers)

    @property
    def needs_keys(self) -> bool:
        return any(s.needs_keys for s in self.scorers)

    @property
    def reads_segments(self) -> bool:
        return self.whole_segments or "segment" in self.weights

    def recent_tokens(self, budget: int, sinks: int) -> int:
        return int(self.recent_fraction * max(budget - sinks, 0))

    def forced_tokens(self, budget: int, sinks: int) -> int:
        return sinks + self.recent_tokens(budget, sinks)

    def vote(self, ctx: EvictionContext) -> torch.Tensor:
        """The weighted rank sum of every slot (float64 ``[kv_len]``)."""
        total = torch.zeros(ctx.kv_len, dtype=torch.float64)
        for s in self.scorers:
            total += self.weights[s.name] * tie_ranks(s.score(ctx))
        return total

    def select(self, ctx: EvictionContext) -> torch.Tensor:
        n = ctx.kv_len
        if n <= ctx.budget:
            return torch.arange(n, dtype=torch.int64)
        seg = ctx.segment_ids()
        forced = torch.zeros(n, dtype=torch.bool)
        forced[: min(ctx.sinks, n)] = True
        recent = self.recent_tokens(ctx.budget, ctx.sinks)
        if recent:
            forced[n - recent :] = True
        for i in ctx.protected:
            forced |= seg == i
        votes = self.vote(ctx)
        keep = torch.ones(n, dtype=torch.bool)
        excess = n - ctx.budget
        if self.whole_segments:
            excess = self._drop_segments(ctx, seg, forced, votes, keep, excess)
            candidates = ~forced & (seg < 0)
            if excess > int(candidates.sum()):
                # Whole turns cannot get under the budget: a turn longer than the
                # budget holds the recent window (its prefill is under way). The
                # "never half a turn" rule bends to token level here, because
                # keeping the cache over budget would stall the request for good
                # (it would never get room for its next token).
                candidates = ~forced & keep
        else:
            candidates = ~forced
        if excess > 0:
            idx = torch.nonzero(candidates).squeeze(1)
            # Lowest vote first; among equal votes the older slot goes first.
            order = torch.argsort(votes[idx], stable=True)
            drop = idx[order[: min(excess, int(idx.shape[0]))]]
            keep[drop] = False
        return torch.nonzero(keep).squeeze(1)

    @staticmethod
    def _drop_segments(
        ctx: EvictionContext,
        seg: torch.Tensor,
        forced: torch.Tensor,
        votes: torch.Tensor,
        keep: torch.Tensor,
        excess: int,
    ) -> int:
        """Drop whole unforced segments, lowest mean vote first (ties: older
        first), until ``excess`` slots are gone; returns what is still to go.
        A segment with any forced slot (protected, sink, recent) stays whole."""
        found: list[tuple[float, int, int]] = []
        for i, s in enumerate(ctx.segments):
            inside = seg == i
            count = int(inside.sum())
            if count == 0 or bool((inside & forced).any()):
                continue
            found.append((float(votes[inside].mean()), s.turn, i))
        for _, _, i in sorted(found):
            if excess <= 0:
                break
            inside = seg == i
            keep &= ~inside
            excess -= int(inside.sum())
        return excess


def make_policy(name: str, vote_weights: Mapping[str, float]) -> VotePolicy:
    """The named policy as a configuration of the vote (table in the module doc)."""
    if name == "streaming":
        return VotePolicy({"recency": 1.0}, recent_fraction=0.0, name=name)
    if name == "h2o":
        return VotePolicy({"mass": 1.0}, recent_fraction=0.5, name=name)
    if name == "rkv":
        return VotePolicy({"mass": 1.0, "redundancy": 1.0}, recent_fraction=0.25, name=name)
    if name == "vote":
        return VotePolicy(vote_weights, recent_fraction=0.25, name=name)
    if name == "segmented":
        weights = {"recency": 1.0}
        if vote_weights.get("mass", 0.0) > 0:
            weights["mass"] = vote_weights["mass"]
        return VotePolicy(weights, recent_fraction=0.25, whole_segments=True, name=name)
    raise ValueError(f"unknown KV policy {name!r}")
