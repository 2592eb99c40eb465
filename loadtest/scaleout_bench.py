"""Scale-out, measured: one replica, two replicas round-robin, two cache-aware.

Each configuration is started on loopback (``python -m server.cli``; the two
replica ones with ``--data-parallel-size 2 --router-policy ...``, i.e. two
replicas behind vllm-router; one replica also with ``--num-threads 1``, the
thread count each of two replicas gets), driven with the same multi-conversation workload
(``conversations``: every conversation opens with the bundled system prompt and
each turn resends its history), and stopped; the configurations alternate
``--repeats`` times (A, B, C, D, A, B, C, D) so the machine's drift hits all alike.
Per configuration: output tok/s, TTFT p50/p99 and the prefix-cache hit rate
summed over its replicas' own ``/metrics`` (tokens found / tokens looked up).

Talks HTTP only (and starts processes); it imports nothing of the product.

    python -m loadtest.scaleout_bench --out docs/benchmarks/scale-out.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

from loadtest.bench import Bench, BenchOptions
from loadtest.compare import ServerSpec, free_port, running, wait_healthy
from loadtest.metrics import BenchmarkMetrics, RequestResult, compute_metrics
from loadtest.prom import scrape, total
from loadtest.report import git_info, machine_info
from loadtest.workloads import WorkloadOptions

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Config:
    """One way of serving: its name and the server flags that make it."""

    name: str
    replicas: int
    policy: str | None = None  # None: one server, no router
    flags: tuple[str, ...] = ()


# "1 replica, 1 thread" has the per-replica thread count of the two-replica
# configurations (the supervisor gives each cores // 2), so the effect of the
# second replica is told apart from the effect of fewer threads per engine.
CONFIGS = (
    Config("1 replica (all cores)", 1),
    Config("1 replica, 1 thread", 1, flags=("--num-threads", "1")),
    Config("2 replicas, round robin", 2, "round_robin"),
    Config("2 replicas, cache-aware", 2, "cache_aware"),
)


@dataclass
class Pooled:
    """A configuration's repeats pooled: all requests, total time, prefix counters."""

    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    queries: float = 0.0
    hits: float = 0.0

    def metrics(self) -> BenchmarkMetrics:
        return compute_metrics(self.results, self.duration_s, {}, (50.0, 99.0))


def prefix_counters(url: str) -> tuple[float, float]:
    """(tokens looked up, tokens found) in the prefix cache, from a server's /metrics."""
    m = scrape(url)
    return total(m, "vllm:prefix_cache_queries_total"), total(m, "vllm:prefix_cache_hits_total")


@contextlib.contextmanager
def serving(cfg: Config, extra: list[str], log: Path) -> Iterator[tuple[str, list[str]]]:
    """Start ``cfg``; yield (the URL clients use, the replicas' URLs)."""
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "--host", "127.0.0.1", "--port", str(port)]
    argv += [*extra, *cfg.flags]
    if cfg.replicas == 1:
        with running(ServerSpec(cfg.name, argv, port, "/health"), log, 600) as url:
            yield url, [url]
        return
    ports = [free_port() for _ in range(cfg.replicas)]
    assert cfg.policy is not None
    argv += ["--data-parallel-size", str(cfg.replicas), "--router-policy", cfg.policy]
    argv += ["--data-parallel-ports", *map(str, ports), "--router-metrics-port", str(free_port())]
    replicas = [f"http://127.0.0.1:{p}" for p in ports]
    with running(ServerSpec(cfg.name, argv, port, "/readiness"), log, 600) as url:
        for r in replicas:  # the router is ready with one healthy replica; wait for all
            wait_healthy(r + "/health", None, 600)
        yield url, replicas


async def drive(opts: BenchOptions, concurrency: int) -> tuple[list[RequestResult], float]:
    async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
        outcome = await Bench(opts).run_level(client, MODEL, concurrency)
    return list(outcome.load.results), outcome.load.duration_s


