"""KV tiers, measured over HTTP: device-only vs host vs host + disk; restarts; swap vs recompute.

1. Multi-conversation workload. ``--conversations`` conversations, each a
   distinct document of about ``--doc-tokens`` tokens followed by a question,
   visited round-robin for ``--rounds`` rounds. The device pool
   (``--num-gpu-blocks-override``) holds about a quarter of the documents
   (``--working-set-ratio``), so under LRU a device-only server evicts every
   document before it comes back; the host tier catches them. Three servers
   (tiers off, host, host + disk) run side by side and the rounds alternate
   between them. Prefix hit rate (device + external tokens over queried
   tokens) comes from each server's ``/metrics``.
2. Restart: a host + disk server is warmed (one round), stopped with SIGTERM
   (its drain flushes the tiers) and restarted on the same directory; the
   first requests' TTFT (one per conversation) is compared with a server on an
   empty directory. Warm and cold alternate.
3. Overload: ``--overload-requests`` long generations at once in a small pool,
   so requests are preempted; recompute without tiers, recompute with the host
   tier (resumes find their full blocks there) and ``--preemption-mode swap``.
   Completed requests per second and ITL p99.

    python -m loadtest.kv_tiers_bench --out docs/benchmarks/kv-tiers.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

from loadtest.client import ClientConfig, RequestSpec, send_request
from loadtest.compare import ServerSpec, free_port, running
from loadtest.metrics import RequestResult, percentile
from loadtest.prom import scrape, total
from loadtest.report import git_info, machine_info

DATA = Path(__file__).resolve().parent / "data"
MODEL = "SmolLM2-135M-Instruct"
LOGS = Path("loadtest/results")


def _server(extra: Sequence[str]) -> ServerSpec:
    port = free_port()
    argv = [sys.executable, "-m", "server.cli", "--host", "127.0.0.1", "--port", str(port), *extra]
    return ServerSpec("fuel-serve", argv, port, "/health")


def _counters(url: str) -> dict[str, float]:
    """Totals of the prefix-cache counters (summed over labels) and per-tier hits."""
    m = scrape(url)
    return {
        "queries": total(m, "vllm:prefix_cache_queries_total"),
        "device_hits": total(m, "vllm:prefix_cache_hits_total"),
        "external_hits": total(m, "vllm:external_prefix_cache_hits_total"),
        "host_hits": total(m, "fuel:kv_tier_hit_tokens_total", tier="host"),
        "disk_hits": total(m, "fuel:kv_tier_hit_tokens_total", tier="disk"),
        "preemptions": total(m, "vllm:num_preemptions_total"),
        "swap_outs": total(m, "fuel:kv_swap_outs_total"),
    }


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def documents(n: int, doc_tokens: int) -> list[str]:
    """``n`` distinct documents of about ``doc_tokens`` tokens (~0.75 words a token)."""
    words = (DATA / "system_prompt.txt").read_text().split()
    per = max(8, int(doc_tokens * 0.75))
    docs = []
    for i in range(n):
        start = (i * 37) % len(words)
        body = [words[(start + j) % len(words)] for j in range(per)]
        docs.append(f"Conversation {i} reference notes:\n" + " ".join(body))
    return docs


def questions() -> list[str]:
    return [q for q in (DATA / "questions.txt").read_text().splitlines() if q.strip()]


async def _send(url: str, prompt: str, max_tokens: int, ignore_eos: bool = True) -> RequestResult:
    cfg = ClientConfig(base_url=url, endpoint="completions", model=MODEL)
    spec = RequestSpec(prompt=prompt, max_tokens=max_tokens, ignore_eos=ignore_eos)
    async with httpx.AsyncClient(trust_env=False, timeout=900) as client:
        r = await send_request(client, cfg, spec)
    if not r.success:
        raise RuntimeError(f"request failed: {r.error}")
    return r


async def _concurrent(
    url: str, prompts: Sequence[str], max_tokens: int, concurrency: int, ignore_eos: bool = True
) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency)
    cfg = ClientConfig(base_url=url, endpoint="completions", model=MODEL)

    async with httpx.AsyncClient(trust_env=False, timeout=1800) as client:

        async def one(p: str) -> RequestResult:
            async with sem:
                spec = RequestSpec(prompt=p, max_tokens=max_tokens, ignore_eos=ignore_eos)
                return await send_request(client, cfg, spec)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    bad = [r for r in results if not r.success]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed, first: {bad[0].error}")
    return list(results), wall


@dataclass
class ConfigRun:
    name: str
    flags: list[str]
    results: list[RequestResult] = field(default_factory=list)
    wall_s: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


def _ms(xs: Sequence[float], p: float) -> float:
    return percentile(list(xs), p) * 1000.0


def workload(a: argparse.Namespace, base: list[str]) -> list[str]:
    docs = documents(a.conversations, a.doc_tokens)
    qs = questions()
    host = ["--kv-offloading-size", str(a.host_gib)]
    configs = [
        ConfigRun("device only", base),
        ConfigRun("host", base + host),
        ConfigRun("host + disk", base + host),  # disk flags added with a directory below
    ]
    with contextlib.ExitStack() as stack:
        disk_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="fuel-kv-bench-"))
        configs[2].flags += ["--kv-offloading-disk-path", disk_dir]
        urls = [
            stack.enter_context(running(_server(c.flags), LOGS / f"kv-tiers-{i}.log", 600))
            for i, c in enumerate(configs)
        ]
        before = [_counters(u) for u in urls]
        for rnd in range(a.rounds):
            prompts = [
                f"{d}\n\nQuestion: {qs[(rnd * len(docs) + i) % len(qs)]}\nAnswer:"
                for i, d in enumerate(docs)
            ]
            for c, url in zip(configs, urls):  # alternate: one round of each in turn
                res, wall = asyncio.run(_concurrent(url, prompts, a.max_tokens, a.concurrency))
                c.results += res
                c.wall_s += wall
        for c, url, b in zip(configs, urls, before):
            c.counters = _delta(_counters(url), b)
    lines = [
        "## Multi-conversation workload: device only vs host vs host + disk",
        "",
        f"{a.conversations} conversations of ~{a.doc_tokens}-token documents, round-robin, "
        f"{a.rounds} rounds ({a.conversations * a.rounds} requests per server), concurrency "
        f"{a.concurrency}, max_tokens {a.max_tokens} (ignore_eos); device pool {a.gpu_blocks} blocks of 16 "
        f"tokens ({a.gpu_blocks * 16} tokens) for a prefix working set of about "
        f"{a.conversations * a.doc_tokens} tokens; host tier {a.host_gib} GiB. The rounds "
        "alternate between the three servers.",
        "",
        "| tiers | prefix hit rate (tokens) | from host | from disk | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    stats = []
    for c in configs:
        q = c.counters["queries"] or 1.0
        rate = (c.counters["device_hits"] + c.counters["external_hits"]) / q
        ttft = [r.ttft_s for r in c.results]
        out_tps = sum(r.output_tokens for r in c.results) / c.wall_s
        stats.append((rate, _ms(ttft, 50), _ms(ttft, 99), out_tps))
        lines.append(
            f"| {c.name} | {rate:.0%} | {c.counters['host_hits'] / q:.0%} | "
            f"{c.counters['disk_hits'] / q:.0%} | {_ms(ttft, 50):.0f} | {_ms(ttft, 99):.0f} | "
            f"{out_tps:.1f} |"
        )
    d = stats[0]
    for name, s in (("host", stats[1]), ("host + disk", stats[2])):
        lines.append(
            f"| **{name} / device only** | **{s[0] / d[0] if d[0] else float('inf'):.1f}x** | | | "
            f"**{d[1] / s[1]:.1f}x lower** | {d[2] / s[2]:.1f}x lower | {s[3] / d[3]:.2f}x |"
        )
    lines.append("")
    return lines


def restart(a: argparse.Namespace, base: list[str]) -> list[str]:
    docs = documents(a.conversations, a.doc_tokens)
    qs = questions()
    host = ["--kv-offloading-size", str(a.host_gib)]
    first = [f"{d}\n\nQuestion: {qs[-1 - i]}\nAnswer:" for i, d in enumerate(docs)]
    warm_ms: list[float] = []
    cold_ms: list[float] = []
    disk_hits = 0.0
    for _ in range(a.restart_repeats):
        with tempfile.TemporaryDirectory(prefix="fuel-kv-warm-") as warm_dir:
            flags = [*base, *host, "--kv-offloading-disk-path", warm_dir]
            with running(_server(flags), LOGS / "kv-restart-prime.log", 600) as url:
                asyncio.run(
                    _concurrent(
                        url,
                        [f"{d}\n\nQuestion: {qs[0]}\nAnswer:" for d in docs],
                        a.max_tokens,
                        a.concurrency,
                    )
                )
            # Stopped with SIGTERM: the drain flushed the tiers to warm_dir.
            with running(_server(flags), LOGS / "kv-restart-warm.log", 600) as url:
                b = _counters(url)
                for p in first:
                    warm_ms.append(asyncio.run(_send(url, p, a.max_tokens)).ttft_s * 1000)
                disk_hits += _delta(_counters(url), b)["disk_hits"]
        with tempfile.TemporaryDirectory(prefix="fuel-kv-cold-") as cold_dir:
            flags = [*base, *host, "--kv-offloading-disk-path", cold_dir]
            with running(_server(flags), LOGS / "kv-restart-cold.log", 600) as url:
                for p in first:
                    cold_ms.append(asyncio.run(_send(url, p, a.max_tokens)).ttft_s * 1000)
    w50, c50 = statistics.median(warm_ms), statistics.median(cold_ms)
    return [
        "## TTFT of the first requests after a restart: warm vs cold disk tier",
        "",
        f"{a.restart_repeats} repeat(s), warm then cold; the first {len(first)} requests after "
        "start-up (one per conversation, sequential). Warm: the same directory a server "
        "drained (SIGTERM) into; cold: an empty directory. "
        f"Tokens served from disk after the warm restarts: {disk_hits:.0f}.",
        "",
        "| disk tier at start-up | TTFT p50 (ms) | TTFT max (ms) |",
        "|---|---|---|",
        f"| warm | {w50:.0f} | {max(warm_ms):.0f} |",
        f"| cold | {c50:.0f} | {max(cold_ms):.0f} |",
        f"| **ratio cold / warm** | **{c50 / w50:.1f}x** | |",
        "",
    ]


def overload(a: argparse.Namespace, base_common: list[str]) -> list[str]:
    docs = documents(a.overload_requests, a.overload_prompt_tokens)
    # Preemption under overload is the point: admission control must not refuse.
    base = [
        *base_common,
        "--num-gpu-blocks-override",
        str(a.overload_gpu_blocks),
        "--kv-pressure-watermark",
        "1.0",
        "--kv-pressure-preemptions-per-s",
        "1000000",
    ]
    host = ["--kv-offloading-size", str(a.host_gib)]
    configs = [
        ConfigRun("recompute, no tiers", base),
        ConfigRun("recompute + host tier", [*base, *host]),
        ConfigRun("swap (host tier)", [*base, *host, "--preemption-mode", "swap"]),
    ]
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(running(_server(c.flags), LOGS / f"kv-overload-{i}.log", 600))
            for i, c in enumerate(configs)
        ]
        before = [_counters(u) for u in urls]
        for _ in range(a.overload_repeats):
            for c, url in zip(configs, urls):
                res, wall = asyncio.run(
                    _concurrent(url, docs, a.overload_max_tokens, len(docs), ignore_eos=True)
                )
                c.results += res
                c.wall_s += wall
        for c, url, b in zip(configs, urls, before):
            c.counters = _delta(_counters(url), b)
    lines = [
        "## Swap vs recompute preemption under overload",
        "",
        f"{a.overload_requests} requests at once (~{a.overload_prompt_tokens}-token prompts, "
        f"{a.overload_max_tokens} tokens each, ignore_eos), device pool "
        f"{a.overload_gpu_blocks} blocks of 16 tokens, {a.overload_repeats} repeat(s) "
        "alternating between the servers; admission control opened so that requests are "
        "preempted instead of refused.",
        "",
        "| preemption | completed req/s | ITL p50 (ms) | ITL p99 (ms) | preemptions | swap-outs |",
        "|---|---|---|---|---|---|",
    ]
    rows = []
    for c in configs:
        itl = [x for r in c.results for x in r.itl_s]
        rps = len(c.results) / c.wall_s
        rows.append((rps, _ms(itl, 99)))
        lines.append(
            f"| {c.name} | {rps:.3f} | {_ms(itl, 50):.0f} | {_ms(itl, 99):.0f} | "
            f"{c.counters['preemptions']:.0f} | {c.counters['swap_outs']:.0f} |"
        )
    r0 = rows[0]
    for name, r in (("recompute + host", rows[1]), ("swap", rows[2])):
        lines.append(
            f"| **{name} / recompute, no tiers** | **{r[0] / r0[0]:.2f}x** | | "
            f"{r0[1] / r[1]:.2f}x lower | | |"
        )
    lines.append("")
    return lines


@contextlib.contextmanager
def _loadavg(lines: list[str]) -> Iterator[None]:
    def read() -> str:
        try:
            return Path("/proc/loadavg").read_text().strip()
        except OSError:
            return "?"

    start = read()
    yield
    lines.append(f"Load (`/proc/loadavg`) before: `{start}`; after: `{read()}`.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument(
        "--working-set-ratio",
        type=float,
        default=4.0,
        help="prefix working set / device pool (sets the pool size)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--host-gib", type=float, default=0.5)
    ap.add_argument("--restart-repeats", type=int, default=2)
    ap.add_argument("--overload-requests", type=int, default=12)
    ap.add_argument("--overload-prompt-tokens", type=int, default=64)
    ap.add_argument("--overload-max-tokens", type=int, default=96)
    ap.add_argument("--overload-gpu-blocks", type=int, default=48)
    ap.add_argument("--overload-repeats", type=int, default=2)
    ap.add_argument("--server-flags", default="", help="extra flags for every server")
    ap.add_argument("--sections", default="workload,restart,overload")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    # The pool must still fit a couple of requests (documents run ~25% over their
    # nominal token count, plus the question and the output).
    one_request = -(-int(a.doc_tokens * 1.4 + 32 + a.max_tokens) // 16)
    a.gpu_blocks = max(
        2 * one_request, int(a.conversations * a.doc_tokens / a.working_set_ratio) // 16
    )
    common = a.server_flags.split()
    base = [*common, "--num-gpu-blocks-override", str(a.gpu_blocks)]
    lines: list[str] = []
    sections = a.sections.split(",")
    head = _head(argv)
    body: list[str] = []

    def save() -> None:  # after each section: a long run killed later keeps what it measured
        text = "\n".join(head + body + lines) + "\n"
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(text)

    with _loadavg(lines):
        if "workload" in sections:
            body += workload(a, base)
            save()
        if "restart" in sections:
            body += restart(a, base)
            save()
        if "overload" in sections:
            body += overload(a, common)
    save()
    print("\n".join(head + body + lines))
    return 0


def _head(argv: list[str] | None) -> list[str]:
    return [
        "# KV tiers benchmark (device -> host -> disk, swap preemption)",
        "",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; commit "
        f"{git_info().get('commit', '?')}; machine: {machine_info()}. The machine is shared "
        "(2 cores, other engineers' jobs): read the ratios, not the absolute figures.",
        "",
        f"Command: `python -m loadtest.kv_tiers_bench {' '.join(argv if argv is not None else sys.argv[1:])}`",
        "",
    ]


if __name__ == "__main__":
    raise SystemExit(main())
