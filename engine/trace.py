"""Per-request decode traces: typed records with units, a bounded store, a privacy review.

A trace tells one request's story as the engine saw it: how long it waited,
each prefill chunk (tokens, offset, ms), each decode step (ms, batch size),
KV blocks held, prefix-cache hits, preemptions, token slots an MoE expert
capacity rerouted or dropped, and how it finished. Units are
in the field names (``_ms``, ``_s``, ``num_``); times are ``time.monotonic``.

Privacy: by default a trace holds metadata only. Prompt/output text, token ids
and the OpenAI ``user`` field are recorded only when the engine was started
with ``log_prompts``, and :func:`review_for_publication` strips them (text is
kept only with ``allow_text=True``; ids and ``user`` never leave).

The engine loop drives a :class:`TraceRecorder` (or :class:`NullTraceRecorder`
when tracing is off); the server reads finished or in-flight traces through
:meth:`TraceStore.get`. This module must not import ``server``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

# Allowed slack when checking that spans add up to the end-to-end time: the
# spans are measured by different clock reads, so they differ by microseconds.
TIMING_TOLERANCE_MS = 1.0


@dataclass(frozen=True)
class QueueWait:
    """Time spent waiting before being scheduled (initially, or after a preemption)."""

    kind: ClassVar[str] = "queue_wait"
    wait_ms: float


@dataclass(frozen=True)
class PrefillChunk:
    """One prefill chunk: ``num_tokens`` prompt tokens starting at ``start_offset``."""

    kind: ClassVar[str] = "prefill_chunk"
    num_tokens: int
    start_offset: int  # tokens already computed (or served from the prefix cache) before it
    duration_ms: float


@dataclass(frozen=True)
class DecodeStep:
    """One decode step this request took part in, in a batch of ``batch_size`` sequences.

    With speculation, ``num_draft_tokens`` drafts were verified in it and
    ``num_accepted_tokens`` of them accepted (the step emitted one more token).
    """

    kind: ClassVar[str] = "decode_step"
    duration_ms: float
    batch_size: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True)
class KvBlocks:
    """The number of KV blocks the request held after a change."""

    kind: ClassVar[str] = "kv_blocks"
    num_blocks: int


@dataclass(frozen=True)
class PrefixHit:
    """Prompt tokens served from the prefix cache instead of being computed,
    and how many of them came from each KV tier (device pool, host, disk)."""

    kind: ClassVar[str] = "prefix_hit"
    num_tokens: int
    device_tokens: int = 0
    host_tokens: int = 0
    disk_tokens: int = 0


@dataclass(frozen=True)
class Preempted:
    """The request lost its KV blocks and went back to the waiting queue at ``at_s``:
    ``mode`` "recompute" (freed) or "swap" (parked in the host tier)."""

    kind: ClassVar[str] = "preempted"
    at_s: float
    mode: str = "recompute"


@dataclass(frozen=True)
class Finished:
    """The request finished at ``at_s`` with ``reason`` (stop, length, abort, error)."""

    kind: ClassVar[str] = "finished"
    at_s: float
    reason: str


@dataclass(frozen=True)
class MoeCapacity:
    """Mixture-of-Experts capacity in one step: the request's token slots (summed over
    layers) moved to an expert outside their top-k, and dropped (residual only)."""

    kind: ClassVar[str] = "moe_capacity"
    num_rerouted: int
    num_dropped: int


TraceEvent = (
    QueueWait
    | PrefillChunk
    | DecodeStep
    | KvBlocks
    | PrefixHit
    | Preempted
    | Finished
    | MoeCapacity
)


@dataclass
class RequestTrace:
    """One request's events in order. Private fields stay ``None`` unless ``log_prompts``.

    ``num_dropped_events`` counts events not stored because the trace reached
    its event cap (memory bound); sums over events are then lower bounds.
    """

    request_id: str
    arrival_s: float
    events: list[TraceEvent] = field(default_factory=list)
    num_dropped_events: int = 0
    # Private content: only with log_prompts, never published by default.
    prompt_text: str | None = None
    output_text: str | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    user: str | None = None
    # Time the request last entered the waiting queue (arrival or preemption).
    _queued_since_s: float | None = field(default=None, repr=False)

    @property
    def finished(self) -> Finished | None:
        """The finish event, if the request has finished."""
        for event in reversed(self.events):
            if isinstance(event, Finished):
                return event
        return None


@dataclass(frozen=True)
class TimingSummary:
    """Span sums of a trace in milliseconds, and whether they fit in the e2e time."""

    queue_ms: float
    prefill_ms: float
    decode_ms: float
    e2e_ms: float | None  # None while the request has not finished
    accounted_ms: float
    consistent: bool


def summarize_timings(trace: RequestTrace) -> TimingSummary:
    """Sum queue, prefill and decode spans; consistent iff they fit within e2e (+tolerance).

    The spans are disjoint intervals of the request's life, so their sum can
    never exceed arrival->finish; gaps (scheduling overhead, detokenizing,
    steps the request sat out) are allowed, overlaps are a recording bug.
    """
    queue = sum(e.wait_ms for e in trace.events if isinstance(e, QueueWait))
    prefill = sum(e.duration_ms for e in trace.events if isinstance(e, PrefillChunk))
    decode = sum(e.duration_ms for e in trace.events if isinstance(e, DecodeStep))
    accounted = queue + prefill + decode
    fin = trace.finished
    e2e = None if fin is None else (fin.at_s - trace.arrival_s) * 1000.0
    consistent = e2e is not None and e2e >= 0 and accounted <= e2e + TIMING_TOLERANCE_MS
    return TimingSummary(queue, prefill, decode, e2e, accounted, consistent)


class TraceStore:
    """At most ``max_traces`` traces in memory, least recently used evicted first.

    All operations are O(1) (an ``OrderedDict``) and thread-safe: the engine
    loop writes while the server reads. Each trace keeps at most
    ``max_events_per_trace`` events, plus its finish event (a long generation
    would otherwise grow one trace without bound).
    """

    def __init__(self, max_traces: int, max_events_per_trace: int = 4096) -> None:
        if max_traces < 1 or max_events_per_trace < 1:
            raise ValueError("max_traces and max_events_per_trace must be >= 1")
        self.max_traces = max_traces
        self.max_events_per_trace = max_events_per_trace
        self._traces: OrderedDict[str, RequestTrace] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._traces)

    def put(self, trace: RequestTrace) -> None:
        """Insert (or replace) a trace as most recently used, evicting the oldest if full."""
        with self._lock:
            self._traces[trace.request_id] = trace
            self._traces.move_to_end(trace.request_id)
            while len(self._traces) > self.max_traces:
                self._traces.popitem(last=False)

    def get(self, request_id: str) -> RequestTrace | None:
        """The trace of ``request_id`` (marking it recently used), or None if unknown/evicted."""
        with self._lock:
            trace = self._traces.get(request_id)
            if trace is not None:
                self._traces.move_to_end(request_id)
            return trace

    def append(self, request_id: str, event: TraceEvent) -> RequestTrace | None:
        """Append ``event`` to a stored trace; returns the trace, or None if not stored."""
        with self._lock:
            trace = self._traces.get(request_id)
            if trace is None:
                return None
            self._traces.move_to_end(request_id)
            # The finish event is exempt from the cap: without it the trace would
            # read as unfinished and its timings could not be checked at all.
            if len(trace.events) < self.max_events_per_trace or isinstance(event, Finished):
                trace.events.append(event)
            else:
                trace.num_dropped_events += 1
            return trace


class TraceRecorder:
    """Turns engine-loop callbacks into :class:`RequestTrace` events in a :class:`TraceStore`.

    Callbacks for a request id that was never announced with ``on_arrival`` (or
    whose trace was evicted) are dropped: tracing must never fail a request.
    Times ``t`` are ``time.monotonic`` seconds; durations are milliseconds.
    """

    enabled: ClassVar[bool] = True

    def __init__(self, store: TraceStore, log_prompts: bool = False) -> None:
        self.store = store
        self.log_prompts = log_prompts

    def on_arrival(self, req_id: str, t: float) -> None:
        """Start a trace; the request is waiting from ``t``."""
        self.store.put(RequestTrace(request_id=req_id, arrival_s=t, _queued_since_s=t))

    def on_scheduled(self, req_id: str, t: float) -> None:
        """The request got scheduled at ``t``: records the queue wait since it last queued."""
        trace = self.store.get(req_id)
        if trace is None or trace._queued_since_s is None:
            return  # already running: a later step of the same residency
        wait_ms = max(0.0, (t - trace._queued_since_s) * 1000.0)
        trace._queued_since_s = None
        self.store.append(req_id, QueueWait(wait_ms=wait_ms))

    def on_prefill_chunk(
        self, req_id: str, num_tokens: int, start_offset: int, duration_ms: float
    ) -> None:
        """A prefill chunk of ``num_tokens`` tokens at computed-token offset ``start_offset``."""
        self.store.append(
            req_id,
            PrefillChunk(num_tokens=num_tokens, start_offset=start_offset, duration_ms=duration_ms),
        )

    def on_decode_step(
        self,
        req_id: str,
        duration_ms: float,
        batch_size: int,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
    ) -> None:
        """A decode step of ``duration_ms`` shared by ``batch_size`` sequences (verifying
        ``num_draft_tokens`` drafts, of which ``num_accepted_tokens`` were accepted)."""
        self.store.append(
            req_id,
            DecodeStep(
                duration_ms=duration_ms,
                batch_size=batch_size,
                num_draft_tokens=num_draft_tokens,
                num_accepted_tokens=num_accepted_tokens,
            ),
        )

    def on_blocks(self, req_id: str, num_blocks: int) -> None:
        """The request now holds ``num_blocks`` KV blocks."""
        self.store.append(req_id, KvBlocks(num_blocks=num_blocks))

    def on_prefix_hit(
        self, req_id: str, tokens: int, by_tier: dict[str, int] | None = None
    ) -> None:
        """``tokens`` prompt tokens were served from the prefix cache (``by_tier``:
        how many from each of device, host, disk)."""
        t = by_tier or {}
        self.store.append(
            req_id,
            PrefixHit(
                num_tokens=tokens,
                device_tokens=t.get("device", 0),
                host_tokens=t.get("host", 0),
                disk_tokens=t.get("disk", 0),
            ),
        )

    def on_moe_capacity(self, req_id: str, num_rerouted: int, num_dropped: int) -> None:
        """An MoE capacity limit rerouted / dropped some of the request's slots this step."""
        self.store.append(req_id, MoeCapacity(num_rerouted=num_rerouted, num_dropped=num_dropped))

    def on_preempted(self, req_id: str, t: float, mode: str = "recompute") -> None:
        """Preempted at ``t`` (``mode`` recompute or swap): the request waits again from ``t``."""
        trace = self.store.append(req_id, Preempted(at_s=t, mode=mode))
        if trace is not None:
            trace._queued_since_s = t

    def on_finished(self, req_id: str, t: float, reason: str) -> None:
        """Finished at ``t`` with ``reason``; a request aborted while waiting gets its wait."""
        trace = self.store.get(req_id)
        if trace is None:
            return
        if trace._queued_since_s is not None:
            self.store.append(
                req_id, QueueWait(wait_ms=max(0.0, (t - trace._queued_since_s) * 1e3))
            )
            trace._queued_since_s = None
        self.store.append(req_id, Finished(at_s=t, reason=reason))

    def on_content(
        self,
        req_id: str,
        prompt_text: str | None = None,
        output_text: str | None = None,
        prompt_token_ids: list[int] | None = None,
        output_token_ids: list[int] | None = None,
        user: str | None = None,
    ) -> bool:
        """Attach private content; stored only with ``log_prompts``. Returns whether it was kept."""
        if not self.log_prompts:
            return False
        trace = self.store.get(req_id)
        if trace is None:
            return False
        if prompt_text is not None:
            trace.prompt_text = prompt_text
        if output_text is not None:
            trace.output_text = output_text
        if prompt_token_ids is not None:
            trace.prompt_token_ids = list(prompt_token_ids)
        if output_token_ids is not None:
            trace.output_token_ids = list(output_token_ids)
        if user is not None:
            trace.user = user
        return True


