"""Command line: ``python -m loadtest run ...`` and ``python -m loadtest compare ...``."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from loadtest.bench import Bench, RunOutcome, make_client, resolve_model
from loadtest.cliargs import add_workload_args, bench_options, common_record, parse_int_list
from loadtest.compare import add_compare_args, run_compare
from loadtest.guard import NonLoopbackURLError
from loadtest.metrics import format_table
from loadtest.report import PlotRun, plot_runs, server_info, write_json
from loadtest.workloads import WORKLOADS

DEFAULT_RESULT_DIR = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fuel-loadtest", description="Load-test an OpenAI-compatible server on loopback."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="benchmark one server")
    run.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="loopback only (127.0.0.0/8, ::1, localhost)",
    )
    run.add_argument("--workload", choices=WORKLOADS, default="questions")
    run.add_argument(
        "--concurrency",
        type=parse_int_list,
        default=None,
        help="closed-loop clients; '1,16,32' sweeps (default 1; "
        "with --request-rate: a cap on requests in flight)",
    )
    run.add_argument(
        "--request-rate", type=float, default=None, help="open loop: mean arrivals per second"
    )
    run.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrivals (1 = Poisson)"
    )
    run.add_argument("--result-dir", type=Path, default=DEFAULT_RESULT_DIR)
    run.add_argument("--plot", action="store_true", help="also write a PNG next to the JSON")
    add_workload_args(run)
    add_compare_args(sub.add_parser("compare", help="Fuel Serve vs llama.cpp, side by side"))
    return parser


async def _run(a: argparse.Namespace, argv: Sequence[str]) -> int:
    if a.concurrency is None and a.request_rate is None:
        a.concurrency = [1]
    opts = bench_options(a, a.base_url, a.workload)
    bench = Bench(opts)
    common = common_record(a, argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    max_conn = max(opts.levels(), key=lambda c: c or 0) or 1024
    outcomes: list[RunOutcome] = []
    async with make_client(opts, max_conn) as client:
        info = await server_info(client, opts.base_url)
        model = opts.model or await resolve_model(client, opts.base_url, opts.api_key)
        for c in opts.levels():
            out = await bench.run_level(client, model, c)
            outcomes.append(out)
            load = "rate=" + str(opts.request_rate) if opts.request_rate else ""
            title = f"{opts.workload} c={c} {load}".strip()
            print(format_table(out.metrics, title=title))
            if out.load.hit_deadline:
                print(
                    f"note: hit --max-duration; {out.load.cancelled} in-flight requests cancelled"
                )
            out.record.update(common)
            out.record["server"] = info
            path = a.result_dir / f"{stamp}-{opts.workload}-c{c if c else 'inf'}.json"
            print(f"wrote {write_json(path, out.record)}")
    if len(outcomes) > 1:
        print(
            f"{'conc':>6} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'failed':>6}"
        )
        for o in outcomes:
            m = o.metrics
            print(
                f"{o.concurrency!s:>6} {m.request_throughput:8.2f} {m.output_throughput:10.1f} "
                f"{m.ttft.median_ms:9.1f} {m.ttft.percentiles_ms.get('p99', math.nan):9.1f} "
                f"{m.tpot.median_ms:9.1f} {m.failed:6d}"
            )
    if a.plot:
        runs = [
            PlotRun(f"c={o.concurrency}", o.concurrency, o.metrics, o.load.results)
            for o in outcomes
        ]
        print(f"wrote {plot_runs(runs, a.result_dir / f'{stamp}-{opts.workload}.png')}")
    return 0 if any(o.metrics.completed for o in outcomes) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fuel-loadtest`` / ``python -m loadtest``; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    a = parser.parse_args(args_list)
    try:
        if a.command == "run":
            return asyncio.run(_run(a, args_list))
        return run_compare(a, args_list)
    except (NonLoopbackURLError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
