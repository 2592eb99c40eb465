"""``loadtest compare``: Fuel Serve against llama.cpp's server on the same model.

Both servers are started on loopback (or given with ``--ours-url`` /
``--peer-url`` when already running), and every (workload, concurrency) cell is
run alternately, ours then peer, ``--repeats`` times (A, B, A, B), so slow
drift of the machine (other jobs, thermal state) hits both sides alike. Each
side's repeats are pooled: latency statistics over all requests, throughput
as total work over total time. The result is a markdown table of ratios
(ours / peer) written to ``docs/benchmarks/cpu.md`` by default.

The peer is, in order of preference: ``--peer-bin`` or a ``llama-server`` on
PATH (continuous batching over ``--parallel`` slots), else
``python -m llama_cpp.server`` from ``--peer-venv`` (llama-cpp-python's server,
which runs one request at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import Bench, make_client, resolve_model
from loadtest.cliargs import add_workload_args, bench_options, common_record
from loadtest.guard import check_loopback_url
from loadtest.metrics import BenchmarkMetrics, RequestResult, compute_metrics, parse_goodput
from loadtest.report import server_info, write_json
from loadtest.workloads import WORKLOADS, default_gguf

DEFAULT_GRID = "questions:1,16,32;shared-prefix:1,16"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "cpu.md"
DEFAULT_PEER_VENV = Path("/work/peer-venv")


def parse_grid(text: str) -> list[tuple[str, int]]:
    """``"questions:1,16;shared-prefix:1"`` -> ``[("questions", 1), ("questions", 16), ...]``."""
    cells: list[tuple[str, int]] = []
    for part in text.split(";"):
        if not part.strip():
            continue
        name, sep, levels = part.partition(":")
        name = name.strip()
        if not sep or name not in WORKLOADS:
            raise argparse.ArgumentTypeError(f"bad --grid item {part!r}: use WORKLOAD:C1,C2,...")
        try:
            cs = [int(c) for c in levels.split(",") if c.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"bad concurrency list in {part!r}") from e
        if not cs or any(c < 1 for c in cs):
            raise argparse.ArgumentTypeError(f"bad concurrency list in {part!r}")
        cells.extend((name, c) for c in cs)
    if not cells:
        raise argparse.ArgumentTypeError("--grid is empty")
    return cells


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", type=Path, default=None, help="GGUF (default: SmolLM2 Q4_1)")
    p.add_argument(
        "--grid",
        type=parse_grid,
        default=parse_grid(DEFAULT_GRID),
        help=f"cells as WORKLOAD:C1,C2;... (default {DEFAULT_GRID!r})",
    )
    p.add_argument("--repeats", type=int, default=2, help="A,B alternations per cell")
    p.add_argument("--ours-url", default=None, help="use a running Fuel Serve instead")
    p.add_argument("--peer-url", default=None, help="use a running peer instead")
    p.add_argument(
        "--ours-arg",
        action="append",
        default=[],
        help="extra argument for `python -m server.cli` (repeatable)",
    )
    p.add_argument("--peer-bin", default=None, help="llama-server binary (default: PATH)")
    p.add_argument(
        "--peer-venv",
        type=Path,
        default=DEFAULT_PEER_VENV,
        help="venv with llama-cpp-python[server], used without llama-server",
    )
    p.add_argument("--threads", type=int, default=2, help="peer CPU threads")
    p.add_argument("--parallel", type=int, default=32, help="llama-server slots (-np)")
    p.add_argument(
        "--ctx-per-slot",
        type=int,
        default=2048,
        help="context tokens per llama-server slot (-c is this x --parallel)",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="markdown report")
    p.add_argument(
        "--result-dir",
        type=Path,
        default=Path(__file__).resolve().parent / "results",
        help="where the JSON of all runs goes",
    )
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: --result-dir)")
    add_workload_args(p)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerSpec:
    """How to start one server and how to tell it is ready."""

    name: str
    argv: list[str]
    port: int
    health_path: str
    notes: str = ""
    sends_usage: bool = True  # False: its streams never carry usage

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def ours_spec(model: Path, extra: Sequence[str]) -> ServerSpec:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "server.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
        str(model),
    ]
    return ServerSpec("fuel-serve", argv, port, "/health")


def peer_spec(a: argparse.Namespace, model: Path) -> ServerSpec:
    """llama-server if available, else llama-cpp-python's server; RuntimeError if neither."""
    port = free_port()
    binary = a.peer_bin or shutil.which("llama-server")
    if binary:
        argv = [
            binary,
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(a.threads),
            "-np",
            str(a.parallel),
            "-cb",
            "-c",
            str(a.ctx_per_slot * a.parallel),
        ]
        notes = f"llama-server, {a.parallel} slots, continuous batching, {a.threads} threads"
        return ServerSpec("llama-server", argv, port, "/health", notes)
    py = a.peer_venv / "bin" / "python"
    if py.exists():
        # interrupt_requests defaults to True, which aborts the streaming request
        # whenever another arrives: under concurrency nearly everything would fail.
        argv = [
            str(py),
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--n_threads",
            str(a.threads),
            "--n_ctx",
            str(a.ctx_per_slot),
            "--interrupt_requests",
            "false",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        notes = (
            "llama-cpp-python server: one request at a time (requests queue behind a "
            "lock; no slots, no continuous batching); it sends no usage, so its output "
            "tokens are counted as content chunks"
        )
        return ServerSpec("llama_cpp.server", argv, port, "/v1/models", notes, sends_usage=False)
    raise RuntimeError(
        "no peer: give --peer-bin, put llama-server on PATH, or install "
        f"llama-cpp-python[server] in {a.peer_venv} (see docs/LOADTEST.md)"
    )


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; RuntimeError if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5.0) as c:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with status {proc.returncode} before {url} was up"
                )
            with contextlib.suppress(httpx.HTTPError):
                if c.get(url).status_code == 200:
                    return
            time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f}s")


