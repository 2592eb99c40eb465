"""Top-k token routing for Mixture-of-Experts layers, with an optional per-step capacity.

Without a capacity (``--moe-capacity-factor`` unset) routing is exactly the
reference's: ``softmax(router_logits.float())`` over all experts, ``topk``,
then optionally the top-k renormalised to sum to 1 (``RouterSpec``).

With a capacity factor ``F`` each expert takes at most
``C = ceil(F * T * k / E)`` token slots per forward pass (``T`` tokens in the
step, ``k`` experts per token, ``E`` experts). Assignment runs in ``k`` rounds
(round ``r`` places every token's ``r``-th slot, so a token's first choice
outranks anyone's second):

1. every token still without a slot this round proposes to its best-ranked
   expert (by router probability; the top-k first, in ``topk`` order, then the
   rest by probability, ties to the lower expert index) that still has room and
   that the token does not already use;
2. each expert accepts proposers up to its remaining room, in *priority order*:
   higher router probability for that expert first, then lower position in the
   token's own sequence, then lower request key (a stable 64-bit hash of the
   request id, ``request_key``); with no keys given, lower row index;
3. rejected tokens propose again (their rejecting expert is now full); a token
   left with no expert that has room passes this slot through: it contributes
   nothing, so a token whose every slot is dropped leaves the layer on the
   residual stream only (plus the shared expert, which has no capacity).

Every expert that rejects someone is full afterwards, so a round ends within
``E + 1`` proposals; the loop is over rounds and proposals, never over tokens.
A slot placed outside the token's top-k is *rerouted*; its weight is the
router probability of the expert it got, divided by the same top-k sum as the
others when ``norm_topk_prob`` (dropped slots weigh 0, nothing is renormalised
again). With room for everyone the result equals routing without a capacity
bit for bit.

Determinism: the outcome is a function of each token's router probabilities
and its (position, request key) alone, so reordering the requests of a step
changes nothing. What the batch *composition* changes is inherent to a
capacity: ``C`` grows with the step's token count, and which tokens compete
for an expert depends on who else is in the step (other requests, how a
prefill was chunked), so a request's output can differ between a run where it
shares steps and one where it runs alone.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RouterSpec:
    """How an architecture turns router logits into top-k weights (see the module doc)."""

    num_experts: int
    top_k: int
    norm_topk_prob: bool
    weights_fp32: bool  # Mixtral scales expert outputs by float32 weights; others cast first


@dataclass
class Routing:
    """One layer's routing of ``T`` tokens.

    ``expert_ids[t, s]`` is the expert of token ``t``'s slot ``s`` (``-1``: the
    slot was dropped by the capacity); ``weights[t, s]`` scales that expert's
    output (0 where dropped). ``rerouted``/``dropped`` (``[T]`` int64, only
    with a capacity) count each token's slots placed outside its top-k / dropped.
    """

    expert_ids: torch.Tensor
    weights: torch.Tensor
    rerouted: torch.Tensor | None = None
    dropped: torch.Tensor | None = None


def request_key(request_id: str) -> int:
    """A stable signed 64-bit key for ``request_id`` (same in every process, unlike ``hash``)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def expert_capacity(factor: float, num_tokens: int, top_k: int, num_experts: int) -> int:
    """``ceil(factor * num_tokens * top_k / num_experts)``: token slots one expert takes per step."""
    # round() first: 1.25 * 16 * 2 / 8 must be 5, not ceil(5.000000000000001) = 6.
    return math.ceil(round(factor * num_tokens * top_k / num_experts, 9))


@dataclass
class RoutingContext:
    """One forward pass's inputs to capacity routing, shared by every MoE layer.

    ``positions`` ``[T]`` are each token's position in its sequence;
    ``token_keys`` ``[T]`` (int64) its request's ``request_key`` (``None``:
    the row index breaks the last ties, which then depend on batch order).
    ``capacity_factor`` ``None`` means no capacity.
    """

    positions: torch.Tensor
    token_keys: torch.Tensor | None
    capacity_factor: float | None
    # Per-token slots rerouted / dropped, summed over the layers routed so far.
    token_rerouted: torch.Tensor | None = None
    token_dropped: torch.Tensor | None = None
    _tie_rank: torch.Tensor | None = field(default=None, repr=False)

    def add_token_counts(self, rerouted: torch.Tensor, dropped: torch.Tensor) -> None:
        """Add one layer's per-token rerouted / dropped slot counts (``[T]``)."""
        if self.token_rerouted is None or self.token_dropped is None:
            self.token_rerouted = rerouted.clone()
            self.token_dropped = dropped.clone()
        else:
            self.token_rerouted += rerouted
            self.token_dropped += dropped

    def tie_rank(self) -> torch.Tensor:
        """``[T]`` int64: each token's rank by (position, request key), computed once per pass."""
        if self._tie_rank is None:
            n = self.positions.shape[0]
            device = self.positions.device
            order = torch.arange(n, device=device)
            if self.token_keys is not None:
                order = torch.argsort(self.token_keys, stable=True)
            order = order[torch.argsort(self.positions[order], stable=True)]
            rank = torch.empty(n, dtype=torch.int64, device=device)
            rank[order] = torch.arange(n, device=device)
            self._tie_rank = rank
        return self._tie_rank


