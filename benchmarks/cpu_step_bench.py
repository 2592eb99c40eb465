"""Engine decode-step cost on the CPU at several batch sizes, configuration against configuration.

Each configuration (``--cpu-linear`` choice, optionally ``:kv-cache-dtype``)
is its own engine in this process; they run alternately per batch size, so
drift hits all of them. Reports wall and process-CPU milliseconds per decode
step, best of ``--rounds``. Usage::

    python -m benchmarks.cpu_step_bench --batches 1,16,32 --steps 8
    python -m benchmarks.cpu_step_bench --configs int8,q4_1,q4_1:float16 --batches 1 --prompt-len 1100
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams


def decode_cost(eng: LLMEngine, batch: int, steps: int, prompt_len: int) -> tuple[float, float]:
    """(wall ms, cpu ms) per decode step with ``batch`` running sequences."""
    for i in range(batch):
        eng.add_request(
            f"b{batch}-{i}-{time.monotonic_ns()}",
            [100 + (i * 7 + j) % 1000 for j in range(prompt_len)],
            SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True),
        )
    while any(
        r.num_computed_tokens < r.num_prompt_tokens
        for r in [*eng.scheduler.running, *eng.scheduler.waiting]
    ):
        eng.step()
    eng.step()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        eng.step()
    wall = (time.perf_counter() - w0) / steps * 1000
    cpu = (time.process_time() - c0) / steps * 1000
    for gid in list(eng.groups):
        eng.abort(gid)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--configs",
        default="torch,onednn",
        help="engines to compare: CPU_LINEAR[:KV_CACHE_DTYPE],... (first is the baseline)",
    )
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    engines: dict[str, LLMEngine] = {}
    for spec in args.configs.split(","):
        linear, _, kv = spec.partition(":")
        engines[spec] = LLMEngine(
            EngineConfig(
                kv_cache_memory=args.kv_cache_memory,
                max_num_seqs=64,
                enable_prefix_caching=False,
                cpu_linear=linear,
                kv_cache_dtype=kv or "auto",
            )
        )
    costs: dict[tuple[int, str], list[tuple[float, float]]] = {
        (b, c): [] for b in batches for c in engines
    }
    for _ in range(args.rounds):
        for b in batches:
            for spec, eng in engines.items():  # alternating: drift hits every config
                costs[(b, spec)].append(decode_cost(eng, b, args.steps, args.prompt_len))
    names = list(engines)
    print(f"threads={torch.get_num_threads()} prompt_len={args.prompt_len}")
    print("| batch | " + " | ".join(f"{n} wall ms | {n} cpu ms" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    rows = []
    for b in batches:
        row: dict[str, Any] = {"batch": b}
        cells = []
        for n in names:
            wall = min(x[0] for x in costs[(b, n)])
            cpu = min(x[1] for x in costs[(b, n)])
            row[f"{n}_wall_ms"], row[f"{n}_cpu_ms"] = wall, cpu
            cells.append(f"{wall:.1f} | {cpu:.1f}")
        rows.append(row)
        print(f"| {b} | " + " | ".join(cells) + " |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
