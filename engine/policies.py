"""Scheduling policies as small strategy objects: ordering, preemption victim, admission.

The scheduler body asks these; it has no branch per policy.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import Request


class OrderingPolicy(ABC):
    """Orders requests: a smaller key runs sooner (and is preempted later)."""

    @abstractmethod
    def key(self, req: Request, now: float) -> tuple[float, ...]: ...


class FCFSOrdering(OrderingPolicy):
    """First come, first served."""

    def key(self, req: Request, now: float) -> tuple[float, ...]:
        return (req.arrival_time,)


@dataclass
class PriorityOrdering(OrderingPolicy):
    """(effective priority, deadline, arrival): lower priority value runs sooner.

    Aging: a waiting request's effective priority improves by one level per
    ``aging_interval_s`` seconds since arrival, so a low-priority request
    cannot starve forever (after ``k * aging_interval_s`` it competes as if
    its priority were ``k`` lower). Among equal effective priorities the
    earliest deadline (latency budget) goes first (EDF); requests without a
    deadline come after those with one, then by arrival.
    """

    aging_interval_s: float = 30.0

    def key(self, req: Request, now: float) -> tuple[float, ...]:
        aged = 0.0
        if self.aging_interval_s > 0:
            aged = math.floor(max(0.0, now - req.arrival_time) / self.aging_interval_s)
        deadline = req.deadline if req.deadline is not None else math.inf
        return (req.priority - aged, deadline, req.arrival_time)


class PreemptionPolicy(ABC):
    """Chooses whom to preempt when ``requester`` cannot grow."""

    @abstractmethod
    def pick_victim(
        self,
        candidates: Sequence[Request],
        requester: Request,
        ordering: OrderingPolicy,
        now: float,
    ) -> Request:
        """Return the victim among ``candidates`` (which include ``requester``)."""


class LowestPriorityLatestVictim(PreemptionPolicy):
    """Preempt the request that would run last: lowest priority, latest arrival.

    Never a request that orders before the requester: if the requester is
    itself the last in order, it is the victim (it waits, the others go on).
    Priority here is the request's own (un-aged) priority, then arrival.
    """

    def pick_victim(
        self,
        candidates: Sequence[Request],
        requester: Request,
        ordering: OrderingPolicy,
        now: float,
    ) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))


@dataclass
class LatencyPredictor:
    """Predicts step times from measured ones: ``step_s ~= base_s + per_token_s * tokens``.

    Both coefficients are exponential moving averages fitted online from
    (tokens in step, seconds) pairs, split by whether the step was decode-only
    (the fixed per-step cost dominates) or carried prefill (per-token cost
    dominates). Until a step is measured, the priors below are used.
    """

    decode_step_s: float = 0.05
    prefill_token_s: float = 0.0005
    alpha: float = 0.2
    samples: int = 0

    def observe(self, num_prefill_tokens: int, num_decodes: int, seconds: float) -> None:
        self.samples += 1
        if num_prefill_tokens == 0 and num_decodes:
            self.decode_step_s += self.alpha * (seconds - self.decode_step_s)
        elif num_prefill_tokens:
            rest = max(seconds - (self.decode_step_s if num_decodes else 0.0), 0.0)
            per = rest / num_prefill_tokens
            self.prefill_token_s += self.alpha * (per - self.prefill_token_s)

    def predict(self, prefill_tokens_ahead: int, own_prefill: int, own_output: int) -> float:
        """Seconds until a new request's last token: queued prefill + own prefill + decode."""
        return (
            (prefill_tokens_ahead + own_prefill) * self.prefill_token_s
            + max(own_output - 1, 0) * self.decode_step_s
            + self.decode_step_s
        )

    def predict_ttft(self, prefill_tokens_ahead: int, own_prefill: int) -> float:
        return (prefill_tokens_ahead + own_prefill) * self.prefill_token_s + self.decode_step_s


@dataclass
class LatencyPrediction:
    """What the predictor said at admission, kept to score it when the request ends.

    ``prefill_s`` covers the prefill queued ahead plus the request's own;
    ``decode_step_s`` is the per-token decode cost then. The completion time
    predicted for ``n`` output tokens is ``prefill_s + max(n, 1) * decode_step_s``
    (``LatencyPredictor.predict`` with ``own_output = n``): scoring uses the
    number of tokens actually produced, so an early EOS is not counted as a
    prediction error.
    """

    prefill_s: float
    decode_step_s: float

    def completion_s(self, num_output_tokens: int) -> float:
        return self.prefill_s + max(num_output_tokens, 1) * self.decode_step_s


