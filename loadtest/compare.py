"""``loadtest compare``: Fuel Serve against llama.cpp's server, side by side, in one command.

Ours and one peer per ``--peer-model`` (by default the same Q4_1 GGUF and, when
``loadtest/build_peer.sh`` has made it, its F16 conversion: llama.cpp's best
configuration differs by figure) are started on loopback (or given with
``--ours-url`` / ``--peer-url`` when already running). Every (workload,
concurrency) cell runs each side in turn, ``--repeats`` times (A, B, C, A, B,
C, ...), so slow drift of the machine (other jobs, thermal state) hits every
side alike. The ``prefill`` cell sends cold ~``--prefill-len``-token prompts
(new ones each repeat, so no prefix cache helps) for one output token.
While each run lasts, the servers' resident set sizes are sampled. The
report (loadtest/compare_report.py) gives each side's pooled figures with
the per-repeat range, ours / best-peer ratios, and issue 23's targets met or
not; it goes to ``docs/benchmarks/cpu-compare.md`` by default (docs/benchmarks/cpu.md
links it and says what it means).

The peer is, in order of preference: ``--peer-bin`` or a ``llama-server`` on
PATH (continuous batching over ``--parallel`` slots), else
``python -m llama_cpp.server`` from ``--peer-venv`` (llama-cpp-python's server,
which runs one request at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import Bench, make_client, resolve_model
from loadtest.cliargs import add_workload_args, bench_options, common_record
from loadtest.compare_report import PREFILL, RepeatResult, SideResult, render_markdown
from loadtest.guard import check_loopback_url
from loadtest.metrics import parse_goodput
from loadtest.report import server_info, write_json
from loadtest.rss import RssSampler
from loadtest.workloads import WORKLOADS, WorkloadOptions, default_gguf

DEFAULT_GRID = "questions:1,16,32;shared-prefix:1,16;prefill:1"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "cpu-compare.md"
DEFAULT_PEER_VENV = Path("/work/peer-venv")
# Where loadtest/build_peer.sh puts the F16 conversion of the default GGUF.
DEFAULT_F16 = Path("/work/peer/SmolLM2-135M-Instruct.F16.gguf")
PREFILL_SEED_STRIDE = 7919  # each repeat's cold prompts differ from the last


def parse_grid(text: str) -> list[tuple[str, int]]:
    """``"questions:1,16;shared-prefix:1"`` -> ``[("questions", 1), ("questions", 16), ...]``."""
    cells: list[tuple[str, int]] = []
    for part in text.split(";"):
        if not part.strip():
            continue
        name, sep, levels = part.partition(":")
        name = name.strip()
        if not sep or name not in (*WORKLOADS, PREFILL):
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
    p.add_argument("--repeats", type=int, default=3, help="alternations of all sides per cell")
    p.add_argument(
        "--peer-model",
        type=Path,
        action="append",
        default=None,
        help="a GGUF for one peer server (repeatable; default: the model, plus its F16 "
        f"conversion {DEFAULT_F16} when it exists)",
    )
    p.add_argument("--prefill-len", type=int, default=1600, help="prefill cell prompt tokens")
    p.add_argument("--prefill-requests", type=int, default=3, help="prefill cell prompts/repeat")
    p.add_argument("--ours-url", default=None, help="use a running Fuel Serve instead")
    p.add_argument("--peer-url", action="append", default=None, help="use running peer(s) instead")
    p.add_argument(
        "--ours-arg",
        action="append",
        default=[],
        help="extra argument for `python -m server.cli` (repeatable)",
    )
    p.add_argument(
        "--peer-arg",
        action="append",
        default=[],
        help="extra argument for llama-server (repeatable; e.g. --peer-arg=--no-repack "
        "where its repacked Q4 weights crash, as on this project's AMX Xeon hosts)",
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
    side: str = "ours"  # the report's column: ours, peer or peer:LABEL

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


def peer_label(model: Path) -> str:
    """``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``Q4_1``: the variant, for column names."""
    return model.stem.rsplit(".", 1)[-1] if "." in model.stem else model.stem


def peer_spec(a: argparse.Namespace, model: Path, side: str = "peer") -> ServerSpec:
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
            *a.peer_arg,
        ]
        notes = f"llama-server, {a.parallel} slots, continuous batching, {a.threads} threads"
        return ServerSpec("llama-server", argv, port, "/health", notes, side=side)
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
        return ServerSpec(
            "llama_cpp.server", argv, port, "/v1/models", notes, sends_usage=False, side=side
        )
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
    with running_process(spec, log_path, timeout_s) as (url, _pid):
        yield url


@contextlib.contextmanager
def running_process(
    spec: ServerSpec, log_path: Path, timeout_s: float
) -> Iterator[tuple[str, int]]:
    """As :func:`running`, yielding (URL, pid)."""
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
            yield spec.url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _cell_bench(a: argparse.Namespace, url: str, workload: str, rep: int) -> Bench:
    """The Bench of one run; the prefill cell gets fresh cold prompts every repeat."""
    opts = bench_options(a, url, "long-prompt" if workload == PREFILL else workload)
    if workload == PREFILL:
        w: WorkloadOptions = opts.workload_opts
        opts.workload_opts = replace(
            w, input_len=a.prefill_len, max_tokens=1, seed=a.seed + PREFILL_SEED_STRIDE * (rep + 1)
        )
        opts.num_requests, opts.num_warmup = a.prefill_requests, 0
    return Bench(opts)


async def _drive(
    a: argparse.Namespace,
    urls: dict[str, str],
    no_usage: set[str],
    rss: RssSampler | None,
) -> dict[tuple[str, int], dict[str, SideResult]]:
    """Run every cell, each side in turn per repeat; ``no_usage`` names sides
    whose streams carry no usage."""
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
                for side, url in urls.items():  # dict order: ours, then the peers
                    key = f"{side}:{workload}" + (f":{rep}" if workload == PREFILL else "")
                    if key not in benches:
                        benches[key] = _cell_bench(a, url, workload, rep)
                        benches[key].opts.count_chunks_without_usage |= side in no_usage
                    if rss is not None:
                        rss.mark()
                    label = f"{side} {workload} c={conc} #{rep + 1}"
                    out = await benches[key].run_level(clients[side], models[side], conc, label)
                    peak = rss.mark().get(side) if rss is not None else None
                    m = out.metrics
                    print(
                        f"{label}: {m.output_throughput:.1f} out tok/s, "
                        f"TTFT p50 {m.ttft.median_ms:.0f} ms, failed {m.failed}"
                    )
                    load = out.load
                    cell[side].repeats.append(
                        RepeatResult(load.results, load.duration_s, load.cancelled, peak)
                    )
    return cells


def _peer_models(a: argparse.Namespace, model: Path) -> list[Path]:
    if a.peer_model:
        return list(a.peer_model)
    return [model] + ([DEFAULT_F16] if a.model_path is None and DEFAULT_F16.exists() else [])


def _start_servers(
    a: argparse.Namespace, model: Path, stack: contextlib.ExitStack, log_dir: Path, stamp: str
) -> tuple[dict[str, str], dict[str, str], dict[str, int], set[str]]:
    """(side -> URL, side -> command or note, side -> pid of the servers started
    here, sides whose streams carry no usage); ours first."""
    urls: dict[str, str] = {}
    cmds: dict[str, str] = {}
    pids: dict[str, int] = {}
    no_usage: set[str] = set()
    specs: list[ServerSpec] = []
    if a.ours_url:
        urls["ours"] = check_loopback_url(a.ours_url)
        cmds["ours"] = f"running server at {urls['ours']}"
    else:
        specs.append(ours_spec(model, a.ours_arg))
    if a.peer_url:
        for i, u in enumerate(a.peer_url):
            side = "peer" if len(a.peer_url) == 1 else f"peer:{i + 1}"
            urls[side] = check_loopback_url(u)
            cmds[side] = f"running server at {urls[side]}"
    else:
        peers = _peer_models(a, model)
        for pm in peers:
            specs.append(peer_spec(a, pm, "peer" if len(peers) == 1 else f"peer:{peer_label(pm)}"))
    for spec in specs:
        cmds[spec.side] = shlex.join(spec.argv) + (f" ({spec.notes})" if spec.notes else "")
        if not spec.sends_usage:
            no_usage.add(spec.side)
        log = log_dir / f"{stamp}-{spec.side.replace(':', '-')}.log"
        urls[spec.side], pids[spec.side] = stack.enter_context(
            running_process(spec, log, a.startup_timeout)
        )
    ordered = {s: urls[s] for s in ["ours", *[s for s in urls if s != "ours"]]}
    return ordered, cmds, pids, no_usage


def run_compare(a: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the comparison; returns the exit status (0 when every side completed requests)."""
    if a.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if a.endpoint != "chat" and any(w == "multi-turn" for w, _ in a.grid):
        raise ValueError("the multi-turn workload needs --endpoint chat")
    model = a.model_path or default_gguf()
    log_dir = a.log_dir or a.result_dir
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with contextlib.ExitStack() as stack:
        urls, cmds, pids, no_usage = _start_servers(a, model, stack, log_dir, stamp)
        rss = RssSampler(pids).start() if pids else None
        idle_rss = rss.now() if rss is not None else None
        info = asyncio.run(_server_infos(urls))
        try:
            cells = asyncio.run(_drive(a, urls, no_usage, rss))
        finally:
            if rss is not None:
                rss.stop()
    common = common_record(a, argv)
    header = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": common["command_line"],
        "git": common["git"],
        "machine": common["machine"],
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "model_path": str(model),
        "servers": cmds,
        "repeats": a.repeats,
        "num_requests": a.num_requests,
        "max_tokens": a.max_tokens,
        "temperature": a.temperature,
        "prefill_len": a.prefill_len,
        "prefill_requests": a.prefill_requests,
    }
    slos = bench_slos(a)
    md = render_markdown(cells, slos, header, idle_rss)
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(md)
    print(md)
    print(f"wrote {a.output}")
    record = {
        **common,
        "header": header,
        "servers": info,
        "idle_rss_bytes": idle_rss,
        "cells": [_cell_record(w, c, sides, slos) for (w, c), sides in cells.items()],
    }
    print(f"wrote {write_json(a.result_dir / f'{stamp}-compare.json', record)}")
    ok = all(s.metrics(slos).completed > 0 for sides in cells.values() for s in sides.values())
    return 0 if ok else 1


def _cell_record(
    workload: str, conc: int, sides: dict[str, SideResult], slos: dict[str, float]
) -> dict[str, Any]:
    return {
        "workload": workload,
        "concurrency": conc,
        **{
            side: {
                "metrics": r.metrics(slos).to_json(),
                "per_repeat": [m.to_json() for m in r.per_repeat(slos)],
                "rss_peak_bytes": [x.rss_peak for x in r.repeats],
                "requests": [x.to_json() for x in r.results],
            }
            for side, r in sides.items()
        },
    }


def bench_slos(a: argparse.Namespace) -> dict[str, float]:
    return parse_goodput(a.goodput)


async def _server_infos(urls: dict[str, str]) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as c:
        return {side: await server_info(c, url) for side, url in urls.items()}
