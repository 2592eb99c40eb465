"""The scheduler: decides which requests compute how many tokens each step.

Every step has a token budget (``max_num_batched_tokens``) shared by all
requests. Running requests are served first in policy order (decodes need
one token; a request mid-prefill gets its next chunk), then waiting requests
are admitted in policy order while budget, sequence slots and KV blocks last.
A running request that cannot get the blocks it needs triggers preemption.
``--preemption-mode recompute``: the victim's blocks are freed, it goes back
to waiting, and prefix caching (from any tier) finds its computed blocks
again on resume. ``--preemption-mode swap``: the victim's blocks are parked
in the host tier when it has room for all of them (else recompute), and come
back as a hit on resume, partial last block included, with nothing recomputed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, RequestRejectedError
from engine.kv.manager import KVCacheManager
from engine.policies import (
    AdmissionPolicy,
    AdmissionState,
    FCFSOrdering,
    LatencyPrediction,
    LatencyPredictor,
    LowestPriorityLatestVictim,
    OrderingPolicy,
    PredictionErrorStats,
    PreemptionPolicy,
    PressureAwareAdmission,
    PriorityOrdering,
)
from engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """``req`` computes ``(all_token_ids + draft_token_ids)[start : start + num_new_tokens]``.

    The last ``num_draft_tokens`` of those positions are speculative: slots the
    scheduler reserved past the request's last token (``num_lookahead_slots``
    of them), filled by the proposer with ``set_drafts`` before the forward
    pass and verified by it. Without speculation both are 0 and the chunk is
    ``all_token_ids[start : start + num_new_tokens]``.
    """

    req: Request
    num_new_tokens: int
    start: int
    num_draft_tokens: int = 0
    num_lookahead_slots: int = 0  # reserved at scheduling (blocks were allocated for them)
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_base_tokens(self) -> int:
        """Positions of known tokens (the request's own, not drafts) in this chunk."""
        return self.num_new_tokens - self.num_draft_tokens

    @property
    def is_decode(self) -> bool:
        """Generation past the prompt: the last sampled token (and, after a fully
        accepted draft-model run, the draft before it), plus any drafts."""
        return (
            self.start >= self.req.num_prompt_tokens
            and self.completes_sequence
            and self.num_base_tokens <= 2
        )

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the request's last known token (so it samples)."""
        return self.start + self.num_base_tokens == self.req.num_tokens

    def set_drafts(self, drafts: Sequence[int]) -> None:
        """Fill the reserved slots with ``drafts`` (at most ``num_lookahead_slots``); slots
        left unfilled leave the chunk (their blocks go back after the step)."""
        drafts = list(drafts[: self.num_lookahead_slots])
        self.num_new_tokens = self.num_base_tokens + len(drafts)
        self.num_draft_tokens = len(drafts)
        self.draft_token_ids = drafts

    def token_ids(self) -> list[int]:
        """The chunk's token ids: the request's own, then drafts."""
        req = self.req
        end = self.start + self.num_new_tokens
        own = req.all_token_ids[self.start : min(end, req.num_tokens)]
        if end <= req.num_tokens:
            return own
        first = max(self.start - req.num_tokens, 0)
        return own + self.draft_token_ids[first : end - req.num_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)


class RequestSet:
    """Requests in insertion order with O(1) add, discard and membership (by id).

    The scheduler re-sorts by policy each step, so no order is kept beyond
    insertion; what matters is that leaving a set never scans it.
    """

    def __init__(self) -> None:
        self._reqs: dict[str, Request] = {}

    def add(self, req: Request) -> None:
        self._reqs[req.request_id] = req

    def discard(self, req: Request) -> bool:
        """Remove ``req`` if present; True when it was."""
        return self._reqs.pop(req.request_id, None) is not None

    def __contains__(self, req: Request) -> bool:
        return self._reqs.get(req.request_id) is req

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs.values())

    def __len__(self) -> int:
        return len(self._reqs)

    def sorted(self, key: Callable[[Request], tuple[float, ...]]) -> list[Request]:
        return sorted(self._reqs.values(), key=key)