def render(
    pooled: dict[str, Pooled], a: argparse.Namespace, argv: list[str], loads: list[str]
) -> str:
    rows = []
    for cfg in CONFIGS:
        p = pooled[cfg.name]
        m = p.metrics()
        rate = p.hits / p.queries if p.queries else 0.0
        rows.append((cfg.name, m, rate))
    base = rows[0][1]
    lines = [
        "# Scale-out benchmark: one replica, two round-robin, two cache-aware",
        "",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit "
        f"{git_info().get('commit', '?')}; machine: {machine_info()}.",
        f"Load average (1/5/15 min) at the start and end: {loads[0]} / {loads[-1]}.",
        "",
        f"Command: `python -m loadtest.scaleout_bench {' '.join(argv)}`",
        "",
        f"Workload `conversations`: {a.conversations} conversations x {a.turns} turns, "
        f"each opening with the bundled ~1,100-token system prompt and resending its "
        f"history, concurrency {a.concurrency}, max_tokens {a.max_tokens}, temperature 0; "
        f"{a.repeats} alternations of the configurations, repeats pooled. "
        "The two-replica configurations are `fuel-serve --data-parallel-size 2 "
        "--router-policy POLICY` (vllm-router 0.1.17 in front; each replica gets "
        "`--num-threads cores/2`); the single replica uses every core. Hit rate: "
        "prefix-cache tokens found / looked up, summed over the replicas' `/metrics`.",
        "",
        "| configuration | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | hit rate | "
        "completed | failed | tok/s vs 1 replica |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m, rate in rows:
        ratio = m.output_throughput / base.output_throughput if base.output_throughput else 0.0
        lines.append(
            f"| {name} | {m.output_throughput:.1f} | {m.ttft.median_ms:.0f} | "
            f"{m.ttft.percentiles_ms.get('p99', float('nan')):.0f} | {rate:.1%} | "
            f"{m.completed} | {m.failed} | {ratio:.2f}x |"
        )
    rr, ca = rows[2], rows[3]
    if rr[1].ttft.median_ms:
        lines += [
            "",
            f"Cache-aware / round-robin: hit rate {ca[2]:.1%} vs {rr[2]:.1%}, TTFT p50 "
            f"{ca[1].ttft.median_ms / rr[1].ttft.median_ms:.2f}x, output tok/s "
            f"{ca[1].output_throughput / rr[1].output_throughput:.2f}x.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="alternations of the configurations")
    ap.add_argument("--server-args", default="", help="extra server flags (one string)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    args = list(sys.argv[1:] if argv is None else argv)
    extra = a.server_args.split()
    logs = Path("loadtest/results")
    pooled = {c.name: Pooled() for c in CONFIGS}
    loads = [Path("/proc/loadavg").read_text().strip()]
    for rep in range(a.repeats):
        for cfg in CONFIGS:
            tag = cfg.policy or ("direct-1t" if cfg.flags else "direct")
            log = logs / f"scaleout-{cfg.replicas}-{tag}-{rep}.log"
            with serving(cfg, extra, log) as (url, replicas):
                opts = BenchOptions(
                    base_url=url,
                    model=MODEL,
                    workload="conversations",
                    # Every configuration gets the same conversations in a repeat.
                    workload_opts=WorkloadOptions(
                        max_tokens=a.max_tokens, num_turns=a.turns, seed=1000 * rep + 1
                    ),
                    num_requests=a.conversations * a.turns,
                    concurrency=[a.concurrency],
                    max_duration_s=1200,
                    show_progress=False,
                )
                before = [prefix_counters(r) for r in replicas]
                t0 = time.perf_counter()
                results, duration = asyncio.run(drive(opts, a.concurrency))
                after = [prefix_counters(r) for r in replicas]
            p = pooled[cfg.name]
            p.results += results
            p.duration_s += duration
            p.queries += sum(x[0] - y[0] for x, y in zip(after, before))
            p.hits += sum(x[1] - y[1] for x, y in zip(after, before))
            print(
                f"{cfg.name} (repeat {rep}): {len(results)} requests in {time.perf_counter() - t0:.0f}s"
            )
    loads.append(Path("/proc/loadavg").read_text().strip())
    text = render(pooled, a, args, loads)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