def route(
    router_logits: torch.Tensor, spec: RouterSpec, context: RoutingContext | None = None
) -> Routing:
    """Route ``T`` tokens from their router logits ``[T, E]`` (model dtype).

    Without a capacity this is transformers' computation op for op, so the
    weights are bit-identical to it.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    top_p, top_i = torch.topk(probs, spec.top_k, dim=-1)
    denom = top_p.sum(dim=-1, keepdim=True) if spec.norm_topk_prob else None
    out_dtype = torch.float32 if spec.weights_fp32 else router_logits.dtype
    factor = context.capacity_factor if context is not None else None
    if factor is None or context is None:
        weights = top_p / denom if denom is not None else top_p
        return Routing(top_i, weights.to(out_dtype))
    t = router_logits.shape[0]
    cap = expert_capacity(factor, t, spec.top_k, spec.num_experts)
    ids = assign_with_capacity(probs, top_i, cap, context.tie_rank())
    kept = ids >= 0
    w = probs.gather(1, ids.clamp(min=0))
    if denom is not None:
        w = w / denom
    w = torch.where(kept, w, torch.zeros((), dtype=w.dtype, device=w.device))
    in_topk = (ids[:, :, None] == top_i[:, None, :]).any(dim=-1)
    rerouted = (kept & ~in_topk).sum(dim=1)
    dropped = (~kept).sum(dim=1)
    return Routing(ids, w.to(out_dtype), rerouted, dropped)


def preference_order(probs: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` experts by preference: the top-k (in ``topk`` order), then the rest by
    probability (ties to the lower index)."""
    rest_scores = probs.scatter(1, top_i, float("-inf"))
    rest = torch.argsort(rest_scores, dim=1, descending=True, stable=True)
    return torch.cat([top_i, rest[:, : probs.shape[1] - top_i.shape[1]]], dim=1)


def assign_with_capacity(
    probs: torch.Tensor, top_i: torch.Tensor, capacity: int, tie_rank: torch.Tensor
) -> torch.Tensor:
    """``[T, k]`` expert per slot under ``capacity`` slots per expert (``-1``: dropped).

    ``probs`` ``[T, E]`` float32 router probabilities, ``top_i`` ``[T, k]`` the
    top-k, ``tie_rank`` ``[T]`` distinct ranks breaking equal probabilities
    (lower goes first). The rule is the module docstring's.
    """
    t, e = probs.shape
    k = top_i.shape[1]
    device = probs.device
    out = torch.full((t, k), -1, dtype=torch.int64, device=device)
    if t == 0:
        return out
    pref = preference_order(probs, top_i)
    pref_rank = torch.empty_like(pref)
    pref_rank.scatter_(1, pref, torch.arange(e, device=device).expand(t, e).contiguous())
    room = torch.full((e,), capacity, dtype=torch.int64, device=device)
    used = torch.zeros((t, e), dtype=torch.bool, device=device)
    rows = torch.arange(t, device=device)
    for slot in range(k):
        pending = torch.ones(t, dtype=torch.bool, device=device)
        for _ in range(e + 1):  # each rejecting expert fills up: at most E + 1 proposals
            open_ = (room > 0)[None, :] & ~used
            # amin, not min(dim): the values suffice, and min(dim) opens an OpenMP region.
            best_rank = torch.where(open_, pref_rank, e).amin(dim=1)
            pending &= best_rank < e  # nowhere left: this slot passes through
            who = rows[pending]
            if who.numel() == 0:
                break
            cand = pref[who, best_rank[who]]
            score = probs[who, cand]
            # Priority within each expert: score desc, then tie rank asc (stable sorts,
            # least significant key first).
            order = torch.argsort(tie_rank[who], stable=True)
            order = order[torch.argsort(score[order], descending=True, stable=True)]
            order = order[torch.argsort(cand[order], stable=True)]
            cand_sorted = cand[order]
            counts = torch.bincount(cand_sorted, minlength=e)
            starts = torch.cumsum(counts, 0) - counts
            rank_in_expert = torch.arange(cand_sorted.numel(), device=device) - starts[cand_sorted]
            accept = rank_in_expert < room[cand_sorted]
            winners = who[order[accept]]
            experts = cand_sorted[accept]
            out[winners, slot] = experts
            used[winners, experts] = True
            room -= torch.bincount(experts, minlength=e)
            pending[winners] = False
            if bool(accept.all()):
                break
    return out
