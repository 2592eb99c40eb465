"""Speculative decoding, measured over HTTP: speculation off vs n-gram vs the self-draft.

Starts one Fuel Serve per configuration (all kept up; only the one being
measured is loaded), then runs every cell (workload x concurrency) on each
configuration in turn, rotating the order from cell to cell so that drift on
a shared machine hits every configuration alike. Reports output tok/s, TPOT
p50/p99 and, from each server's ``/metrics``, the acceptance rate overall and
per draft position, with ratios against speculation off from the same run.

Workloads: ``grounded`` (rewrite, fix or continue a given text or code, whose
answer copies much of the prompt: loadtest/data/grounded.txt) and
``questions`` (open-ended short questions: loadtest/data/questions.txt).

    python -m loadtest.spec_bench --cells grounded:1,4 questions:1,4,16 \\
        --out docs/benchmarks/spec-decode.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from loadtest.bench import Bench, BenchOptions, RunOutcome
from loadtest.compare import ServerSpec, free_port, running
from loadtest.prom import by_label, scrape, total
from loadtest.report import git_info, machine_info
from loadtest.workloads import WorkloadOptions

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class BenchConfig:
    """One server of the benchmark: its ``--speculative-config`` (None: off), the
    flags it adds to the common ones, and the configuration its ratio is taken
    against (the same target without speculation)."""

    spec: dict[str, object] | None
    flags: tuple[str, ...] = ()
    baseline: str = "off"


# The self-draft drafts in Q4_1 for float weights: the server refuses it over a
# Q4_1 target (the default), where the draft would be the target itself. Its
# ratio is against speculation off on the same float target ("off-float").
FLOAT_TARGET = ("--cpu-linear", "onednn")
DEFAULT_CONFIGS = {
    "off": BenchConfig(None),
    "ngram": BenchConfig(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    ),
    "off-float": BenchConfig(None, FLOAT_TARGET, "off-float"),
    "self-draft": BenchConfig(
        {"method": "draft_model", "num_speculative_tokens": 4}, FLOAT_TARGET, "off-float"
    ),
}


@dataclass
class SpecCounters:
    """The server's vllm:spec_decode_* totals at one moment."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple[float, ...] = ()

    def minus(self, before: SpecCounters) -> SpecCounters:
        pos = tuple(
            a - (before.per_pos[i] if i < len(before.per_pos) else 0.0)
            for i, a in enumerate(self.per_pos)
        )
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            pos,
        )


