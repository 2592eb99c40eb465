"""One-shot GPU check: kernel tests, kernel microbenchmarks, offline engine benchmarks.

Run on a CUDA machine (``loadtest/gpu_check.sh``; about 8 minutes on one H200):

1. ``pytest tests/test_kernels.py`` with compiled kernels (``TRITON_INTERPRET=0``);
2. paged decode attention: achieved GB/s (KV read + q + out) against the HBM
   peak, the Triton kernel vs the torch backend, split-K on vs off;
3. offline throughput on the default model in bf16 with nano-vllm's recipe
   (256 sequences, input and output lengths uniform in 100..1024, random token
   ids, ignore_eos, seed 0), with CUDA graphs;
4. decode speed at batch 1, 32 and 256, eager and with CUDA graphs.

Every section is guarded: a failure is written into the report and the next
section runs. The report is a markdown file (``$OUT/gpu.md``, else
``docs/benchmarks/gpu.md``, or ``--out``) plus the same data as JSON beside it.

``--dry-run`` runs everything on CPU at tiny sizes (kernels under the Triton
interpreter, ``pytest --collect-only``) to test the plumbing without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# H200 HBM3e peak bandwidth, the roofline for memory-bound decode attention.
HBM_PEAK_GBPS = 4800.0
SECTIONS = ("pytest", "attention", "throughput", "decode")


@dataclass
class Section:
    """One block of the report: a table, notes, and the error if it failed."""

    title: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Sizes:
    """Problem sizes of the benchmarks (full on GPU, tiny for ``--dry-run``)."""

    attn_cases: list[tuple[str, int, int, int, int, int]]  # name, batch, ctx, Hq, Hkv, D
    tp_num_seqs: int
    tp_len_range: tuple[int, int]
    decode_batches: list[int]
    decode_prompt_len: int
    decode_out_len: int


def full_sizes(args: argparse.Namespace) -> Sizes:
    return Sizes(
        attn_cases=[
            ("smollm2 9/3x64", 256, 1024, 9, 3, 64),
            ("gqa 32/8x128", 64, 2048, 32, 8, 128),
            ("few long 32/8x128", 4, 32768, 32, 8, 128),
        ],
        tp_num_seqs=args.num_seqs,
        tp_len_range=(100, 1024),
        decode_batches=[1, 32, 256],
        decode_prompt_len=128,
        decode_out_len=256,
    )


def dry_sizes(args: argparse.Namespace) -> Sizes:
    return Sizes(
        attn_cases=[("tiny 4/2x32", 2, 40, 4, 2, 32)],
        tp_num_seqs=min(args.num_seqs, 2),
        tp_len_range=(4, 8),
        decode_batches=[1, 2],
        decode_prompt_len=4,
        decode_out_len=3,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, no real benchmark")
    p.add_argument("--out", type=Path, default=None, help="markdown report path")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    p.add_argument("--num-seqs", type=int, default=256, help="throughput benchmark sequences")
    p.add_argument("--budget-s", type=float, default=450.0, help="skip sections after this")
    p.add_argument("--pytest-timeout-s", type=float, default=200.0)
    p.add_argument("--throughput-eager", action="store_true", help="also time throughput eager")
    args = p.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    args.sections = chosen
    return args


def default_out_path() -> Path:
    """``$OUT/gpu-check.md`` when the device harness provides ``$OUT``, else the docs
    folder (docs/benchmarks/gpu.md is the status page that links these results)."""
    out_dir = os.environ.get("OUT")
    if out_dir:
        return Path(out_dir) / "gpu-check.md"
    return REPO_ROOT / "docs" / "benchmarks" / "gpu-check.md"


# ------------------------------------------------------------------ timing


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Mean milliseconds per call (CUDA events on GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return float(start.elapsed_time(end)) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


# ------------------------------------------------------------------ sections


def section_pytest(args: argparse.Namespace, device: torch.device, sizes: Sizes) -> Section:
    sec = Section("Kernel tests (pytest tests/test_kernels.py)", ["result", "summary"])
    cmd = [sys.executable, "-m", "pytest", "tests/test_kernels.py", "-q", "-p", "no:cacheprovider"]
    env = dict(os.environ)
    if args.dry_run:
        cmd.append("--collect-only")
        env["TRITON_INTERPRET"] = "1"
    else:
        env["TRITON_INTERPRET"] = "0"
    proc = subprocess.run(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=args.pytest_timeout_s,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-200:]
    sec.rows.append(["pass" if proc.returncode == 0 else f"FAIL (rc {proc.returncode})", summary])
    if proc.returncode != 0:
        failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
        sec.notes.extend(failed[:20])
    sec.notes.append(f"command: {' '.join(cmd[1:])} (TRITON_INTERPRET={env['TRITON_INTERPRET']})")
    return sec


def _decode_batch(
    batch: int, ctx: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """A decode-only batch: every sequence has ``ctx`` cached tokens and one new token."""
    block_size = 16
    nblk = (ctx + block_size - 1) // block_size
    g = torch.Generator(device=device).manual_seed(0)
    shape = (batch * nblk, block_size, hkv, d)
    return {
        "q": torch.randn(batch, hq, d, generator=g, device=device).to(dtype),
        "k_cache": torch.randn(shape, generator=g, device=device).to(dtype),
        "v_cache": torch.randn(shape, generator=g, device=device).to(dtype),
        "block_tables": torch.arange(batch * nblk, dtype=torch.int32, device=device).view(
            batch, nblk
        ),
        "seq_lens": torch.full((batch,), ctx, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
    }


def _bench_decode_case(
    batch: int,
    ctx: int,
    hq: int,
    hkv: int,
    d: int,
    device: torch.device,
    iters: int,
    warmup: int,
) -> list[str]:
    """Time one bf16 decode batch: Triton (auto splits, one split) and the torch backend."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_backend import TorchAttentionBackend
    from kernels.paged_attention import choose_num_kv_splits, paged_attention

    dtype = torch.bfloat16
    t = _decode_batch(batch, ctx, hq, hkv, d, dtype, device)
    out = torch.empty_like(t["q"])
    scale = d**-0.5
    pos = (
        t["q"],
        t["k_cache"],
        t["v_cache"],
        t["block_tables"],
        t["seq_lens"],
        t["query_start_loc"],
        1,
        ctx,
        scale,
        batch,
    )
    splits = choose_num_kv_splits(ctx, batch, hkv, device)
    ms = time_ms(lambda: paged_attention(*pos, out=out), device, iters, warmup)
    ms_1 = time_ms(
        lambda: paged_attention(*pos, out=out, kv_split_size=1 << 30), device, iters, warmup
    )
    elem = t["q"].element_size()
    nbytes = batch * ctx * hkv * d * elem * 2 + 2 * t["q"].numel() * elem
    gbps = nbytes / (ms * 1e-3) / 1e9
    meta = AttentionMetadata(
        query_start_loc=t["query_start_loc"],
        seq_lens=t["seq_lens"],
        block_tables=t["block_tables"],
        # -1: the benchmark's new k/v are not stored, only attended.
        slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=ctx,
        num_decodes=batch,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[ctx] * batch,
        query_start_loc_cpu=list(range(batch + 1)),
    )
    kv_new = torch.zeros(batch, hkv, d, dtype=dtype, device=device)
    backend = TorchAttentionBackend()
    ms_torch = time_ms(
        lambda: backend.forward(t["q"], kv_new, kv_new, t["k_cache"], t["v_cache"], meta, scale),
        device,
        max(1, iters // 4),
        1,
    )
    return [
        f"{batch} x {ctx}",
        str(splits),
        f"{ms:.3f}",
        f"{gbps:.0f}",
        f"{100 * gbps / HBM_PEAK_GBPS:.1f}%",
        f"{ms_1:.3f}",
        f"{ms_torch:.3f}",
        f"{ms_torch / ms:.2f}x",
    ]


def section_attention(args: argparse.Namespace, device: torch.device, sizes: Sizes) -> Section:
    sec = Section(
        "Paged decode attention",
        [
            "case",
            "batch x ctx",
            "splits",
            "triton ms",
            "GB/s",
            "% of HBM peak",
            "1-split ms",
            "torch backend ms",
            "speedup vs torch",
        ],
    )
    iters, warmup = (2, 1) if args.dry_run else (20, 5)
    for name, batch, ctx, hq, hkv, d in sizes.attn_cases:
        sec.rows.append([name, *_bench_decode_case(batch, ctx, hq, hkv, d, device, iters, warmup)])
    sec.notes.append(
        f"bf16, block_size 16; bytes = KV read + q + out; peak {HBM_PEAK_GBPS:.0f} GB/s (H200). "
        "'1-split ms' forces split-K off; the torch backend time includes its k/v gather."
    )
    return sec


def _make_llm(device: torch.device, eager: bool, dry_run: bool) -> Any:
    from engine.config import EngineConfig
    from engine.llm import LLM

    cfg = EngineConfig(
        dtype="float32" if dry_run else "bfloat16",
        device="cuda" if device.type == "cuda" else "cpu",
        enforce_eager=eager,
        max_num_seqs=256,
        max_num_batched_tokens=16384,
        seed=0,
    )
    if dry_run:
        cfg.kv_cache_memory = 64 << 20
        cfg.max_num_batched_tokens = 256
        cfg.max_model_len = 256
    return LLM(cfg)


def _free_memory() -> None:
    """Return a dropped engine's memory (the caller must have deleted its reference)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def section_throughput(args: argparse.Namespace, device: torch.device, sizes: Sizes) -> Section:
    from engine.sampling.params import SamplingParams

    sec = Section(
        "Offline throughput (nano-vllm recipe)",
        ["mode", "seqs", "prompt tok", "output tok", "seconds", "output tok/s", "total tok/s"],
    )
    lo, hi = sizes.tp_len_range
    rng = random.Random(0)
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))]
        for _ in range(sizes.tp_num_seqs)
    ]
    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi))
        for _ in range(sizes.tp_num_seqs)
    ]
    # CUDA graphs first; eager too on request. Off CUDA there is only eager.
    if device.type != "cuda":
        modes = [True]
    else:
        modes = [False, True] if args.throughput_eager else [False]
    for eager in modes:
        llm = _make_llm(device, eager, args.dry_run)
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            _sync(device)
            t0 = time.perf_counter()
            results = llm.generate(prompts, params)
            _sync(device)
            secs = time.perf_counter() - t0
        finally:
            # Drop the engine before the next one is built: two do not fit.
            del llm
            _free_memory()
        out_tok = sum(len(r.token_ids) for r in results)
        want = sum(p.max_tokens or 0 for p in params)
        if out_tok != want:
            sec.notes.append(f"expected {want} output tokens (ignore_eos), got {out_tok}")
        in_tok = sum(len(p) for p in prompts)
        sec.rows.append(
            [
                "eager" if eager else "cuda graphs",
                str(len(prompts)),
                str(in_tok),
                str(out_tok),
                f"{secs:.2f}",
                f"{out_tok / secs:.0f}",
                f"{(in_tok + out_tok) / secs:.0f}",
            ]
        )
    sec.notes.append(
        f"random token ids < 10000, input/output lengths uniform in {lo}..{hi}, seed 0, "
        "temperature 0.6, ignore_eos"
        + ("" if args.dry_run else "; max_num_seqs 256, max_num_batched_tokens 16384")
    )
    return sec


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section_decode(args: argparse.Namespace, device: torch.device, sizes: Sizes) -> Section:
    from engine.sampling.params import SamplingParams

    sec = Section(
        "Decode speed",
        ["mode", "batch", "prompt len", "new tokens", "seconds", "output tok/s", "ms / step"],
    )
    rng = random.Random(1)
    modes = [True, False] if device.type == "cuda" else [True]
    for eager in modes:
        llm = _make_llm(device, eager, args.dry_run)
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            for batch in sizes.decode_batches:
                prompts = [
                    [rng.randint(0, 10000) for _ in range(sizes.decode_prompt_len)]
                    for _ in range(batch)
                ]
                sp = SamplingParams(
                    temperature=0.0, ignore_eos=True, max_tokens=sizes.decode_out_len
                )
                _sync(device)
                t0 = time.perf_counter()
                results = llm.generate(prompts, sp)
                _sync(device)
                secs = time.perf_counter() - t0
                out_tok = sum(len(r.token_ids) for r in results)
                sec.rows.append(
                    [
                        "eager" if eager else "cuda graphs",
                        str(batch),
                        str(sizes.decode_prompt_len),
                        str(sizes.decode_out_len),
                        f"{secs:.2f}",
                        f"{out_tok / secs:.0f}",
                        f"{secs * 1e3 / sizes.decode_out_len:.2f}",
                    ]
                )
        finally:
            # Drop the engine before the next one is built: two do not fit.
            del llm
            _free_memory()
    sec.notes.append("greedy, ignore_eos; time includes the (short) prefill step")
    return sec


SECTION_FUNCS: dict[str, Callable[[argparse.Namespace, torch.device, Sizes], Section]] = {
    "pytest": section_pytest,
    "attention": section_attention,
    "throughput": section_throughput,
    "decode": section_decode,
}


# ------------------------------------------------------------------ report


def environment(device: torch.device) -> dict[str, str]:
    """Date, git commit, library versions and device name for the report header."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = "not installed"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU dry run)"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "torch": torch.__version__,
        "triton": triton_version,
        "gpu": gpu,
    }


