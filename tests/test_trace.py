"""engine.trace: timings add up, no text without log_prompts, review strips private content."""

from __future__ import annotations

import json

import pytest

from engine.trace import (
    DecodeStep,
    Finished,
    NullTraceRecorder,
    Preempted,
    PrefillChunk,
    PrefixHit,
    QueueWait,
    RequestTrace,
    TraceRecorder,
    TraceStore,
    review_for_publication,
    summarize_timings,
)


def record_request(rec: TraceRecorder, rid: str = "r1") -> None:
    """arrive 0.0, wait 100 ms, 2 prefill chunks, 3 decodes, preempt, requeue, finish."""
    rec.on_arrival(rid, 10.0)
    rec.on_scheduled(rid, 10.1)  # 100 ms queued
    rec.on_prefix_hit(rid, 16)
    rec.on_blocks(rid, 2)
    rec.on_prefill_chunk(rid, num_tokens=32, start_offset=16, duration_ms=20.0)
    rec.on_scheduled(rid, 10.125)  # still running: no second wait
    rec.on_prefill_chunk(rid, num_tokens=8, start_offset=48, duration_ms=5.0)
    rec.on_decode_step(rid, duration_ms=10.0, batch_size=4)
    rec.on_preempted(rid, 10.2)
    rec.on_scheduled(rid, 10.25)  # 50 ms queued again
    rec.on_decode_step(rid, duration_ms=12.0, batch_size=3)
    rec.on_decode_step(rid, duration_ms=8.0, batch_size=2)
    rec.on_finished(rid, 10.4, "stop")


def test_events_and_timings_add_up() -> None:
    store = TraceStore(max_traces=4)
    rec = TraceRecorder(store)
    record_request(rec)
    trace = store.get("r1")
    assert trace is not None
    kinds = [e.kind for e in trace.events]
    assert kinds == [
        "queue_wait",
        "prefix_hit",
        "kv_blocks",
        "prefill_chunk",
        "prefill_chunk",
        "decode_step",
        "preempted",
        "queue_wait",
        "decode_step",
        "decode_step",
        "finished",
    ]
    assert trace.events[3] == PrefillChunk(num_tokens=32, start_offset=16, duration_ms=20.0)
    assert trace.events[1] == PrefixHit(num_tokens=16)
    assert trace.events[-1] == Finished(at_s=10.4, reason="stop")
    t = summarize_timings(trace)
    assert t.queue_ms == pytest.approx(150.0)
    assert t.prefill_ms == pytest.approx(25.0)
    assert t.decode_ms == pytest.approx(30.0)
    assert t.e2e_ms == pytest.approx(400.0)
    assert t.accounted_ms == pytest.approx(205.0)
    assert t.consistent
    review = review_for_publication(trace)
    assert review["issues"] == [] and review["publishable"]
    assert review["timings"]["queue_ms"] == pytest.approx(150.0)
    json.dumps(review)  # publishable means serializable


def test_timings_that_do_not_add_up_are_reported() -> None:
    trace = RequestTrace(
        request_id="bad",
        arrival_s=0.0,
        events=[QueueWait(wait_ms=50.0), DecodeStep(duration_ms=80.0, batch_size=1)],
    )
    trace.events.append(Finished(at_s=0.1, reason="length"))  # e2e 100 ms < 130 ms of spans
    review = review_for_publication(trace)
    assert not review["publishable"]
    assert len(review["issues"]) == 1 and "exceed e2e" in review["issues"][0]
    unfinished = RequestTrace(request_id="u", arrival_s=0.0, events=[QueueWait(wait_ms=1.0)])
    assert "not finished" in review_for_publication(unfinished)["issues"][0]