def read_counters(url: str) -> SpecCounters:
    m = scrape(url)
    per_pos = by_label(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position")
    return SpecCounters(
        total(m, "vllm:spec_decode_num_drafts_total"),
        total(m, "vllm:spec_decode_num_draft_tokens_total"),
        total(m, "vllm:spec_decode_num_accepted_tokens_total"),
        tuple(per_pos[k] for k in sorted(per_pos, key=int)),
    )


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


@dataclass
class Cell:
    workload: str
    concurrency: int
    config: str
    outcome: RunOutcome
    spec: SpecCounters
    load_before: str
    load_after: str


def parse_cells(specs: list[str]) -> list[tuple[str, int]]:
    """``grounded:1,4`` -> [("grounded", 1), ("grounded", 4)]."""
    out: list[tuple[str, int]] = []
    for spec in specs:
        name, _, levels = spec.partition(":")
        if not levels:
            raise SystemExit(f"--cells {spec!r}: expected WORKLOAD:C1,C2,...")
        out.extend((name, int(c)) for c in levels.split(","))
    return out


async def _run(bench: Bench, concurrency: int) -> RunOutcome:
    async with httpx.AsyncClient(trust_env=False, timeout=900) as client:
        return await bench.run_level(client, MODEL, concurrency)


def measure(
    urls: dict[str, str], cells: list[tuple[str, int]], a: argparse.Namespace
) -> list[Cell]:
    results: list[Cell] = []
    names = list(urls)
    for n, (workload, conc) in enumerate(cells):
        # Rotate the order per cell: no configuration always runs first.
        order = names[n % len(names) :] + names[: n % len(names)]
        for name in order:
            url = urls[name]
            opts = BenchOptions(
                base_url=url,
                model=MODEL,
                workload=workload,
                workload_opts=WorkloadOptions(max_tokens=a.max_tokens, temperature=0.0),
                num_requests=max(a.num_requests, 2 * conc),
                num_warmup=min(conc, 4),
                concurrency=[conc],
                max_duration_s=a.max_duration,
                show_progress=False,
            )
            before, load0 = read_counters(url), load_average()
            outcome = asyncio.run(_run(Bench(opts), conc))
            spec = read_counters(url).minus(before)
            results.append(Cell(workload, conc, name, outcome, spec, load0, load_average()))
            m = outcome.metrics
            print(
                f"{workload} c={conc} {name}: {m.output_throughput:.1f} tok/s, "
                f"TPOT p50 {m.tpot.median_ms:.1f} ms, accepted {spec.accepted:.0f}/"
                f"{spec.draft_tokens:.0f} (load {load0} -> {load_average()})",
                flush=True,
            )
    return results


def _pct(x: float) -> str:
    return f"{x:.0%}"


def report(
    results: list[Cell], configs: dict[str, BenchConfig], argv: list[str], extra: list[str]
) -> str:
    lines: list[str] = []
    by = {(c.workload, c.concurrency, c.config): c for c in results}
    cells = sorted({(c.workload, c.concurrency) for c in results}, key=lambda x: (x[0], x[1]))
    lines += [
        "| workload | streams | config | output tok/s | vs its baseline | TPOT p50 (ms) "
        "| TPOT p99 (ms) | acceptance | accepted per position | tokens / verification "
        "| completed | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, conc in cells:
        for name, cfg in configs.items():
            c = by.get((workload, conc, name))
            if c is None:
                continue
            off = by.get((workload, conc, cfg.baseline)) if cfg.baseline != name else None
            m = c.outcome.metrics
            ratio = (
                f"{m.output_throughput / off.outcome.metrics.output_throughput:.2f}x "
                f"({cfg.baseline})"
                if off is not None and off.outcome.metrics.output_throughput
                else ""
            )
            s = c.spec
            acc = _pct(s.accepted / s.draft_tokens) if s.draft_tokens else "-"
            per_pos = " / ".join(_pct(p / s.drafts) for p in s.per_pos) if s.drafts else "-"
            per_verify = f"{1 + s.accepted / s.drafts:.2f}" if s.drafts else "-"
            lines.append(
                f"| {workload} | {conc} | {name} | {m.output_throughput:.1f} | {ratio} | "
                f"{m.tpot.median_ms:.1f} | {m.tpot.percentiles_ms.get('p99', float('nan')):.1f} | "
                f"{acc} | {per_pos} | {per_verify} | {m.completed}/{m.num_requests} | "
                f"{c.load_before} -> {c.load_after} |"
            )
    head = [
        "# Speculative decoding benchmark (HTTP)",
        "",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit "
        f"{git_info().get('commit', '?')}; machine: {machine_info()}.",
        "",
        f"Command: `python -m loadtest.spec_bench {' '.join(argv)}`",
        "",
        "Server flags common to all configurations: "
        + (f"`{' '.join(extra)}`" if extra else "none (the server defaults)")
        + ". Added per configuration: "
        + "; ".join(
            f"{name}: `{' '.join(cfg.flags) or '-'}`"
            + (f" `--speculative-config '{json.dumps(cfg.spec)}'`" if cfg.spec else "")
            for name, cfg in configs.items()
        )
        + ". Streaming chat, temperature 0. Acceptance: accepted drafts / drafts verified; "
        "per position: verifications whose i-th draft was accepted / verifications with "
        "drafts; load: /proc/loadavg (1, 5, 15 min) before -> after the cell.",
        "",
    ]
    return "\n".join(head + lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cells",
        nargs="+",
        default=["grounded:1,4", "questions:1,4,16"],
        help="WORKLOAD:CONCURRENCY,... (workloads: grounded, questions, ...)",
    )
    ap.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="of " + ",".join(DEFAULT_CONFIGS) + " and those added with --spec",
    )
    ap.add_argument(
        "--spec",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="override or add a configuration's --speculative-config (on the common "
        "flags, against off)",
    )
    ap.add_argument("--server-arg", action="append", default=[], help="passed to every server")
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-duration", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    configs = dict(DEFAULT_CONFIGS)
    for item in a.spec:
        name, _, raw = item.partition("=")
        configs[name] = BenchConfig(json.loads(raw) if raw and raw != "null" else None)
    names = [n for n in a.configs.split(",") if n]
    unknown = [n for n in names if n not in configs]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(configs)}")
    chosen = {n: configs[n] for n in names}
    cells = parse_cells(a.cells)
    logs = Path("loadtest/results")
    with ExitStack() as stack:
        urls: dict[str, str] = {}
        for name in names:
            argv_s = [sys.executable, "-m", "server.cli", "--host", "127.0.0.1"]
            port = free_port()
            cfg = configs[name]
            argv_s += ["--port", str(port), *a.server_arg, *cfg.flags]
            if cfg.spec is not None:
                argv_s += ["--speculative-config", json.dumps(cfg.spec)]
            spec = ServerSpec(f"fuel-serve ({name})", argv_s, port, "/health")
            urls[name] = stack.enter_context(running(spec, logs / f"spec-{name}.log", 600))
        results = measure(urls, cells, a)
    text = report(results, chosen, argv if argv is not None else sys.argv[1:], a.server_arg)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
