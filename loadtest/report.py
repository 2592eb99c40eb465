"""Run records: machine and git facts, server info, JSON files and plots."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.metrics import BenchmarkMetrics, RequestResult

REPO_ROOT = Path(__file__).resolve().parent.parent


def machine_info() -> dict[str, Any]:
    """CPU model, logical cores, total memory and OS, read from /proc where present."""
    cpu = platform.processor() or platform.machine()
    mem_gib: float | None = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass  # not Linux: keep what platform knows
    affinity = getattr(os, "sched_getaffinity", None)
    return {
        "cpu_model": cpu,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(affinity(0)) if affinity else os.cpu_count(),
        "memory_gib": mem_gib,
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def git_info(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit and whether the tree has uncommitted changes (read-only git calls)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=20, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


async def server_info(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """The server's ``/version`` and ``/v1/models`` JSON, or the error that each gave."""
    info: dict[str, Any] = {}
    for key, path in (("version", "/version"), ("models", "/v1/models")):
        try:
            r = await client.get(base_url + path, timeout=10.0)
            info[key] = r.json() if r.status_code == 200 else {"status_code": r.status_code}
        except (httpx.HTTPError, ValueError) as e:
            info[key] = {"error": f"{type(e).__name__}: {e}"}
    return info


def _clean(x: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


def _arg_json(value: Any) -> Any:
    """A parsed argument as JSON: paths (alone or in a list) as strings."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_arg_json(v) for v in value]
    return value


def bench_record(
    benchmark: str, args: argparse.Namespace, exclude: set[str], **fields: Any
) -> dict[str, Any]:
    """The JSON record of a one-off benchmark script: its name, arguments (minus
    ``exclude``), ``fields``, git state, machine and time."""
    return {
        "benchmark": benchmark,
        "args": {k: _arg_json(v) for k, v in vars(args).items() if k not in exclude},
        **fields,
        "git": git_info(),
        "machine": machine_info(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as indented JSON (NaN as null), creating parent directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_clean(record), indent=2, allow_nan=False) + "\n")
    return path


@dataclass
class PlotRun:
    """One run as the plots need it."""

    label: str
    concurrency: int | None
    metrics: BenchmarkMetrics
    results: list[RequestResult]


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    xs = sorted(values_ms)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def plot_runs(runs: Sequence[PlotRun], path: Path) -> Path:
    """Latency CDFs (TTFT, ITL, E2E) of every run; for a sweep (several runs with a
    concurrency) a second row plots throughput and latency against concurrency."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    sweep = [r for r in runs if r.concurrency is not None]
    sweep.sort(key=lambda r: r.concurrency or 0)
    is_sweep = len(sweep) > 1
    nrows = 2 if is_sweep else 1
    fig, axes = plt.subplots(nrows, 3, figsize=(15, 4.5 * nrows), squeeze=False)
    for ax, name in zip(axes[0], ("TTFT", "ITL", "E2E latency")):
        for run in runs:
            ok = [r for r in run.results if r.success]
            if name == "TTFT":
                vals = [r.ttft_s * 1e3 for r in ok]
            elif name == "ITL":
                vals = [g * 1e3 for r in ok for g in r.itl_s]
            else:
                vals = [r.latency_s * 1e3 for r in ok]
            _cdf(ax, vals, run.label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing to label when every request failed
            ax.legend(fontsize="small")
    if is_sweep:
        conc = [r.concurrency for r in sweep]
        ax = axes[1][0]
        ax.plot(conc, [r.metrics.output_throughput for r in sweep], "o-", label="output tok/s")
        ax.plot(conc, [r.metrics.total_token_throughput for r in sweep], "s-", label="total tok/s")
        ax.set_title("throughput vs concurrency")
        ax.set_ylabel("tokens/s")
        ax = axes[1][1]
        ax.plot(conc, [r.metrics.ttft.median_ms for r in sweep], "o-", label="TTFT p50")
        ax.plot(
            conc, [r.metrics.ttft.percentiles_ms.get("p99") for r in sweep], "s--", label="TTFT p99"
        )
        ax.set_title("TTFT vs concurrency")
        ax.set_ylabel("ms")
        ax = axes[1][2]
        ax.plot(conc, [r.metrics.tpot.median_ms for r in sweep], "o-", label="TPOT p50")
        ax.plot(
            conc, [r.metrics.itl.percentiles_ms.get("p99") for r in sweep], "s--", label="ITL p99"
        )
        ax.set_title("per-token latency vs concurrency")
        ax.set_ylabel("ms")
        for ax in axes[1]:
            ax.set_xlabel("concurrency")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