class Scheduler:
    """Owns the waiting and running sets and the KV manager's allocations.

    Policies (ordering, preemption victim, admission) and the latency
    predictor are injected strategy objects; the defaults come from the config.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        ordering: OrderingPolicy | None = None,
        preemption: PreemptionPolicy | None = None,
        admission: AdmissionPolicy | None = None,
        predictor: LatencyPredictor | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        if ordering is None:
            ordering = (
                PriorityOrdering(aging_interval_s=config.aging_interval_s)
                if config.scheduling_policy == "priority"
                else FCFSOrdering()
            )
        self.ordering = ordering
        self.preemption = preemption or LowestPriorityLatestVictim()
        self.admission = admission or PressureAwareAdmission(
            kv_high_watermark=config.kv_pressure_watermark,
            max_preemptions_per_s=config.kv_pressure_preemptions_per_s,
        )
        self.predictor = predictor or LatencyPredictor()
        self.waiting = RequestSet()
        self.running = RequestSet()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of which swapped out (the rest recompute)
        self.rejections: dict[str, int] = {}
        self._preemption_times: deque[float] = deque()
        # Admission-time predictions of unfinished requests, scored in finish().
        self.predictions: dict[str, LatencyPrediction] = {}
        self.prediction_errors = PredictionErrorStats()
        self.latency_budget_misses = 0

    # ---- arrivals -----------------------------------------------------
    def check_fits(self, req: Request) -> None:
        """400 at once for a request that can never fit in the KV cache."""
        most = req.max_total_tokens if req.kv_cap is None else min(req.max_total_tokens, req.kv_cap)
        need = self.kv.blocks_needed(most)
        if need > self.kv.num_blocks:
            raise InvalidRequestError(
                f"This request needs up to {most} tokens of KV cache "
                f"({need} blocks) but the cache holds only {self.kv.num_blocks * self.kv.block_size} "
                f"tokens. Reduce the prompt or max_tokens.",
                param="max_tokens",
            )

    def admission_state(self) -> AdmissionState:
        now = self.clock()
        while self._preemption_times and now - self._preemption_times[0] > 10.0:
            self._preemption_times.popleft()
        ahead = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        ahead += sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.running
            if r.num_computed_tokens < r.num_tokens - 1
        )
        return AdmissionState(
            num_waiting=len(self.waiting),
            max_waiting=self.config.max_waiting_requests,
            kv_usage=self.kv.usage,
            preemptions_per_s=len(self._preemption_times) / 10.0,
            num_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            prefill_tokens_ahead=ahead,
            predictor=self.predictor,
            now=now,
        )

    def add_request(self, req: Request, *, admit_check: bool = True) -> None:
        """Queue ``req``; raises InvalidRequestError (never fits) or RequestRejectedError."""
        self.check_fits(req)
        state = self.admission_state()
        if admit_check:
            verdict = self.admission.check(req, state)
            if verdict is not None:
                reason, message, retry_after = verdict
                self.rejections[reason] = self.rejections.get(reason, 0) + 1
                raise RequestRejectedError(message, reason=reason, retry_after=retry_after)
        req.status = RequestStatus.WAITING
        self.waiting.add(req)
        self.requests[req.request_id] = req
        p = state.predictor
        self.predictions[req.request_id] = LatencyPrediction(
            prefill_s=(state.prefill_tokens_ahead + req.num_tokens - req.num_computed_tokens)
            * p.prefill_token_s,
            decode_step_s=p.decode_step_s,
        )

    # ---- the step -----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill
        order = self.running.sorted(lambda r: self.ordering.key(r, now))
        scheduled_ids: set[str] = set()

        for req in order:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room
            if not self.kv.is_ready(req):
                continue  # its blocks are still being copied in (async tier copies)
            # Cache positions stop at max_model_len; a KV policy's cap bounds the
            # chunk too (its cache holds num_kv_tokens, see Request.kv_room).
            num_new = min(
                req.num_tokens - req.num_computed_tokens,
                self.max_model_len - req.num_kv_tokens,
                req.kv_room(),
            )
            if num_new <= 0:
                continue
            if num_new > budget:
                if not chunked and out.scheduled:
                    continue
                # Without chunking a prompt larger than the budget still runs whole,
                # alone in its step (vLLM requires budget >= max_model_len instead).
                num_new = budget if chunked else num_new
            while not self.kv.allocate_slots(req, num_new):
                candidates = [
                    r for r in order if r.request_id not in scheduled_ids and r in self.running
                ]
                victim = self.preemption.pick_victim(candidates, req, self.ordering, now)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
            scheduled_ids.add(req.request_id)
            budget -= num_new

        if not out.preempted:
            self._admit_waiting(out, budget, now)
            self._reserve_draft_slots(out)
        for s in out.scheduled:
            if s.req.metrics.first_scheduled_time is None:
                s.req.metrics.first_scheduled_time = now
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting requests in policy order while budget, slots and blocks last.

        The choices 1..n-1 of an n > 1 request wait (with prefix caching on)
        until choice 0 has computed the shared prompt; they then find its full
        blocks in the prefix cache like any other hit, and compute only the
        partial tail. With prefix caching off each choice computes its prompt.
        """
        chunked = self.config.enable_chunked_prefill
        for req in self.waiting.sorted(lambda r: self.ordering.key(r, now)):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            src = req.prefix_source
            if (
                self.kv.enable_prefix_caching
                and src is not None
                and not src.is_finished
                and src.num_computed_tokens < src.num_prompt_tokens
            ):
                continue  # wait until the first choice has computed the shared prompt
            hit = self.kv.find_cached_prefix(req)
            num_new = min(
                req.num_tokens - req.num_computed_tokens - hit.num_tokens,
                req.kv_room() - hit.num_tokens,
            )
            if num_new > budget:
                if not chunked and out.scheduled:
                    break
                num_new = budget if chunked else num_new
            if not self.kv.can_allocate(req, num_new, hit):
                break
            self.kv.allocate_slots(req, 0, hit)  # take the hit (any tier)
            if req.metrics.first_scheduled_time is None:
                self.kv.record_prefix_query(req, hit)
                req.num_cached_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.waiting.discard(req)
            self.running.add(req)
            if not self.kv.is_ready(req):
                # Async tier copies: its blocks arrive after this step; it runs
                # (and takes the slots for its new tokens) once they have.
                continue
            allocated = self.kv.allocate_slots(req, num_new)
            assert allocated, "can_allocate said the blocks were there"
            out.scheduled.append(ScheduledRequest(req, num_new, req.num_computed_tokens))
            budget -= num_new

    def _reserve_draft_slots(self, out: SchedulerOutput) -> None:
        """Slots for speculative drafts: up to ``req.num_lookahead_tokens`` past the last
        token of each scheduled chunk that reaches it, from what budget and free blocks
        are left once everyone else is scheduled (drafts never preempt or delay a
        request), in scheduling order, never past ``max_model_len``."""
        budget = self.config.max_num_batched_tokens - out.num_batched_tokens
        for s in out.scheduled:
            req = s.req
            k = min(req.num_lookahead_tokens, budget, self.max_model_len - req.num_tokens)
            if k <= 0 or not s.completes_sequence:
                continue
            while k > 0 and not self.kv.allocate_slots(req, s.num_new_tokens + k):
                k -= 1
            if k:
                s.num_new_tokens += k
                s.num_draft_tokens = s.num_lookahead_slots = k
                budget -= k

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Swap ``victim`` out when the mode and the host tier allow it, else recompute."""
        self.running.discard(victim)
        if self.config.preemption_mode == "swap" and self.kv.swap_out(victim):
            self.num_swap_preemptions += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.metrics.num_preemptions += 1
        self.waiting.add(victim)
        self.num_preemptions += 1
        self._preemption_times.append(self.clock())
        out.preempted.append(victim)

    def update_after_step(
        self, out: SchedulerOutput, rolled_back: Mapping[str, int] | None = None
    ) -> None:
        """Advance ``num_computed_tokens`` for what ran; cache the full blocks.

        ``rolled_back[request_id]``: trailing positions of the request's chunk
        whose KV is not kept (rejected drafts, or positions a draft model did
        not compute): ``num_computed_tokens`` stops before them, and blocks
        that hold only such slots (or reserved slots no draft filled) go back
        to the pool. They were never hashed: only computed, full blocks are.
        """
        for s in out.scheduled:
            back = rolled_back.get(s.req.request_id, 0) if rolled_back else 0
            if not 0 <= back <= s.num_draft_tokens + 1:
                raise ValueError(f"cannot roll back {back} positions of {s.req.request_id}")
            s.req.num_computed_tokens += s.num_new_tokens - back
            if s.num_lookahead_slots:
                self.kv.free_uncomputed_blocks(s.req)
            self.kv.cache_computed_blocks(s.req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End ``req`` (any way it ends) and give back all its blocks."""
        if req.is_finished:
            return
        self.running.discard(req)
        self.waiting.discard(req)
        req.status = status
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        now = self.clock()
        req.metrics.finished_time = now
        prediction = self.predictions.pop(req.request_id, None)
        # Aborted / failed requests say nothing about how long a completion takes.
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            if prediction is not None:
                self.prediction_errors.record(
                    prediction.completion_s(req.num_output_tokens), now - req.arrival_time
                )
            if req.deadline is not None and now > req.deadline:
                self.latency_budget_misses += 1

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def check_invariants(self) -> None:
        """Every tier's accounting; every reference held by a live request (KVCacheManager)."""
        self.kv.check_invariants([*self.running, *self.waiting])
