"""The ``loadtest compare`` report: per-cell tables with spread, memory, and the targets.

Pure: takes what the runs measured (per side, per repeat) and returns
markdown. Sides are ``ours`` and one or more peers (``peer`` or
``peer:LABEL``, LABEL being the peer's model variant, e.g. ``Q4_1``).
Each value is the side's repeats pooled (latencies over all requests,
throughput as total work over total time) followed by the range of the
per-repeat values; ratios are ours / the best peer for that figure (the
highest throughput, the lowest latency or memory), unless a target names a
peer.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest.metrics import BenchmarkMetrics, RequestResult, compute_metrics

PREFILL = "prefill"  # the cold long-prompt cell: one output token, tok/s of prompt processing


@dataclass
class RepeatResult:
    """One side's run of one cell, once."""

    results: list[RequestResult]
    duration_s: float
    cancelled: int
    rss_peak: int | None = None  # bytes, the server's largest RSS while this run lasted


@dataclass
class SideResult:
    """One side of one cell: every repeat."""

    repeats: list[RepeatResult] = field(default_factory=list)

    @property
    def results(self) -> list[RequestResult]:
        return [r for rep in self.repeats for r in rep.results]

    @property
    def cancelled(self) -> int:
        return sum(rep.cancelled for rep in self.repeats)

    def metrics(self, slos: dict[str, float]) -> BenchmarkMetrics:
        return compute_metrics(self.results, sum(r.duration_s for r in self.repeats), slos)

    def per_repeat(self, slos: dict[str, float]) -> list[BenchmarkMetrics]:
        return [compute_metrics(r.results, r.duration_s, slos) for r in self.repeats]


def prefill_tok_s(results: list[RequestResult]) -> float | None:
    """Median prompt tokens per second of time to first token (cold prompts)."""
    rates = [r.prompt_tokens / r.ttft_s for r in results if r.success and r.ttft_s > 0]
    return statistics.median(rates) if rates else None


Getter = Callable[[BenchmarkMetrics, list[RequestResult]], float | None]

# (label, getter, higher is better)
ROWS: list[tuple[str, Getter, bool]] = [
    ("output tok/s", lambda m, _: m.output_throughput, True),
    ("requests/s", lambda m, _: m.request_throughput, True),
    ("TTFT p50 (ms)", lambda m, _: m.ttft.median_ms, False),
    ("TTFT p99 (ms)", lambda m, _: m.ttft.percentiles_ms.get("p99"), False),
    ("TPOT p50 (ms)", lambda m, _: m.tpot.median_ms, False),
    ("ITL p99 (ms)", lambda m, _: m.itl.percentiles_ms.get("p99"), False),
    ("E2E p50 (ms)", lambda m, _: m.e2el.median_ms, False),
]
PREFILL_ROWS: list[tuple[str, Getter, bool]] = [
    ("prefill tok/s", lambda _, rs: prefill_tok_s(rs), True),
    ("TTFT p50 (ms)", lambda m, _: m.ttft.median_ms, False),
]
RSS_ROW = ("RSS peak (MiB)", False)


def _fmt(x: float | None) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def _mib(x: int | None) -> float | None:
    return None if x is None else x / 2**20


def _best(values: dict[str, float | None], higher: bool) -> tuple[str, float] | None:
    known = {k: v for k, v in values.items() if v is not None and v == v}
    if not known:
        return None
    side = (max if higher else min)(known, key=lambda k: known[k])
    return side, known[side]


@dataclass
class Figure:
    """One row of the report: each side's pooled value and per-repeat range."""

    workload: str
    conc: int
    label: str
    higher: bool
    pooled: dict[str, float | None]
    spread: dict[str, tuple[float, float] | None]