@dataclass
class PredictionErrorStats:
    """Running relative error of admission-time predictions vs actual completion times.

    Relative error of one request = ``(predicted - actual) / actual`` where
    actual = finished - arrival (seconds, engine clock). Positive means the
    predictor was pessimistic.
    """

    samples: int = 0
    sum_abs_rel_error: float = 0.0
    sum_rel_error: float = 0.0

    def record(self, predicted_s: float, actual_s: float) -> None:
        if actual_s <= 0:
            return  # a zero-length span (fake clocks) has no relative error
        rel = (predicted_s - actual_s) / actual_s
        self.samples += 1
        self.sum_abs_rel_error += abs(rel)
        self.sum_rel_error += rel

    @property
    def mean_abs_rel_error(self) -> float:
        return self.sum_abs_rel_error / self.samples if self.samples else 0.0

    @property
    def mean_rel_error(self) -> float:
        return self.sum_rel_error / self.samples if self.samples else 0.0


@dataclass
class AdmissionState:
    """What admission looks at: queue, KV pressure and predicted latency."""

    num_waiting: int
    max_waiting: int
    kv_usage: float
    preemptions_per_s: float
    num_blocks: int
    block_size: int
    prefill_tokens_ahead: int
    predictor: LatencyPredictor
    now: float


class AdmissionPolicy(ABC):
    """Decides, at arrival, whether a request may join the waiting queue.

    Returns None to admit, or a (reason, message, retry_after_s) triple to
    reject with 429. A request that can never fit raises InvalidRequestError.
    """

    @abstractmethod
    def check(self, req: Request, state: AdmissionState) -> tuple[str, str, float] | None: ...


@dataclass
class PressureAwareAdmission(AdmissionPolicy):
    """Bounded queue + KV pressure + latency budgets.

    Rules, in order:
    1. The waiting queue is full (``max_waiting``): reject, reason ``queue_full``.
    2. Eviction pressure: KV usage at or above ``kv_high_watermark`` while the
       engine preempts more than ``max_preemptions_per_s`` and others already
       wait: reject, reason ``kv_pressure`` (admitting more would only cause
       more recompute).
    3. A latency budget (``latency_budget_ms`` / ``ttft_budget_ms``) that the
       predictor says cannot be met: reject at once, reason ``latency_budget``,
       with the predicted time in the message.
    """

    kv_high_watermark: float = 0.95
    max_preemptions_per_s: float = 2.0

    def check(self, req: Request, state: AdmissionState) -> tuple[str, str, float] | None:
        if state.num_waiting >= state.max_waiting:
            return (
                "queue_full",
                f"The server is overloaded: {state.num_waiting} requests are already waiting "
                f"(--max-waiting-requests {state.max_waiting}). Retry later.",
                1.0,
            )
        if (
            state.kv_usage >= self.kv_high_watermark
            and state.preemptions_per_s > self.max_preemptions_per_s
            and state.num_waiting > 0
        ):
            return (
                "kv_pressure",
                f"The server is under KV-cache pressure ({state.kv_usage:.0%} used, "
                f"{state.preemptions_per_s:.1f} preemptions/s). Retry later.",
                2.0,
            )
        own_prefill = req.num_tokens - req.num_computed_tokens
        max_out = req.max_total_tokens - req.num_prompt_tokens
        if req.ttft_deadline is not None:
            predicted = state.predictor.predict_ttft(state.prefill_tokens_ahead, own_prefill)
            budget = req.ttft_deadline - state.now
            if predicted > budget:
                return (
                    "latency_budget",
                    f"ttft_budget_ms cannot be met: predicted time to first token is "
                    f"{predicted * 1000:.0f} ms, budget {budget * 1000:.0f} ms.",
                    max(predicted - budget, 0.5),
                )
        if req.deadline is not None:
            predicted = state.predictor.predict(state.prefill_tokens_ahead, own_prefill, max_out)
            budget = req.deadline - state.now
            if predicted > budget:
                return (
                    "latency_budget",
                    f"latency_budget_ms cannot be met: predicted completion time is "
                    f"{predicted * 1000:.0f} ms for up to {max_out} tokens, budget "
                    f"{budget * 1000:.0f} ms.",
                    max(predicted - budget, 0.5),
                )
        return None
