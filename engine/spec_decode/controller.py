"""How many drafts each request gets this step: fixed, or adapted to acceptance and cost.

The adaptive rule (``AdaptiveDraftPolicy``) maximises the step's expected
output tokens per second:

* Each request's per-position acceptance probability ``a`` is measured: an
  exponentially weighted count of accepted drafts over drafts tried up to
  the first rejection (the geometric model: draft ``i`` is accepted with
  probability ``a ** i``), starting from a prior of 0.5 (two pseudo-draws).
  A request that is not verified drifts back to the prior (factor 0.95 per
  step), so one whose drafts stopped paying is probed again later.
* The step's cost is a measured table ``T(n)``: seconds of one target
  forward over ``n`` tokens (``StepCostModel``, calibrated at start-up; for a
  draft model also ``D(m)``, one draft forward over ``m`` rows). Where plain
  decode steps run another path than verification steps (the fused native
  decode step or CUDA graphs take decode-only steps, and the attention
  backend does not split a verification chunk into decode rows, so the chunk
  runs the per-layer forward), a second table ``P(b)``, one decode-only step
  of ``b`` sequences, prices the step without drafts: taking the first draft
  then also pays for leaving the fast path. Backends that split verification
  chunks (the CPU and Triton ones) run both on the same path: no ``P``.
* Candidates are (request, position ``i``) pairs worth ``a ** i`` expected
  tokens each. They are taken best first while that raises
  ``(B + sum of taken values) / (T(n0 + K) + drafting cost)``, where ``B``
  decoding requests each emit one token anyway, ``n0`` tokens are scheduled
  without drafts and ``K`` drafts are taken. A request's count is how many of
  its pairs were taken (0 included).

With few sequences a forward reads the weights once whatever ``n`` (decode is
bound by memory bandwidth), ``T(n0 + K)`` barely exceeds ``T(n0)`` and most
drafts pay; in a large batch each extra token costs its share of compute and
only near-certain drafts pay; past the crossover none do and the step runs
without speculation. The measured table and the crossover on this project's
CPU are in docs/benchmarks/spec-decode.md.
"""

from __future__ import annotations

import bisect
import statistics
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Prior acceptance probability and its weight in pseudo-draws.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
# Weight of past verifications (per verification), and drift toward the prior
# per step in which a request was not verified.
DECAY = 0.9
IDLE_DECAY = 0.95


def _monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool
    adjacent violators): a noisy point is averaged with its neighbours instead of
    raising everything after it."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    out: list[float] = []
    for total, count in blocks:
        out.extend([total / count] * int(count))
    return out


@dataclass
class StepCostModel:
    """Seconds of one forward over ``n`` tokens, interpolated from measured points.

    ``points`` are ``(n, seconds)``; the cost is piecewise linear between them,
    extended past the last point with the last slope, and made non-decreasing
    (a noisy measurement cannot make more tokens cheaper). ``observe`` folds
    the engine's real step times into the point of that size (an exponential
    average), so the table follows the machine's load after start-up.
    """

    points: list[tuple[int, float]]
    alpha: float = 0.05  # weight of one observed step

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a cost model needs at least one measured point")
        self._raw = dict(sorted(self.points))
        self._rebuild()

    def _rebuild(self) -> None:
        ns = sorted(self._raw)
        self._ns = ns
        self.points = list(zip(ns, _monotone([self._raw[n] for n in ns])))

    def observe(self, n: int, seconds: float) -> None:
        """A measured step of ``n`` tokens (ignored for sizes the table does not hold)."""
        old = self._raw.get(n)
        if old is not None and seconds > 0:
            self._raw[n] = old + self.alpha * (seconds - old)
            self._rebuild()

    def __call__(self, n: int) -> float:
        pts = self.points
        if n <= pts[0][0] or len(pts) == 1:
            n0, t0 = pts[0]
            if len(pts) == 1:
                return t0 * max(n, 1) / max(n0, 1) if n > n0 else t0
            return t0
        i = bisect.bisect_left(self._ns, n)
        if i >= len(pts):
            (na, ta), (nb, tb) = pts[-2], pts[-1]
        else:
            (na, ta), (nb, tb) = pts[i - 1], pts[i]
        return ta + (tb - ta) * (n - na) / (nb - na)

    @classmethod
    def measure(
        cls, run: Callable[[int], None], sizes: Sequence[int], rounds: int = 5
    ) -> StepCostModel:
        """Time ``run(n)`` for each size: the median of ``rounds`` rounds that each go
        through every size once (after a warm-up round), so that a burst of load
        from elsewhere lands on different sizes in different rounds."""
        for n in sizes:
            run(n)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(rounds):
            for n in sizes:
                t0 = time.perf_counter()
                run(n)
                times[n].append(time.perf_counter() - t0)
        return cls([(n, statistics.median(ts)) for n, ts in times.items()])