@contextlib.contextmanager
def running(spec: ServerSpec, log_path: Path, timeout_s: float) -> Iterator[str]:
    """Start ``spec``, wait until healthy, yield its URL; always stop it afterwards."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        print(f"starting {spec.name}: {shlex.join(spec.argv)} (log: {log_path})")
        proc = subprocess.Popen(
            spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            wait_healthy(spec.url + spec.health_path, proc, timeout_s)
            yield spec.url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class SideResult:
    """One side of one cell: every repeat's requests and durations."""

    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    cancelled: int = 0

    def metrics(self, slos: dict[str, float]) -> BenchmarkMetrics:
        return compute_metrics(self.results, self.duration_s, slos)


# (label, getter, higher is better)
ROWS: list[tuple[str, Any, bool]] = [
    ("output tok/s", lambda m: m.output_throughput, True),
    ("requests/s", lambda m: m.request_throughput, True),
    ("TTFT p50 (ms)", lambda m: m.ttft.median_ms, False),
    ("TTFT p99 (ms)", lambda m: m.ttft.percentiles_ms.get("p99"), False),
    ("TPOT p50 (ms)", lambda m: m.tpot.median_ms, False),
    ("ITL p99 (ms)", lambda m: m.itl.percentiles_ms.get("p99"), False),
    ("E2E p50 (ms)", lambda m: m.e2el.median_ms, False),
]


