"""Prefix caching, measured: TTFT with a cached ~1,000-token system prompt vs cold,
and a multi-turn chat load with the cache on vs off, all in one run.

Cold requests carry a fresh ``cache_salt`` each (same text, nothing shared);
warm ones share one salt after a priming request. The multi-turn load runs
against a server started with and without ``--no-enable-prefix-caching``,
alternating; the prefix hit rate comes from the server's own ``/metrics``.

    python -m loadtest.prefix_bench --out docs/benchmarks/prefix-cache.md
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import Bench, BenchOptions
from loadtest.client import ClientConfig, RequestSpec, send_request
from loadtest.compare import ServerSpec, free_port, running
from loadtest.prom import scrape, total
from loadtest.report import git_info, machine_info
from loadtest.workloads import WorkloadOptions

DATA = Path(__file__).resolve().parent / "data"


def _server(extra: list[str]) -> ServerSpec:
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "--host", "127.0.0.1", "--port", str(port), *extra]
    return ServerSpec("fuel-serve", argv, port, "/health")


async def _ttft(url: str, model: str, system: str, salt: str, question: str) -> float:
    cfg = ClientConfig(base_url=url, endpoint="chat", model=model)
    spec = RequestSpec(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=8,
        extra_body={"cache_salt": salt},
    )
    async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
        r = await send_request(client, cfg, spec)
    if not r.success:
        raise RuntimeError(f"request failed: {r.error}")
    assert r.ttft_s is not None
    return r.ttft_s


async def _run_level(bench: Bench, model: str, concurrency: int) -> Any:
    async with httpx.AsyncClient(trust_env=False, timeout=600) as client:
        return await bench.run_level(client, model, concurrency)


def _prefix_counters(url: str) -> tuple[float, float]:
    m = scrape(url)
    return total(m, "vllm:prefix_cache_queries_total"), total(m, "vllm:prefix_cache_hits_total")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6, help="cold/warm pairs")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    system = (DATA / "system_prompt.txt").read_text()
    questions = [q for q in (DATA / "questions.txt").read_text().splitlines() if q.strip()]
    model = "SmolLM2-135M-Instruct"
    logs = Path("loadtest/results")
    lines: list[str] = []

    # 1. TTFT cold vs cached, one server, alternating.
    with running(_server([]), logs / "prefix-ttft.log", 300) as url:
        warm_salt = uuid.uuid4().hex
        asyncio.run(_ttft(url, model, system, warm_salt, "Hello"))  # prime the cache
        cold: list[float] = []
        warm: list[float] = []
        for i in range(a.repeats):
            q = questions[i % len(questions)]
            cold.append(asyncio.run(_ttft(url, model, system, uuid.uuid4().hex, q)))
            warm.append(asyncio.run(_ttft(url, model, system, warm_salt, q)))
    c50, w50 = statistics.median(cold), statistics.median(warm)
    lines += [
        "## Time to first token, ~1,000-token system prompt cached vs cold",
        "",
        f"{a.repeats} pairs, alternating, one server, max_tokens 8, temperature 0.",
        "",
        "| | median TTFT (ms) | min (ms) | max (ms) |",
        "|---|---|---|---|",
        f"| cold (fresh cache_salt) | {c50 * 1000:.0f} | {min(cold) * 1000:.0f} | {max(cold) * 1000:.0f} |",
        f"| cached system prompt | {w50 * 1000:.0f} | {min(warm) * 1000:.0f} | {max(warm) * 1000:.0f} |",
        f"| **ratio cold / cached** | **{c50 / w50:.1f}x** | | |",
        "",
    ]

    # 2. Multi-turn chat load, cache on vs off (alternating servers).
    rows: list[tuple[Any, ...]] = []
    for flag in ([], ["--no-enable-prefix-caching"]):
        with running(_server(flag), logs / f"prefix-mt{'-off' if flag else ''}.log", 300) as url:
            opts = BenchOptions(
                base_url=url,
                model=model,
                workload="multi-turn",
                workload_opts=WorkloadOptions(max_tokens=a.max_tokens),
                num_requests=a.conversations * 4,
                concurrency=[a.concurrency],
                max_duration_s=600,
                show_progress=False,
            )
            outcome = asyncio.run(_run_level(Bench(opts), model, a.concurrency))
            queries, hits = _prefix_counters(url)
            m = outcome.metrics
            rows.append(
                (
                    "on" if not flag else "off",
                    hits / queries if queries else 0.0,
                    m.output_throughput,
                    m.total_token_throughput,
                    m.ttft.median_ms,
                    m.completed,
                )
            )
    lines += [
        "## Multi-turn chat (each turn resends the history), cache on vs off",
        "",
        f"{a.conversations * 4} requests, concurrency {a.concurrency}, max_tokens {a.max_tokens}.",
        "",
        "| prefix cache | hit rate (tokens) | output tok/s | total tok/s | TTFT p50 (ms) | completed |",
        "|---|---|---|---|---|---|",
    ]
    for name, rate, out_tps, tot_tps, ttft, done in rows:
        lines.append(
            f"| {name} | {rate:.0%} | {out_tps:.1f} | {tot_tps:.1f} | {ttft:.0f} | {done} |"
        )
    if len(rows) == 2 and rows[1][3]:
        lines.append(
            f"| **ratio on / off** | | {rows[0][2] / rows[1][2]:.2f}x | {rows[0][3] / rows[1][3]:.2f}x | | |"
        )
    head = [
        "# Prefix caching benchmark",
        "",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit {git_info().get('commit', '?')}; "
        f"machine: {machine_info()}. The machine is shared (2 cores); figures drift between runs.",
        "",
        f"Command: `python -m loadtest.prefix_bench {' '.join(argv or sys.argv[1:])}`",
        "",
    ]
    text = "\n".join(head + lines) + "\n"
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
