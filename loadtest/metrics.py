"""Benchmark metrics, defined as vLLM's ``benchmark_serving`` defines them.

This module is pure: it takes per-request timings and a wall-clock duration and
returns numbers. No I/O, no clocks, no randomness, so it is unit-tested on
synthetic timings with known answers.

Definitions (per successful request unless stated):

- TTFT: time from sending the request to the first content chunk.
- ITL: the gaps between successive content chunks (all requests' gaps pooled).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``; only requests with more than one
  output token contribute to the TPOT statistics. For goodput a request with at
  most one output token has TPOT 0 (as vLLM does).
- E2EL: time from sending the request to the end of its stream.
- Request throughput: successful requests / duration.
- Output token throughput: sum of server-reported completion tokens / duration.
- Total token throughput: (prompt tokens + completion tokens) / duration.
- Goodput: successful requests meeting every given SLO, per second.

All times are seconds in inputs; summaries report milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one request produced, as measured by the client.

    ``success`` is True only for a complete stream with server-reported usage.
    ``output_tokens`` and ``prompt_tokens`` come from the server's ``usage``.
    ``itl_s`` holds the gaps between successive content chunks, so it has one
    entry fewer than the number of content chunks.
    """

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    start_s: float = 0.0  # send time relative to the benchmark start
    status_code: int | None = None
    error: str = ""
    generated_text: str = ""
    finish_reason: str | None = None
    usage_from_server: bool = True  # False: output_tokens counted as content chunks

    @property
    def tpot_s(self) -> float | None:
        """``(e2e - ttft) / (output_tokens - 1)``, or None for <= 1 output token."""
        if self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self, include_text: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        if not include_text:
            d.pop("generated_text")
        return d


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolation percentile, identical to ``numpy.percentile``'s default.

    ``p`` is in [0, 100]. Returns NaN for an empty sequence.
    """
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not values:
        return math.nan
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = math.ceil(rank)
    if lo == hi:
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass
class Summary:
    """Statistics of one latency metric, in milliseconds (NaN when no samples)."""

    count: int
    mean_ms: float
    median_ms: float
    std_ms: float
    min_ms: float
    max_ms: float
    percentiles_ms: dict[str, float]  # key "p50", "p90", ...

    @classmethod
    def of(cls, values_s: Sequence[float], percentiles: Sequence[float]) -> Summary:
        """Summarise samples given in seconds."""
        ms = [v * 1000.0 for v in values_s]
        n = len(ms)
        if n == 0:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, {_pkey(p): nan for p in percentiles})
        mean = sum(ms) / n
        # Population standard deviation, as numpy.std (vLLM uses np.std).
        std = math.sqrt(sum((x - mean) ** 2 for x in ms) / n)
        return cls(
            count=n,
            mean_ms=mean,
            median_ms=percentile(ms, 50.0),
            std_ms=std,
            min_ms=min(ms),
            max_ms=max(ms),
            percentiles_ms={_pkey(p): percentile(ms, p) for p in percentiles},
        )


def _pkey(p: float) -> str:
    return f"p{p:g}"


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` into ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Values are milliseconds on the command line. Raises ValueError on an unknown
    metric, a malformed item, a repeated metric or a non-positive value.
    """
    slos: dict[str, float] = {}
    for item in specs:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"bad --goodput item {item!r}: expected NAME:MS with NAME in {SLO_METRICS}"
            )
        if name in slos:
            raise ValueError(f"--goodput names {name!r} twice")
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(f"bad --goodput value in {item!r}: {value!r}") from e
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput SLO must be a positive number of ms, got {item!r}")
        slos[name] = ms / 1000.0
    return slos


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """True when a successful request meets every SLO (seconds); False for failures."""
    if not r.success:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.latency_s}
    return all(values[name] <= limit for name, limit in slos.items())


@dataclass
class BenchmarkMetrics:
    """Everything a run reports; latency summaries are in ms, throughputs per second."""

    duration_s: float
    num_requests: int
    completed: int
    failed: int
    failures_by_status: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    slos_ms: dict[str, float]
    ttft: Summary
    tpot: Summary
    itl: Summary
    e2el: Summary

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchmarkMetrics:
    """Aggregate per-request results over a run lasting ``duration_s`` seconds.

    Failed requests count in ``failed`` (grouped by HTTP status, or ``"error"``
    when the failure happened without one, e.g. a connection error or an error
    event inside a 200 stream) and are excluded from every latency statistic and
    throughput. ``goodput`` is None when no SLOs are given.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    bad = [r for r in results if not r.success]
    failures: Counter[str] = Counter(
        str(r.status_code) if r.status_code not in (None, 200) else "error" for r in bad
    )
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for t in (r.tpot_s for r in ok) if t is not None]
    itls = [gap for r in ok for gap in r.itl_s]
    goodput: float | None = None
    if slos:
        goodput = sum(1 for r in ok if meets_slos(r, slos)) / duration_s
    return BenchmarkMetrics(
        duration_s=duration_s,
        num_requests=len(results),
        completed=len(ok),
        failed=len(bad),
        failures_by_status=dict(sorted(failures.items())),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        goodput=goodput,
        slos_ms={k: v * 1000.0 for k, v in (slos or {}).items()},
        ttft=Summary.of([r.ttft_s for r in ok], percentiles),
        tpot=Summary.of(tpots, percentiles),
        itl=Summary.of(itls, percentiles),
        e2el=Summary.of([r.latency_s for r in ok], percentiles),
    )


def format_table(m: BenchmarkMetrics, title: str = "Serving Benchmark Result") -> str:
    """A plain-text table in the layout of vLLM's benchmark output."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: object) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    if m.failures_by_status:
        row("Failures by status:", ", ".join(f"{k}={v}" for k, v in m.failures_by_status.items()))
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    if m.goodput is not None:
        row("Request goodput (req/s):", m.goodput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total token throughput (tok/s):", m.total_token_throughput)
    for name, label, s in (
        ("ttft", "Time to First Token", m.ttft),
        ("tpot", "Time per Output Token (excl. 1st token)", m.tpot),
        ("itl", "Inter-token Latency", m.itl),
        ("e2el", "End-to-end Latency", m.e2el),
    ):
        lines.append(f"{' ' + label + ' ':-^{width}}")
        row(f"Mean {name.upper()} (ms):", s.mean_ms)
        row(f"Median {name.upper()} (ms):", s.median_ms)
        for key, v in s.percentiles_ms.items():
            row(f"P{key[1:]} {name.upper()} (ms):", v)
    lines.append("=" * width)
    return "\n".join(lines)