def _fmt(x: float | None) -> str:
    if x is None or x != x:
        return "n/a"
    return f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def render_markdown(
    cells: dict[tuple[str, int], dict[str, SideResult]],
    slos: dict[str, float],
    header: dict[str, Any],
) -> str:
    """The comparison report: context, then one row per (cell, metric) with ours/peer."""
    lines = [
        "# CPU benchmark: Fuel Serve vs llama.cpp",
        "",
        f"- Date: {header['date']}",
        f"- Command: `{header['command']}`",
        f"- Git commit: `{header['git'].get('commit')}`"
        + (" (uncommitted changes)" if header["git"].get("dirty") else ""),
        f"- Machine: {header['machine']['cpu_model']}, {header['machine']['usable_cores']} usable "
        f"cores, {header['machine']['memory_gib']} GiB RAM, {header['machine']['os']}",
        f"- Model: `{header['model_path']}`",
        f"- Ours: `{header['ours']}`",
        f"- Peer: `{header['peer']}` {header.get('peer_notes', '')}",
        f"- Per cell: {header['repeats']} x (ours, then peer), "
        f"{header['num_requests']} requests each, max_tokens {header['max_tokens']}, "
        f"temperature {header['temperature']}; repeats pooled.",
        "",
        "Ratio is ours / peer. For throughput higher is better; for latencies lower is better.",
        "",
        "| workload | conc | metric | ours | peer | ours/peer |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for (workload, conc), sides in cells.items():
        mo, mp = sides["ours"].metrics(slos), sides["peer"].metrics(slos)
        for label, get, _higher in ROWS:
            vo, vp = get(mo), get(mp)
            ratio = vo / vp if vo is not None and vp and vo == vo and vp == vp else None
            lines.append(
                f"| {workload} | {conc} | {label} | {_fmt(vo)} | {_fmt(vp)} | "
                f"{'n/a' if ratio is None else f'{ratio:.2f}x'} |"
            )
        lines.append(
            f"| {workload} | {conc} | failed / cancelled | {mo.failed} / "
            f"{sides['ours'].cancelled} | {mp.failed} / {sides['peer'].cancelled} | |"
        )
    errors = [
        f"- {side}, {workload} c={conc}: {err} (x{n})"
        for (workload, conc), sides in cells.items()
        for side, res in sides.items()
        for err, n in sorted(Counter(r.error for r in res.results if not r.success).items())
    ]
    if errors:
        lines += ["", "Failures:", "", *errors]
    lines.append("")
    return "\n".join(lines)


async def _drive(
    a: argparse.Namespace, urls: dict[str, str], no_usage: set[str]
) -> dict[tuple[str, int], dict[str, SideResult]]:
    """Run every cell, alternating sides; ``no_usage`` names sides that send no usage."""
    cells: dict[tuple[str, int], dict[str, SideResult]] = {}
    max_conn = max(c for _, c in a.grid)
    benches: dict[str, Bench] = {}
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[str, httpx.AsyncClient] = {}
        models: dict[str, str] = {}
        for side, url in urls.items():
            opts = bench_options(a, url, a.grid[0][0])
            clients[side] = await stack.enter_async_context(make_client(opts, max_conn))
            models[side] = a.model or await resolve_model(clients[side], url, a.api_key)
        for workload, conc in a.grid:
            cell = cells.setdefault((workload, conc), {s: SideResult() for s in urls})
            for rep in range(a.repeats):
                for side, url in urls.items():  # dict order: ours, then peer
                    key = f"{side}:{workload}"
                    if key not in benches:
                        opts = bench_options(a, url, workload)
                        opts.count_chunks_without_usage |= side in no_usage
                        benches[key] = Bench(opts)
                    out = await benches[key].run_level(
                        clients[side],
                        models[side],
                        conc,
                        label=f"{side} {workload} c={conc} #{rep + 1}",
                    )
                    m = out.metrics
                    print(
                        f"{side:>5} {workload} c={conc} #{rep + 1}: "
                        f"{m.output_throughput:.1f} out tok/s, TTFT p50 {m.ttft.median_ms:.0f} ms, "
                        f"failed {m.failed}"
                    )
                    cell[side].results.extend(out.load.results)
                    cell[side].duration_s += out.load.duration_s
                    cell[side].cancelled += out.load.cancelled
    return cells


def run_compare(a: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the comparison; returns the exit status (0 when both sides completed requests)."""
    if a.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if a.endpoint != "chat" and any(w == "multi-turn" for w, _ in a.grid):
        raise ValueError("the multi-turn workload needs --endpoint chat")
    model = a.model_path or default_gguf()
    log_dir = a.log_dir or a.result_dir
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    with contextlib.ExitStack() as stack:
        specs: dict[str, str] = {}
        urls: dict[str, str] = {}
        peer_notes = ""
        no_usage: set[str] = set()
        if a.ours_url:
            urls["ours"] = check_loopback_url(a.ours_url)
            specs["ours"] = f"running server at {urls['ours']}"
        else:
            s = ours_spec(model, a.ours_arg)
            specs["ours"] = shlex.join(s.argv)
            urls["ours"] = stack.enter_context(
                running(s, log_dir / f"{stamp}-ours.log", a.startup_timeout)
            )
        if a.peer_url:
            urls["peer"] = check_loopback_url(a.peer_url)
            specs["peer"] = f"running server at {urls['peer']}"
        else:
            s = peer_spec(a, model)
            specs["peer"], peer_notes = shlex.join(s.argv), f"({s.notes})"
            if not s.sends_usage:
                no_usage.add("peer")
            urls["peer"] = stack.enter_context(
                running(s, log_dir / f"{stamp}-peer.log", a.startup_timeout)
            )
        info = asyncio.run(_server_infos(urls))
        cells = asyncio.run(_drive(a, urls, no_usage))
    common = common_record(a, argv)
    header = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": common["command_line"],
        "git": common["git"],
        "machine": common["machine"],
        "model_path": str(model),
        "ours": specs["ours"],
        "peer": specs["peer"],
        "peer_notes": peer_notes,
        "repeats": a.repeats,
        "num_requests": a.num_requests,
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
    }
    slos = bench_slos(a)
    md = render_markdown(cells, slos, header)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(md)
    print(md)
    print(f"wrote {a.output}")
    record = {
        **common,
        "header": header,
        "servers": info,
        "cells": [
            {
                "workload": w,
                "concurrency": c,
                **{
                    side: {
                        "metrics": r.metrics(slos).to_json(),
                        "requests": [x.to_json() for x in r.results],
                    }
                    for side, r in sides.items()
                },
            }
            for (w, c), sides in cells.items()
        ],
    }
    print(f"wrote {write_json(a.result_dir / f'{stamp}-compare.json', record)}")
    ok = all(s.metrics(slos).completed > 0 for sides in cells.values() for s in sides.values())
    return 0 if ok else 1


def bench_slos(a: argparse.Namespace) -> dict[str, float]:
    return parse_goodput(a.goodput)


async def _server_infos(urls: dict[str, str]) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as c:
        return {side: await server_info(c, url) for side, url in urls.items()}