def figures(
    cells: dict[tuple[str, int], dict[str, SideResult]], slos: dict[str, float]
) -> list[Figure]:
    out: list[Figure] = []
    for (workload, conc), sides in cells.items():
        rows = PREFILL_ROWS if workload == PREFILL else ROWS
        pooled_m = {s: r.metrics(slos) for s, r in sides.items()}
        reps_m = {s: r.per_repeat(slos) for s, r in sides.items()}
        for label, get, higher in rows:
            pooled = {s: get(pooled_m[s], sides[s].results) for s in sides}
            spread: dict[str, tuple[float, float] | None] = {}
            for s, side in sides.items():
                vals = [
                    v
                    for m, rep in zip(reps_m[s], side.repeats)
                    if (v := get(m, rep.results)) is not None and v == v
                ]
                spread[s] = (min(vals), max(vals)) if vals else None
            out.append(Figure(workload, conc, label, higher, pooled, spread))
        peaks = {s: [_mib(r.rss_peak) for r in side.repeats] for s, side in sides.items()}
        if any(v is not None for vs in peaks.values() for v in vs):
            pooled_rss = {
                s: max((v for v in vs if v is not None), default=None) for s, vs in peaks.items()
            }
            spread_rss: dict[str, tuple[float, float] | None] = {}
            for s, vs in peaks.items():
                known = [v for v in vs if v is not None]
                spread_rss[s] = (min(known), max(known)) if known else None
            out.append(Figure(workload, conc, RSS_ROW[0], RSS_ROW[1], pooled_rss, spread_rss))
    return out


# Issue 23's targets: (what, workload, conc, row, peer: "best" or a label, bound, higher better)
TARGETS: list[tuple[str, str, int, str, str, float, bool]] = [
    ("one stream: TPOT p50 <= 1.0x the Q4_1 peer", "questions", 1, "TPOT p50 (ms)", "Q4_1", 1.0, False),
    ("one stream: ITL p99 <= 1.2x the Q4_1 peer", "questions", 1, "ITL p99 (ms)", "Q4_1", 1.2, False),
    ("16 streams: output tok/s >= 1.5x the best peer", "questions", 16, "output tok/s", "best", 1.5, True),
    ("16 streams: TTFT p50 <= 1.0x the best peer", "questions", 16, "TTFT p50 (ms)", "best", 1.0, False),
    ("32 streams: output tok/s >= 1.5x the best peer", "questions", 32, "output tok/s", "best", 1.5, True),
    ("32 streams: TTFT p50 <= 1.0x the best peer", "questions", 32, "TTFT p50 (ms)", "best", 1.0, False),
    ("shared prompt, one stream: output tok/s >= 1.5x", "shared-prefix", 1, "output tok/s", "best", 1.5, True),
    ("shared prompt, 16 streams: output tok/s >= 2x", "shared-prefix", 16, "output tok/s", "best", 2.0, True),
    ("cold prefill tok/s >= 1.5x the best peer", PREFILL, 1, "prefill tok/s", "best", 1.5, True),
    ("RSS idle <= 1.5x the Q4_1 peer's", "idle", 0, "RSS idle (MiB)", "Q4_1", 1.5, False),
    ("RSS under 16 streams <= 1.5x the Q4_1 peer's", "questions", 16, RSS_ROW[0], "Q4_1", 1.5, False),
]  # fmt: skip


def _peer_value(fig: Figure, peer: str) -> tuple[str, float] | None:
    peers = {s: v for s, v in fig.pooled.items() if s != "ours"}
    if peer == "best":
        return _best(peers, fig.higher)
    for s, v in peers.items():
        if (s == "peer" or s.endswith(f":{peer}")) and v is not None:
            return s, v
    return None


def render_targets(figs: list[Figure]) -> list[str]:
    by_key = {(f.workload, f.conc, f.label): f for f in figs}
    lines = ["| target | ours | peer | ratio | met? |", "|---|---:|---|---:|---|"]
    for what, workload, conc, row, peer, bound, higher in TARGETS:
        fig = by_key.get((workload, conc, row))
        if fig is None:
            continue
        ours = fig.pooled.get("ours")
        ref = _peer_value(fig, peer)
        if ours is None or ref is None or not ref[1]:
            lines.append(f"| {what} | {_fmt(ours)} | n/a | n/a | n/a |")
            continue
        ratio = ours / ref[1]
        met = ratio >= bound if higher else ratio <= bound
        lines.append(
            f"| {what} | {_fmt(ours)} | {ref[0]} {_fmt(ref[1])} | {ratio:.2f}x | "
            f"{'yes' if met else 'no'} |"
        )
    return lines