class NullTraceRecorder(TraceRecorder):
    """Tracing disabled: every callback is a no-op, nothing is stored."""

    enabled: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__(TraceStore(max_traces=1), log_prompts=False)

    def on_arrival(self, req_id: str, t: float) -> None:
        return None

    def on_scheduled(self, req_id: str, t: float) -> None:
        return None

    def on_prefill_chunk(
        self, req_id: str, num_tokens: int, start_offset: int, duration_ms: float
    ) -> None:
        return None

    def on_decode_step(
        self,
        req_id: str,
        duration_ms: float,
        batch_size: int,
        num_draft_tokens: int = 0,
        num_accepted_tokens: int = 0,
    ) -> None:
        return None

    def on_blocks(self, req_id: str, num_blocks: int) -> None:
        return None

    def on_prefix_hit(
        self, req_id: str, tokens: int, by_tier: dict[str, int] | None = None
    ) -> None:
        return None

    def on_moe_capacity(self, req_id: str, num_rerouted: int, num_dropped: int) -> None:
        return None

    def on_preempted(self, req_id: str, t: float, mode: str = "recompute") -> None:
        return None

    def on_finished(self, req_id: str, t: float, reason: str) -> None:
        return None

    def on_content(
        self,
        req_id: str,
        prompt_text: str | None = None,
        output_text: str | None = None,
        prompt_token_ids: list[int] | None = None,
        output_token_ids: list[int] | None = None,
        user: str | None = None,
    ) -> bool:
        return False


