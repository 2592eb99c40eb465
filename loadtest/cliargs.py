"""Command-line flags shared by ``loadtest run`` and ``loadtest compare``."""

from __future__ import annotations

import argparse
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.bench import BenchOptions
from loadtest.metrics import parse_goodput
from loadtest.report import git_info, machine_info
from loadtest.workloads import WorkloadOptions


def parse_int_list(text: str) -> list[int]:
    """``"1,16,32"`` -> ``[1, 16, 32]``; each must be a positive integer."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad --percentiles {text!r}") from e
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {text!r}")
    return ps


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``run`` and ``compare`` that shape requests and load."""
    g = p.add_argument_group("requests")
    g.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    g.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=128, help="per request (random: --output-len)")
    g.add_argument("--ignore-eos", action="store_true", help="always on for --workload random")
    g.add_argument("--input-len", type=int, default=1024, help="random / long-prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="random workload output tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="random lengths spread, [0,1)")
    g.add_argument("--num-turns", type=int, default=3, help="multi-turn conversation length")
    g.add_argument("--tokenizer", default=None, help="tokenizer dir or .gguf (default model's)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("load")
    g.add_argument("--num-requests", type=int, default=64, help="measured requests per run")
    g.add_argument("--num-warmup", type=int, default=0, help="unmeasured requests first")
    g.add_argument("--max-duration", type=float, default=300.0, help="seconds per run (hard cap)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs, e.g. ttft:500 tpot:50 e2el:5000",
    )
    g.add_argument(
        "--percentiles",
        type=parse_percentiles,
        default=(50.0, 90.0, 99.0),
        help="comma-separated, default 50,90,99",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--count-chunks-without-usage",
        action="store_true",
        help="accept streams without usage, counting content chunks as tokens "
        "(for servers that ignore stream_options, e.g. llama-cpp-python)",
    )


def workload_options(a: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(
        input_len=a.input_len,
        output_len=a.output_len,
        range_ratio=a.range_ratio,
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        ignore_eos=a.ignore_eos,
        num_turns=a.num_turns,
        seed=a.seed,
    )


def bench_options(a: argparse.Namespace, base_url: str, workload: str) -> BenchOptions:
    """BenchOptions from parsed flags; raises ValueError on inconsistent flags."""
    if a.max_duration <= 0 or not math.isfinite(a.max_duration):
        raise ValueError("--max-duration must be a positive, finite number of seconds")
    return BenchOptions(
        base_url=base_url,
        endpoint=a.endpoint,
        model=a.model,
        api_key=a.api_key,
        workload=workload,
        workload_opts=workload_options(a),
        tokenizer=a.tokenizer,
        num_requests=a.num_requests,
        num_warmup=a.num_warmup,
        max_duration_s=a.max_duration,
        concurrency=getattr(a, "concurrency", None),
        request_rate=getattr(a, "request_rate", None),
        burstiness=getattr(a, "burstiness", 1.0),
        seed=a.seed,
        slos=parse_goodput(a.goodput),
        percentiles=a.percentiles,
        request_timeout_s=a.request_timeout,
        show_progress=not a.no_progress,
        count_chunks_without_usage=a.count_chunks_without_usage,
    )


def common_record(a: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Facts shared by every run of one invocation."""
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    return {
        "command_line": shlex.join(["fuel-loadtest", *argv]),
        "flags": flags,
        "git": git_info(),
        "machine": machine_info(),
    }