def render_markdown(
    cells: dict[tuple[str, int], dict[str, SideResult]],
    slos: dict[str, float],
    header: dict[str, Any],
    idle_rss: dict[str, int | None] | None = None,
) -> str:
    """The comparison report: context, the targets, then one row per (cell, figure)."""
    sides = list(next(iter(cells.values())))
    figs = figures(cells, slos)
    if idle_rss and any(v is not None for v in idle_rss.values()):
        idle = {s: _mib(idle_rss.get(s)) for s in sides}
        figs.append(Figure("idle", 0, "RSS idle (MiB)", False, idle, dict.fromkeys(sides)))
    lines = [
        "# CPU benchmark: Fuel Serve vs llama.cpp",
        "",
        f"- Date: {header['date']}",
        f"- Command: `{header['command']}`",
        f"- Git commit: `{header['git'].get('commit')}`"
        + (" (uncommitted changes)" if header["git"].get("dirty") else ""),
        f"- Machine: {header['machine']['cpu_model']}, {header['machine']['usable_cores']} usable "
        f"cores, {header['machine']['memory_gib']} GiB RAM, {header['machine']['os']}",
        f"- Load average before / after: {header.get('load_before', 'n/a')} / "
        f"{header.get('load_after', 'n/a')}",
        f"- Model (ours): `{header['model_path']}`",
        *[f"- {side}: `{cmd}`" for side, cmd in header["servers"].items()],
        f"- Per cell: {header['repeats']} x (each side in turn), "
        f"{header['num_requests']} requests each (prefill: {header.get('prefill_requests')} "
        f"cold prompts of ~{header.get('prefill_len')} tokens, one output token), max_tokens "
        f"{header['max_tokens']}, temperature {header['temperature']}.",
        "",
        "Values: the repeats pooled (latencies over all requests, throughput as total work "
        "over total time), then the range of the per-repeat values. Ratio: ours / the best "
        "peer for that figure (highest throughput, lowest latency or memory).",
        "",
        "## Targets",
        "",
        *render_targets(figs),
        "",
        "## All figures",
        "",
        "| workload | conc | figure | " + " | ".join(sides) + " | ours/best peer |",
        "|---|---:|---|" + "---:|" * len(sides) + "---:|",
    ]
    for f in figs:
        vals = []
        for s in sides:
            sp = f.spread.get(s)
            rng = f" ({_fmt(sp[0])}–{_fmt(sp[1])})" if sp is not None and sp[0] != sp[1] else ""
            vals.append(_fmt(f.pooled.get(s)) + rng)
        ref = _peer_value(f, "best")
        ours = f.pooled.get("ours")
        ratio = (
            f"{ours / ref[1]:.2f}x" if ours is not None and ref is not None and ref[1] else "n/a"
        )
        lines.append(
            f"| {f.workload} | {f.conc} | {f.label} | " + " | ".join(vals) + f" | {ratio} |"
        )
    for (workload, conc), ss in cells.items():
        failed = [f"{s} {r.metrics(slos).failed}/{r.cancelled}" for s, r in ss.items()]
        lines.append(f"| {workload} | {conc} | failed/cancelled | " + " | ".join(failed) + " | |")
    errors = [
        f"- {side}, {workload} c={conc}: {err} (x{n})"
        for (workload, conc), ss in cells.items()
        for side, res in ss.items()
        for err, n in sorted(Counter(r.error for r in res.results if not r.success).items())
    ]
    if errors:
        lines += ["", "Failures:", "", *errors]
    lines.append("")
    return "\n".join(lines)
