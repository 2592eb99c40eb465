"""Exact scheduler decisions with a fake clock and no model."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, RequestRejectedError
from engine.kv.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(
    num_blocks: int = 64, block_size: int = 4, prefix: bool = True, **cfg: object
) -> tuple[Scheduler, Clock]:
    clock = Clock()
    config = EngineConfig(block_size=block_size, enable_prefix_caching=prefix, **cfg)  # type: ignore[arg-type]
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(config, kv, max_model_len=4096, clock=clock), clock


def req(
    rid: str, n_prompt: int, clock: Clock, max_tokens: int = 8, priority: int = 0, tok: int = 1
) -> Request:
    return Request(
        rid,
        rid,
        0,
        [tok] * n_prompt,
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_time=clock(),
    )


def run_step(s: Scheduler, next_token: int = 5) -> SchedulerOutput:
    """Schedule, pretend the model ran, append a token to each that sampled."""
    out = s.schedule()
    s.update_after_step(out)
    for sr in out.scheduled:
        if sr.completes_sequence:
            sr.req.append_output(next_token)
    s.check_invariants()
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.req.request_id, x.num_new_tokens) for x in out.scheduled]


def test_chunked_prefill_decodes_first_then_chunks() -> None:
    s, clock = make(max_num_batched_tokens=8)
    a = req("a", 3, clock)
    s.add_request(a)
    assert plan(run_step(s)) == [("a", 3)]
    clock.t += 1
    b = req("b", 20, clock)
    s.add_request(b)
    # decode of a (1 token) first, then 7 tokens of b's prompt
    assert plan(run_step(s)) == [("a", 1), ("b", 7)]
    assert plan(run_step(s)) == [("a", 1), ("b", 7)]
    assert plan(run_step(s)) == [("a", 1), ("b", 6)]
    assert b.num_output_tokens == 1  # only the chunk reaching the end sampled
    assert plan(run_step(s)) == [("a", 1), ("b", 1)]


def test_without_chunking_a_prompt_waits_for_room() -> None:
    s, clock = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    a = req("a", 3, clock)
    s.add_request(a)
    run_step(s)
    b = req("b", 6, clock)
    s.add_request(b)
    # a decodes (1), b's 6 tokens fit the remaining 7
    assert plan(run_step(s)) == [("a", 1), ("b", 6)]
    c = req("c", 12, clock)
    s.add_request(c)
    # c (12 > budget) runs whole only in a step of its own: not beside decodes
    assert plan(run_step(s)) == [("a", 1), ("b", 1)]


def test_priority_order_and_aging() -> None:
    s, clock = make(max_num_batched_tokens=4, max_num_seqs=1)
    low = req("low", 4, clock, priority=5)
    s.add_request(low)
    clock.t += 1
    high = req("high", 4, clock, priority=0)
    s.add_request(high)
    assert plan(run_step(s)) == [("high", 4)]
    s.finish(high, RequestStatus.FINISHED_STOPPED)
    # a newer priority-1 request beats the old priority-5 one ...
    mid = req("mid", 4, clock, priority=1)
    s.add_request(mid)
    assert plan(run_step(s)) == [("mid", 4)]
    s.finish(mid, RequestStatus.FINISHED_STOPPED)
    # ... until aging: after 5 aging intervals low competes at priority 0
    clock.t += 5 * 30.0 + 1
    other = req("other", 4, clock, priority=1)
    s.add_request(other)
    assert plan(run_step(s)) == [("low", 4)]


def test_preempts_lowest_priority_latest_never_higher() -> None:
    # 4 blocks of 4 tokens: three requests of 4 prompt tokens each fill 3 blocks.
    s, clock = make(num_blocks=4, max_num_batched_tokens=64)
    a = req("a", 4, clock, priority=0)
    clock.t += 1
    b = req("b", 4, clock, priority=1)
    clock.t += 1
    c = req("c", 4, clock, priority=0)
    for r in (a, b, c):
        s.add_request(r)
    run_step(s)
    assert {r.request_id for r in s.running} == {"a", "b", "c"}
    # Each now needs a second block to decode; only one is free.
    out = run_step(s)
    assert [p.request_id for p in out.preempted] == ["b"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert plan(out) == [("a", 1), ("c", 1)]
    assert s.num_preemptions == 1


def test_preempted_request_resumes_with_prefix_hits() -> None:
    s, clock = make(num_blocks=4, max_num_batched_tokens=64)
    a = req("a", 8, clock, priority=0, tok=3)
    clock.t += 1
    b = req("b", 7, clock, priority=1, tok=4)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # a: 2 blocks, b: 2 blocks (7 prompt tokens)
    out = run_step(s)  # a needs a 3rd block: b (lower priority) is preempted
    assert [p.request_id for p in out.preempted] == ["b"]
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = run_step(s)
    # b's first full block was cached when computed and is found again.
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert plan(out) == [("b", 4)]  # 8 tokens (7 prompt + 1 output) - 4 cached


def test_n_choices_share_prompt_blocks() -> None:
    s, clock = make(max_num_batched_tokens=64)
    first = req("g-0", 10, clock)
    second = Request(
        "g-1", "g", 1, [1] * 10, first.params, arrival_time=clock(), prefix_source=first
    )
    s.add_request(first)
    s.add_request(second, admit_check=False)
    assert plan(run_step(s)) == [("g-0", 10)]  # second waits for the prompt
    out = run_step(s)
    assert plan(out) == [("g-0", 1), ("g-1", 2)]  # shares 2 full blocks, recomputes the tail
    assert second.block_ids[:2] == first.block_ids[:2]
    assert s.kv.pool.blocks[first.block_ids[0]].ref_count == 2


def test_admission_queue_full_and_never_fits() -> None:
    s, clock = make(num_blocks=4, max_waiting_requests=2)
    s.add_request(req("a", 4, clock))
    s.add_request(req("b", 4, clock))
    with pytest.raises(RequestRejectedError) as e:
        s.add_request(req("c", 4, clock))
    assert e.value.reason == "queue_full"
    assert s.rejections == {"queue_full": 1}
    with pytest.raises(InvalidRequestError, match="KV cache"):
        s.add_request(req("huge", 10, clock, max_tokens=100))


def test_latency_budget_rejected_with_prediction() -> None:
    s, clock = make()
    s.predictor.decode_step_s = 0.1
    r = req("a", 4, clock, max_tokens=50)
    r.deadline = clock() + 1.0  # 50 tokens at 100 ms cannot finish in 1 s
    with pytest.raises(RequestRejectedError, match=r"predicted completion time is \d+ ms") as e:
        s.add_request(r)
    assert e.value.reason == "latency_budget"
    ok = req("b", 4, clock, max_tokens=5)
    ok.deadline = clock() + 1.0
    s.add_request(ok)


def test_edf_among_equal_priorities() -> None:
    s, clock = make(max_num_batched_tokens=4, max_num_seqs=1)
    late = req("late", 4, clock)
    late.deadline = clock() + 100
    clock.t += 1
    soon = req("soon", 4, clock)
    soon.deadline = clock() + 10
    s.add_request(late, admit_check=False)
    s.add_request(soon, admit_check=False)
    assert plan(run_step(s)) == [("soon", 4)]


def test_finish_frees_everything() -> None:
    s, clock = make()
    a = req("a", 9, clock)
    s.add_request(a)
    run_step(s)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a.block_ids == [] and s.kv.num_free_blocks == 64
    s.check_invariants()


def test_prediction_error_scored_at_finish() -> None:
    s, clock = make(max_num_batched_tokens=64)
    s.predictor.prefill_token_s = 0.01
    s.predictor.decode_step_s = 0.1
    a = req("a", 10, clock, max_tokens=50)
    a.deadline = clock() + 10.0
    s.add_request(a)
    # Nothing ahead: predicted = 10 prompt tokens * 10 ms + n_out * 100 ms.
    b = req("b", 20, clock, max_tokens=5)
    s.add_request(b)
    # b queues behind a's 10 prompt tokens: prefill part (10 + 20) * 10 ms.
    assert s.predictions["b"].prefill_s == pytest.approx(0.3)
    for _ in range(3):
        run_step(s)
    assert a.num_output_tokens == 3
    clock.t += 0.8  # actual 0.8 s vs predicted 0.1 + 3 * 0.1 = 0.4 s: rel error -0.5
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    assert s.prediction_errors.samples == 1
    assert s.prediction_errors.mean_abs_rel_error == pytest.approx(0.5)
    assert s.prediction_errors.mean_rel_error == pytest.approx(-0.5)
    assert s.latency_budget_misses == 0
    clock.t += 10.0  # b: 3 tokens predicted 0.3 + 0.3 = 0.6 s, actual 10.8 s
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    rel_b = (0.6 - 10.8) / 10.8
    assert s.prediction_errors.samples == 2
    assert s.prediction_errors.mean_abs_rel_error == pytest.approx((0.5 + abs(rel_b)) / 2)
    assert s.prediction_errors.mean_rel_error == pytest.approx((-0.5 + rel_b) / 2)
    assert s.predictions == {}


def test_aborted_request_not_scored_and_budget_miss_counted() -> None:
    s, clock = make()
    a = req("a", 4, clock)
    s.add_request(a)
    run_step(s)
    clock.t += 5
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert s.prediction_errors.samples == 0 and s.predictions == {}
    b = req("b", 4, clock, max_tokens=2)
    b.deadline = clock() + 1.0
    s.add_request(b)
    run_step(s)
    clock.t += 2  # past b's deadline
    s.finish(b, RequestStatus.FINISHED_LENGTH)
    assert s.latency_budget_misses == 1 and s.prediction_errors.samples == 1