@dataclass
class Candidate:
    """A decoding request that may draft: at most ``max_drafts`` this step."""

    request_id: str
    max_drafts: int


class DraftPolicy(ABC):
    """Strategy: the number of drafts per candidate request for one step."""

    @abstractmethod
    def draft_counts(
        self, candidates: Sequence[Candidate], num_base_tokens: int, decode_only: bool = False
    ) -> list[int]:
        """Drafts for each candidate (same order), given ``num_base_tokens`` tokens
        scheduled without drafts (every running request's next chunk);
        ``decode_only``: every one of those chunks is a single-token decode."""

    @abstractmethod
    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A verification: ``num_accepted`` of ``num_drafts`` drafts were accepted."""

    def observe_step(self, num_tokens: int, seconds: float, plain_decode: bool = False) -> None:
        """The target's forward over ``num_tokens`` tokens took ``seconds``
        (``plain_decode``: a decode-only step without drafts)."""
        return None

    @abstractmethod
    def end_step(self) -> None:
        """Called once per step after the observations."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request ended."""


class FixedDraftPolicy(DraftPolicy):
    """Always as many drafts as allowed (``"adaptive": false``); measures nothing."""

    def draft_counts(
        self, candidates: Sequence[Candidate], num_base_tokens: int, decode_only: bool = False
    ) -> list[int]:
        return [c.max_drafts for c in candidates]

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        return None

    def end_step(self) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None


@dataclass
class _Acceptance:
    accepted: float = 0.0
    tried: float = 0.0
    seen: bool = False  # verified this step

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)


# Seconds of a step's drafting given its tokens without drafts and the drafts
# per depth (``rows[0]``: first drafts of each request, ...).
DraftCost = Callable[[int, list[int]], float]


def no_draft_cost(num_base_tokens: int, rows: list[int]) -> float:
    """Drafting that costs no model time (n-gram lookup)."""
    return 0.0


@dataclass
class AdaptiveDraftPolicy(DraftPolicy):
    """The rule in the module docstring; ``draft_cost``: the drafting model's time;
    ``plain_cost``: ``P(b)``, a decode-only step of ``b`` sequences (None: the
    same path as verification, priced by ``target_cost``)."""

    target_cost: StepCostModel
    draft_cost: DraftCost = no_draft_cost
    plain_cost: StepCostModel | None = None
    _acc: dict[str, _Acceptance] = field(default_factory=dict)

    def acceptance(self, request_id: str) -> float:
        acc = self._acc.get(request_id)
        return acc.rate if acc is not None else PRIOR_ACCEPTANCE

    def draft_counts(
        self, candidates: Sequence[Candidate], num_base_tokens: int, decode_only: bool = False
    ) -> list[int]:
        counts = [0] * len(candidates)
        pairs: list[tuple[float, int, int]] = []  # (value, position, candidate)
        for ci, c in enumerate(candidates):
            a = self.acceptance(c.request_id)
            v = 1.0
            for pos in range(1, c.max_drafts + 1):
                v *= a
                pairs.append((v, pos, ci))
        if not pairs:
            return counts
        pairs.sort(key=lambda p: (-p[0], p[1]))
        n0 = max(num_base_tokens, 1)
        gain = float(len(candidates))
        rows: list[int] = []  # drafting rows per depth (depth 1 is the sync forward)
        plain = self.plain_cost if decode_only and self.plain_cost is not None else self.target_cost
        best_ratio = gain / (plain(n0) + self.draft_cost(n0, []))
        best_k = 0
        for k, (value, pos, _) in enumerate(pairs, start=1):
            gain += value
            while len(rows) < pos:
                rows.append(0)
            rows[pos - 1] += 1
            cost = self.target_cost(n0 + k) + self.draft_cost(n0, rows)
            ratio = gain / cost
            if ratio > best_ratio:
                best_ratio, best_k = ratio, k
        for _, _, ci in pairs[:best_k]:
            counts[ci] += 1
        return counts

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        acc = self._acc.setdefault(request_id, _Acceptance())
        acc.accepted = DECAY * acc.accepted + num_accepted
        acc.tried = DECAY * acc.tried + num_accepted + (1 if num_accepted < num_drafts else 0)
        acc.seen = True

    def observe_step(self, num_tokens: int, seconds: float, plain_decode: bool = False) -> None:
        """The target's forward over ``num_tokens`` tokens took ``seconds``; a
        decode-only step without drafts goes to ``P`` where there is one."""
        if plain_decode and self.plain_cost is not None:
            self.plain_cost.observe(num_tokens, seconds)
        else:
            self.target_cost.observe(num_tokens, seconds)

    def end_step(self) -> None:
        for acc in self._acc.values():
            if not acc.seen:
                acc.accepted *= IDLE_DECAY
                acc.tried *= IDLE_DECAY
            acc.seen = False

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)