_TEXT_FIELDS = ("prompt_text", "output_text")
_NEVER_PUBLISHED = ("prompt_token_ids", "output_token_ids", "user")


def review_for_publication(trace: RequestTrace, allow_text: bool = False) -> dict[str, Any]:
    """A publishable dict of ``trace``: private content stripped, timings checked.

    Always stripped: token ids and ``user`` (identifying, and never needed to
    read a trace). Prompt/output text is kept only with ``allow_text=True``.
    The result lists what was removed under ``redacted`` and every problem
    found under ``issues`` (timings that do not add up, unfinished request,
    dropped events); ``publishable`` is True only when ``issues`` is empty.
    """
    issues: list[str] = []
    redacted: list[str] = []
    for name in _NEVER_PUBLISHED:
        if getattr(trace, name) is not None:
            redacted.append(name)
    if not allow_text:
        redacted.extend(name for name in _TEXT_FIELDS if getattr(trace, name) is not None)

    timings = summarize_timings(trace)
    if timings.e2e_ms is None:
        issues.append("request has not finished: no end-to-end time to check spans against")
    elif timings.e2e_ms < 0:
        issues.append(f"finish precedes arrival by {-timings.e2e_ms:.3f} ms")
    elif not timings.consistent:
        issues.append(
            f"spans exceed e2e: queue {timings.queue_ms:.3f} + prefill {timings.prefill_ms:.3f}"
            f" + decode {timings.decode_ms:.3f} = {timings.accounted_ms:.3f} ms"
            f" > e2e {timings.e2e_ms:.3f} ms"
        )
    if trace.num_dropped_events:
        issues.append(f"{trace.num_dropped_events} events dropped at the per-trace cap")

    out: dict[str, Any] = {
        "request_id": trace.request_id,
        "arrival_s": trace.arrival_s,
        "events": [{"kind": e.kind, **asdict(e)} for e in trace.events],
        "timings": asdict(timings),
        "redacted": redacted,
        "issues": issues,
        "publishable": not issues,
    }
    if allow_text:
        for name in _TEXT_FIELDS:
            value = getattr(trace, name)
            if value is not None:
                out[name] = value
    return out
