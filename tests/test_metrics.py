"""server.metrics: exact counter/gauge/histogram values from synthetic stats and timings."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.outputs import RequestMetrics
from engine.stats import EngineStats
from server.metrics import (
    FINE_ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    VLLM_ITL_BUCKETS,
    Metrics,
    build_1_2_5_buckets,
)

MODEL = "smol"
L = {"model_name": MODEL, "engine": "0"}


def value(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**L, **labels})


def bucket(m: Metrics, name: str, le: float) -> float | None:
    return value(m, f"{name}_bucket", le=str(float(le)))


def test_1_2_5_buckets() -> None:
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(8192) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
    with pytest.raises(ValueError):
        build_1_2_5_buckets(0)


def test_bucket_boundaries_keep_vllms_and_refine_itl() -> None:
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert set(VLLM_ITL_BUCKETS) <= set(FINE_ITL_BUCKETS)
    assert [b for b in FINE_ITL_BUCKETS if b < 0.01] == [0.001, 0.002, 0.003, 0.005, 0.0075]
    assert list(FINE_ITL_BUCKETS) == sorted(FINE_ITL_BUCKETS)
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0


def test_gauges_and_counter_deltas() -> None:
    m = Metrics(MODEL)
    s = EngineStats(
        num_running=3,
        num_waiting=5,
        num_preempted_waiting=1,
        kv_cache_usage=0.25,
        num_total_blocks=100,
        num_free_blocks=75,
        num_steps=1,
        num_preemptions=2,
        prompt_tokens=40,
        generation_tokens=3,
        prefix_cache_queries=64,
        prefix_cache_hits=16,
        rejections={"queue_full": 2},
        latency_budget_misses=1,
        spec_decode_draft_tokens=10,
        spec_decode_accepted_tokens=7,
    )
    m.update_from_stats(s)
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 5
    assert value(m, "vllm:kv_cache_usage_perc") == 0.25
    assert value(m, "vllm:gpu_cache_usage_perc") == 0.25
    assert value(m, "fuel:num_requests_preempted_waiting") == 1
    assert value(m, "fuel:kv_cache_free_blocks") == 75
    assert value(m, "vllm:prompt_tokens_total") == 40
    assert value(m, "vllm:generation_tokens_total") == 3
    assert value(m, "vllm:prefix_cache_queries_total") == 64
    assert value(m, "vllm:prefix_cache_hits_total") == 16
    assert value(m, "vllm:gpu_prefix_cache_hits_total") == 16
    assert value(m, "vllm:num_preemptions_total") == 2
    assert value(m, "fuel:admission_rejections_total", reason="queue_full") == 2
    assert value(m, "fuel:latency_budget_misses_total") == 1
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == 7

    # Same object mutated in place by the engine, then a second update: deltas only.
    s.num_running = 1
    s.kv_cache_usage = 0.5
    s.num_steps = 3
    s.prompt_tokens = 40
    s.generation_tokens = 9  # +6 over 2 steps
    s.num_preemptions = 5
    s.rejections["queue_full"] = 3
    s.rejections["too_long"] = 4
    m.update_from_stats(s)
    assert value(m, "vllm:num_requests_running") == 1
    assert value(m, "vllm:kv_cache_usage_perc") == 0.5
    assert value(m, "vllm:generation_tokens_total") == 9
    assert value(m, "vllm:prompt_tokens_total") == 40
    assert value(m, "vllm:num_preemptions_total") == 5
    assert value(m, "fuel:admission_rejections_total", reason="queue_full") == 3
    assert value(m, "fuel:admission_rejections_total", reason="too_long") == 4
    assert value(m, "fuel:engine_steps_total") == 3
    # Iteration tokens: step 1 = 43 tokens; steps 2-3 = 6 tokens, observed as 3 + 3.
    assert value(m, "vllm:iteration_tokens_total_count") == 3
    assert value(m, "vllm:iteration_tokens_total_sum") == 49
    assert bucket(m, "vllm:iteration_tokens_total", 1) == 0
    assert bucket(m, "vllm:iteration_tokens_total", 8) == 2
    assert bucket(m, "vllm:iteration_tokens_total", 64) == 3

    # An unchanged snapshot adds nothing.
    m.update_from_stats(s)
    assert value(m, "vllm:generation_tokens_total") == 9
    assert value(m, "vllm:iteration_tokens_total_count") == 3


def test_engine_restart_counts_from_zero() -> None:
    m = Metrics(MODEL)
    m.update_from_stats(EngineStats(generation_tokens=100))
    m.update_from_stats(EngineStats(generation_tokens=7))  # restarted engine
    assert value(m, "vllm:generation_tokens_total") == 107


def test_observe_finished_exact_histograms() -> None:
    m = Metrics(MODEL)
    rm = RequestMetrics(
        arrival_time=100.0,
        first_scheduled_time=100.5,  # queue 0.5
        first_token_time=101.25,  # prefill 0.75, TTFT 1.25
        last_token_time=101.45,  # decode 0.2
        finished_time=101.5,  # e2e 1.5
    )
    token_times = [101.25, 101.2515, 101.2595, 101.45]  # ITL 1.5 ms, 8 ms, 190.5 ms
    m.observe_finished(rm, 12, 4, "length", n=2, max_tokens=4, token_times=token_times)

    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(m, "vllm:time_to_first_token_seconds_count") == 1
    assert value(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(1.25)
    assert bucket(m, "vllm:time_to_first_token_seconds", 1.0) == 0
    assert bucket(m, "vllm:time_to_first_token_seconds", 2.5) == 1
    assert value(m, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    assert bucket(m, "vllm:e2e_request_latency_seconds", 1.0) == 0
    assert bucket(m, "vllm:e2e_request_latency_seconds", 1.5) == 1
    assert value(m, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert bucket(m, "vllm:request_queue_time_seconds", 0.5) == 1
    assert value(m, "vllm:request_prefill_time_seconds_sum") == pytest.approx(0.75)
    assert value(m, "vllm:request_decode_time_seconds_sum") == pytest.approx(0.2)
    assert value(m, "vllm:request_inference_time_seconds_sum") == pytest.approx(0.95)
    # Per-request TPOT: 0.2 s over 3 intervals.
    assert value(m, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(0.2 / 3)
    # ITL: three samples; the sub-10 ms ones land in our fine buckets.
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        assert value(m, f"{name}_count") == 3
        assert value(m, f"{name}_sum") == pytest.approx(0.2)
        assert bucket(m, name, 0.001) == 0
        assert bucket(m, name, 0.002) == 1
        assert bucket(m, name, 0.0075) == 1
        assert bucket(m, name, 0.01) == 2
        assert bucket(m, name, 0.15) == 2
        assert bucket(m, name, 0.2) == 3
    assert value(m, "vllm:request_prompt_tokens_sum") == 12
    assert bucket(m, "vllm:request_prompt_tokens", 10) == 0
    assert bucket(m, "vllm:request_prompt_tokens", 20) == 1
    assert value(m, "vllm:request_generation_tokens_sum") == 4
    assert value(m, "vllm:request_params_n_sum") == 2
    assert bucket(m, "vllm:request_params_n", 1) == 0
    assert value(m, "vllm:request_params_max_tokens_sum") == 4


def test_observe_finished_partial_timestamps() -> None:
    """Aborted while waiting: counted, e2e observed, but no TTFT/queue/decode samples."""
    m = Metrics(MODEL)
    rm = RequestMetrics(arrival_time=10.0, finished_time=12.0)
    m.observe_finished(rm, 5, 0, "abort", n=1, max_tokens=None, token_times=None)
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert value(m, "vllm:time_to_first_token_seconds_count") == 0
    assert value(m, "vllm:request_queue_time_seconds_count") == 0
    assert value(m, "vllm:inter_token_latency_seconds_count") == 0
    assert value(m, "vllm:request_params_max_tokens_count") == 0
    assert value(m, "vllm:request_time_per_output_token_seconds_count") == 0


def test_observe_finished_rejects_unknown_reason() -> None:
    m = Metrics(MODEL)
    with pytest.raises(ValueError):
        m.observe_finished(RequestMetrics(), 1, 1, "bogus", 1, None, None)


def test_observe_rejection_and_render() -> None:
    m = Metrics(MODEL)
    m.observe_rejection("queue_full")
    m.observe_rejection("queue_full")
    m.observe_rejection("kv_exhausted")
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    rej = families["fuel:admission_rejections"]
    got = {s.labels["reason"]: s.value for s in rej.samples if s.name.endswith("_total")}
    assert got == {"queue_full": 2.0, "kv_exhausted": 1.0}
    # Every series carries vLLM v1's labels.
    for fam in families.values():
        for sample in fam.samples:
            assert sample.labels["model_name"] == MODEL
            assert sample.labels["engine"] == "0"
    # Nothing of ours pretends to be vLLM's: fuel extras only under fuel:.
    assert "vllm:request_rejected" not in families
    assert all(n.startswith(("vllm:", "fuel:")) for n in families)


def test_registries_are_independent() -> None:
    a, b = Metrics("a"), Metrics("b")
    a.update_from_stats(EngineStats(prompt_tokens=5))
    assert (
        a.registry.get_sample_value("vllm:prompt_tokens_total", {"model_name": "a", "engine": "0"})
        == 5
    )
    assert (
        b.registry.get_sample_value("vllm:prompt_tokens_total", {"model_name": "b", "engine": "0"})
        == 0
    )


def test_rejections_seen_by_engine_and_server_are_not_double_counted() -> None:
    """The server observes RequestRejectedError the engine also counted in EngineStats."""
    m = Metrics(MODEL)
    m.observe_rejection("queue_full")
    m.observe_rejection("queue_full")
    m.update_from_stats(EngineStats(rejections={"queue_full": 2}))
    assert value(m, "fuel:admission_rejections_total", reason="queue_full") == 2
    # Engine ahead of the server (server had not caught the third one yet).
    m.update_from_stats(EngineStats(rejections={"queue_full": 3}))
    assert value(m, "fuel:admission_rejections_total", reason="queue_full") == 3
    m.observe_rejection("queue_full")
    assert value(m, "fuel:admission_rejections_total", reason="queue_full") == 3
    # A reason only the server knows (e.g. rejected before submission) counts alone.
    m.observe_rejection("server_busy")
    assert value(m, "fuel:admission_rejections_total", reason="server_busy") == 1