def test_abort_while_waiting_records_wait() -> None:
    store = TraceStore(max_traces=2)
    rec = TraceRecorder(store)
    rec.on_arrival("w", 1.0)
    rec.on_finished("w", 1.5, "abort")
    trace = store.get("w")
    assert trace is not None
    assert trace.events == [QueueWait(wait_ms=500.0), Finished(at_s=1.5, reason="abort")]
    assert summarize_timings(trace).consistent


def test_no_text_without_log_prompts() -> None:
    store = TraceStore(max_traces=2)
    rec = TraceRecorder(store, log_prompts=False)
    record_request(rec)
    kept = rec.on_content("r1", prompt_text="secret prompt", output_text="secret out", user="bob")
    assert kept is False
    trace = store.get("r1")
    assert trace is not None
    assert trace.prompt_text is None and trace.output_text is None and trace.user is None
    assert "secret" not in json.dumps(review_for_publication(trace, allow_text=True))


def test_review_strips_private_content() -> None:
    store = TraceStore(max_traces=2)
    rec = TraceRecorder(store, log_prompts=True)
    record_request(rec)
    assert rec.on_content(
        "r1",
        prompt_text="secret prompt",
        output_text="secret out",
        prompt_token_ids=[1, 2, 3],
        output_token_ids=[4],
        user="alice@example.com",
    )
    trace = store.get("r1")
    assert trace is not None and trace.prompt_text == "secret prompt"

    public = review_for_publication(trace)
    dumped = json.dumps(public)
    assert "secret" not in dumped and "alice" not in dumped and "[1, 2, 3]" not in dumped
    assert not {"prompt_text", "output_text", "prompt_token_ids", "user"} & set(public)
    assert set(public["redacted"]) == {
        "prompt_text",
        "output_text",
        "prompt_token_ids",
        "output_token_ids",
        "user",
    }
    # allow_text keeps the text only; ids and user never leave.
    with_text = review_for_publication(trace, allow_text=True)
    assert with_text["prompt_text"] == "secret prompt"
    assert with_text["output_text"] == "secret out"
    dumped = json.dumps(with_text)
    assert "alice" not in dumped and "[1, 2, 3]" not in dumped and "[4]" not in dumped
    assert set(with_text["redacted"]) == {"prompt_token_ids", "output_token_ids", "user"}


def test_store_is_lru_bounded() -> None:
    store = TraceStore(max_traces=2)
    rec = TraceRecorder(store)
    rec.on_arrival("a", 0.0)
    rec.on_arrival("b", 0.0)
    assert store.get("a") is not None  # a is now most recent
    rec.on_arrival("c", 0.0)  # evicts b
    assert store.get("b") is None
    assert store.get("a") is not None and store.get("c") is not None
    assert len(store) == 2
    rec.on_decode_step("b", 1.0, 1)  # evicted: silently dropped, never raises
    assert store.get("b") is None


def test_event_cap_counts_dropped_events() -> None:
    store = TraceStore(max_traces=1, max_events_per_trace=3)
    rec = TraceRecorder(store)
    rec.on_arrival("r", 0.0)
    rec.on_scheduled("r", 0.0)
    for _ in range(5):
        rec.on_decode_step("r", 1.0, 1)
    rec.on_finished("r", 1.0, "length")
    trace = store.get("r")
    assert trace is not None
    # 3 capped events + the finish event, which is never dropped.
    assert len(trace.events) == 4 and trace.num_dropped_events == 3
    assert trace.finished == Finished(at_s=1.0, reason="length")
    assert "dropped" in review_for_publication(trace)["issues"][0]


def test_null_recorder_stores_nothing() -> None:
    rec = NullTraceRecorder()
    assert rec.enabled is False
    record_request(rec)
    assert rec.on_content("r1", prompt_text="x") is False
    assert len(rec.store) == 0


def test_preempted_event_carries_time() -> None:
    store = TraceStore(max_traces=1)
    rec = TraceRecorder(store)
    record_request(rec)
    trace = store.get("r1")
    assert trace is not None
    assert Preempted(at_s=10.2) in trace.events
