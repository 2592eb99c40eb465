"""Pure parts of the load tester: metrics on synthetic timings, the loopback guard,
the gamma arrivals and the workload sessions (no server, no model)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from loadtest.guard import NonLoopbackURLError, check_loopback_url, is_loopback_host
from loadtest.metrics import (
    RequestResult,
    compute_metrics,
    format_table,
    parse_goodput,
    percentile,
)
from loadtest.runner import LoadSpec, gamma_intervals
from loadtest.workloads import (
    WorkloadOptions,
    build_sessions,
    load_questions,
    load_system_prompt,
)


def ok(
    ttft: float, latency: float, out: int, prompt: int = 10, itl: list[float] | None = None
) -> RequestResult:
    return RequestResult(
        success=True,
        prompt_tokens=prompt,
        output_tokens=out,
        ttft_s=ttft,
        latency_s=latency,
        itl_s=itl or [],
    )


def test_percentile_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=37).tolist()
    for p in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), rel=1e-12)
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_known_answers() -> None:
    # Request A: ttft 0.1 s, e2e 1.1 s, 11 tokens -> tpot (1.1-0.1)/10 = 0.1 s.
    # Request B: ttft 0.3 s, e2e 0.7 s, 5 tokens  -> tpot 0.4/4 = 0.1 s.
    # Request C: one token -> no TPOT sample.
    a = ok(0.1, 1.1, 11, prompt=20, itl=[0.1] * 10)
    b = ok(0.3, 0.7, 5, prompt=30, itl=[0.05, 0.15, 0.1, 0.1])
    c = ok(0.2, 0.2, 1, prompt=50)
    failed = RequestResult(success=False, status_code=503, error="HTTP 503")
    stream_err = RequestResult(success=False, status_code=200, error="stream error: boom")
    m = compute_metrics([a, b, c, failed, stream_err], duration_s=2.0)
    assert m.completed == 3 and m.failed == 2 and m.num_requests == 5
    assert m.failures_by_status == {"503": 1, "error": 1}
    assert m.total_input_tokens == 100
    assert m.total_output_tokens == 17
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(8.5)
    assert m.total_token_throughput == pytest.approx(58.5)
    assert m.ttft.count == 3
    assert m.ttft.mean_ms == pytest.approx(200.0)
    assert m.ttft.median_ms == pytest.approx(200.0)
    assert m.ttft.std_ms == pytest.approx(statistics.pstdev([100, 300, 200]))
    assert m.tpot.count == 2 and m.tpot.mean_ms == pytest.approx(100.0)
    assert m.itl.count == 14
    assert m.itl.mean_ms == pytest.approx(1000 * (1.0 + 0.4) / 14)
    assert m.itl.percentiles_ms["p50"] == pytest.approx(100.0)
    assert m.e2el.max_ms == pytest.approx(1100.0) and m.e2el.min_ms == pytest.approx(200.0)
    # p90 of E2E [200, 700, 1100]: rank 1.8 -> 700 + 0.8*400 = 1020.
    assert m.e2el.percentiles_ms["p90"] == pytest.approx(1020.0)
    assert m.goodput is None
    assert "Failed requests:" in format_table(m)


def test_goodput_counts_requests_meeting_all_slos() -> None:
    fast = ok(0.1, 0.5, 5)  # tpot 0.1
    slow_first = ok(0.6, 1.0, 5)  # ttft 600 ms
    slow_tokens = ok(0.1, 2.1, 5)  # tpot 500 ms
    one_token = ok(0.2, 0.2, 1)  # tpot counts as 0 for goodput
    failed = RequestResult(success=False, status_code=500)
    rs = [fast, slow_first, slow_tokens, one_token, failed]
    m = compute_metrics(rs, 4.0, parse_goodput(["ttft:500", "tpot:150"]))
    assert m.goodput == pytest.approx(2 / 4.0)
    assert m.slos_ms == {"ttft": 500.0, "tpot": 150.0}
    m = compute_metrics(rs, 4.0, parse_goodput(["e2el:1000"]))
    assert m.goodput == pytest.approx(3 / 4.0)


def test_parse_goodput_rejects_bad_input() -> None:
    assert parse_goodput(["TTFT:250", "e2el:1e3"]) == {"ttft": 0.25, "e2el": 1.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:x"], ["ttft:0"], ["ttft:-1"], ["ttft:1", "ttft:2"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_empty_and_all_failed_runs() -> None:
    m = compute_metrics([RequestResult(success=False, error="ConnectError")], 1.0)
    assert m.completed == 0 and m.failed == 1 and m.failures_by_status == {"error": 1}
    assert math.isnan(m.ttft.mean_ms) and m.ttft.count == 0
    with pytest.raises(ValueError):
        compute_metrics([], 0.0)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8000",
        "http://127.5.6.7:1/",
        "http://localhost:8000/",
        "https://LOCALHOST",
        "http://[::1]:8000",
        "http://[::ffff:127.0.0.1]:80",
    ],
)
def test_loopback_guard_accepts(url: str) -> None:
    assert check_loopback_url(url) == url.rstrip("/")


@pytest.mark.parametrize(
    "url",
    [
        "http://10.0.0.1:8000",
        "http://0.0.0.0:8000",
        "http://example.com",
        "http://localhost.evil.com",
        "http://127.0.0.1.nip.io",
        "http://[::2]:80",
        "ftp://127.0.0.1",
        "127.0.0.1:8000",
        "http://192.168.1.1",
    ],
)
def test_loopback_guard_refuses(url: str) -> None:
    with pytest.raises(NonLoopbackURLError):
        check_loopback_url(url)
    assert not is_loopback_host("8.8.8.8")


def test_gamma_intervals_mean_and_burstiness() -> None:
    poisson = gamma_intervals(20000, rate=4.0, burstiness=1.0, seed=1)
    bursty = gamma_intervals(20000, rate=4.0, burstiness=0.25, seed=1)
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.05)
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.1)
    # Coefficient of variation is 1/sqrt(shape): 1 for Poisson, 2 for shape 0.25.
    assert statistics.pstdev(poisson) / statistics.fmean(poisson) == pytest.approx(1.0, rel=0.05)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.1)
    assert gamma_intervals(5, 1.0, 1.0, seed=3) == gamma_intervals(5, 1.0, 1.0, seed=3)


def test_load_spec_is_always_bounded() -> None:
    with pytest.raises(ValueError):
        LoadSpec(num_requests=0, max_duration_s=10).validate()
    with pytest.raises(ValueError):
        LoadSpec(num_requests=1, max_duration_s=math.inf).validate()
    with pytest.raises(ValueError):
        LoadSpec(num_requests=1, max_duration_s=1, concurrency=None).validate()
    LoadSpec(num_requests=1, max_duration_s=1, concurrency=None, request_rate=2.0).validate()


def test_bundled_data() -> None:
    qs = load_questions()
    assert len(qs) >= 64 and len(set(qs)) == len(qs)
    assert all(q.endswith(("?", ".")) for q in qs)
    words = load_system_prompt().split()
    assert 600 <= len(words) <= 1000  # ~1,000 tokens for SmolLM2's tokenizer


def test_question_and_shared_prefix_sessions() -> None:
    opts = WorkloadOptions(max_tokens=32, seed=7)
    a = build_sessions("questions", 100, opts)
    assert len(a) == 100 and all(len(s.turns) == 1 for s in a)
    assert [s.turns for s in a] == [s.turns for s in build_sessions("questions", 100, opts)]
    # The first pass over the questions has no repeats.
    n = len(load_questions())
    assert len({s.turns[0] for s in a[:n]}) == n
    spec = build_sessions("shared-prefix", 3, opts)[0].request(0, "chat")
    assert spec.messages is not None and spec.messages[0]["role"] == "system"
    assert spec.messages[0]["content"] == load_system_prompt() and spec.max_tokens == 32
    comp = build_sessions("shared-prefix", 3, opts)[0].request(0, "completions")
    assert comp.prompt is not None and comp.prompt.startswith(load_system_prompt()[:50])


def test_multi_turn_resends_received_answers() -> None:
    opts = WorkloadOptions(num_turns=3)
    sessions = build_sessions("multi-turn", 7, opts)
    assert len(sessions) == 3 and all(len(s.turns) == 3 for s in sessions)
    s = sessions[0]
    first = s.request(0, "chat")
    assert first.messages == [{"role": "user", "content": s.turns[0]}]
    with pytest.raises(RuntimeError):
        s.request(1, "chat")  # the first answer has not arrived
    s.record_answer(0, "ANSWER-ONE")
    second = s.request(1, "chat")
    assert second.messages == [
        {"role": "user", "content": s.turns[0]},
        {"role": "assistant", "content": "ANSWER-ONE"},
        {"role": "user", "content": s.turns[1]},
    ]


def test_tokenizer_workloads_need_a_tokenizer() -> None:
    with pytest.raises(ValueError):
        build_sessions("random", 2, WorkloadOptions())
    with pytest.raises(ValueError):
        build_sessions("nope", 2, WorkloadOptions())


class CharTokenizer:
    """A stand-in tokenizer: token id i is the character chr(65 + i % 26), id 0 special."""

    vocab_size = 30
    all_special_ids = [0]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1 + (ord(c) % 29) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(65 + i % 26) for i in ids if not (skip_special_tokens and i == 0))


def test_random_workload_lengths_and_ignore_eos() -> None:
    opts = WorkloadOptions(input_len=100, output_len=20, range_ratio=0.5, seed=3)
    sessions = build_sessions("random", 50, opts, CharTokenizer())
    in_lens = [len(s.turns[0]) for s in sessions]
    outs = [s.max_tokens[0] for s in sessions]
    assert min(in_lens) >= 50 and max(in_lens) <= 150 and len(set(in_lens)) > 10
    assert all(o is not None and 10 <= o <= 30 for o in outs)
    assert all(s.ignore_eos for s in sessions)
    assert build_sessions("random", 50, opts, CharTokenizer())[0].turns == sessions[0].turns


def test_long_prompt_workload_lengths() -> None:
    opts = WorkloadOptions(input_len=3000, seed=1)
    sessions = build_sessions("long-prompt", 3, opts, CharTokenizer())
    texts = [s.turns[0] for s in sessions]
    assert all(len(t) > 3000 for t in texts) and len(set(texts)) == 3


def test_compare_report_spread_targets_and_prefill() -> None:
    """The compare report: pooled figures with the per-repeat range, ratios to
    the best peer (or the named one), cold prefill tok/s, memory rows."""
    from loadtest.compare_report import (
        PREFILL,
        RepeatResult,
        SideResult,
        figures,
        prefill_tok_s,
        render_markdown,
    )

    def req(ttft: float, n_out: int, tpot: float, prompt: int = 10) -> RequestResult:
        gaps = [tpot] * (n_out - 1)
        return RequestResult(True, prompt, n_out, ttft, gaps, ttft + tpot * (n_out - 1))

    def side(tpots: list[float], rss: int) -> SideResult:
        return SideResult([RepeatResult([req(0.1, 11, t)], 1.0, 0, rss) for t in tpots])

    cells = {
        ("questions", 1): {
            "ours": side([0.008, 0.010], 300 << 20),
            "peer:Q4_1": side([0.0075, 0.0075], 200 << 20),
            "peer:F16": side([0.012, 0.012], 400 << 20),
        },
        (PREFILL, 1): {
            s: SideResult([RepeatResult([req(t, 1, 0.0, prompt=1600)], t, 0)])
            for s, t in (("ours", 1.0), ("peer:Q4_1", 4.0), ("peer:F16", 2.0))
        },
    }
    assert prefill_tok_s(cells[(PREFILL, 1)]["ours"].results) == 1600.0
    figs = {(f.workload, f.label): f for f in figures(cells, {})}
    tpot = figs[("questions", "TPOT p50 (ms)")]
    assert tpot.spread["ours"] == pytest.approx((8.0, 10.0))
    assert tpot.pooled["ours"] == pytest.approx(9.0)
    assert figs[("questions", "RSS peak (MiB)")].pooled == {
        "ours": 300.0,
        "peer:Q4_1": 200.0,
        "peer:F16": 400.0,
    }
    header = {
        "date": "d",
        "command": "c",
        "git": {"commit": "abc"},
        "machine": {"cpu_model": "x", "usable_cores": 2, "memory_gib": 1, "os": "linux"},
        "model_path": "m",
        "servers": {"ours": "o", "peer:Q4_1": "p", "peer:F16": "f"},
        "repeats": 2,
        "num_requests": 1,
        "max_tokens": 11,
        "temperature": 0,
    }
    md = render_markdown(cells, {}, header, {"ours": 250 << 20, "peer:Q4_1": 100 << 20})
    # TPOT 9.0 vs the Q4_1 peer's 7.5: 1.20x, not met; prefill 1600 vs the best
    # peer's 800 tok/s: 2.00x, met; idle RSS 250 vs 100 MiB: 2.50x, not met.
    assert (
        "| one stream: TPOT p50 <= 1.0x the Q4_1 peer | 9.00 | peer:Q4_1 7.50 | 1.20x | no |" in md
    )
    assert (
        "| cold prefill tok/s >= 1.5x the best peer | 1600.0 | peer:F16 800.0 | 2.00x | yes |" in md
    )
    assert "| RSS idle <= 1.5x the Q4_1 peer's | 250.0 | peer:Q4_1 100.0 | 2.50x | no |" in md
    assert "| questions | 1 | TPOT p50 (ms) | 9.00 (8.00–10.0) | 7.50 | 12.0 | 1.20x |" in md