def render_markdown(env: dict[str, str], sections: list[Section], dry_run: bool) -> str:
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["# Fuel Serve GPU check" + (" (DRY RUN, CPU, tiny sizes)" if dry_run else ""), ""]
    lines += ["| key | value |", "|---|---|"]
    lines += [f"| {k} | {cell(v)} |" for k, v in env.items()]
    for sec in sections:
        lines += ["", f"## {sec.title}", ""]
        if sec.error is not None:
            lines += [f"**FAILED** after {sec.seconds:.1f}s: `{cell(sec.error)}`", ""]
        if sec.rows:
            lines.append("| " + " | ".join(cell(h) for h in sec.headers) + " |")
            lines.append("|" + "---|" * len(sec.headers))
            lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in sec.rows]
            lines.append("")
        lines += [f"- {n}" for n in sec.notes]
        if sec.error is None:
            lines.append(f"- section time {sec.seconds:.1f}s")
    return "\n".join(lines) + "\n"


def write_report(
    out_path: Path, env: dict[str, str], sections: list[Section], dry_run: bool
) -> None:
    """Write the markdown report and the same data as JSON beside it."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(render_markdown(env, sections, dry_run))
    out_path.with_suffix(".json").write_text(
        json.dumps({"env": env, "sections": [asdict(s) for s in sections]}, indent=1)
    )


def run_section(name: str, args: argparse.Namespace, device: torch.device, sizes: Sizes) -> Section:
    """Run one section; any exception becomes the section's error, never propagates."""
    t0 = time.perf_counter()
    try:
        sec = SECTION_FUNCS[name](args, device, sizes)
    except Exception as exc:
        sec = Section(name, error=f"{type(exc).__name__}: {exc}")
        tb = traceback.format_exc().strip().splitlines()
        sec.notes.extend(tb[-6:])
        print(f"[gpu_check] section {name} failed:\n" + "\n".join(tb), file=sys.stderr)
    sec.seconds = time.perf_counter() - t0
    return sec


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen sections, write the report; exit 1 if any section failed."""
    args = parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        # Kernels on CPU need the interpreter, chosen when the kernel modules are
        # first imported (they are imported lazily, inside the sections).
        os.environ.setdefault("TRITON_INTERPRET", "1")
        sizes = dry_sizes(args)
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        sizes = full_sizes(args)
    out_path: Path = args.out or default_out_path()
    start = time.perf_counter()
    env = environment(device)
    sections: list[Section] = []
    for name in args.sections:
        if time.perf_counter() - start > args.budget_s:
            sections.append(Section(name, error=f"skipped: time budget {args.budget_s:.0f}s spent"))
        else:
            print(f"[gpu_check] {name} ...", file=sys.stderr, flush=True)
            sections.append(run_section(name, args, device, sizes))
        # Rewrite the report after every section: if an outer timeout kills the
        # run, the sections already done are still on disk.
        write_report(out_path, env, sections, args.dry_run)
    print(f"[gpu_check] wrote {out_path}", file=sys.stderr)
    return 1 if any(s.error for s in sections) else 0


if __name__ == "__main__":
    raise SystemExit(main())
