"""Engine step cost on the CPU at several batch sizes: plain torch linears vs oneDNN-packed.

Runs both variants in one process, alternating per batch size, and reports
wall and process-CPU milliseconds per decode step (CPU time is steadier than
wall time on a shared machine). Usage::

    python -m loadtest.cpu_step_bench --batches 1,16,32 --steps 8
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


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
        for r in eng.scheduler.running + eng.scheduler.waiting
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
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    eng = LLMEngine(
        EngineConfig(
            kv_cache_memory=256 << 20,
            max_num_seqs=64,
            enable_prefix_caching=False,
            cpu_linear="torch",
        )
    )
    plain: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    packed: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    plain_model: Any = eng.model
    packed_model: Any = copy.deepcopy(plain_model)
    packed_model.pack_for_cpu()
    for _ in range(args.rounds):
        for b in batches:
            eng.runner.model = plain_model
            plain[b].append(decode_cost(eng, b, args.steps, args.prompt_len))
            eng.runner.model = packed_model
            packed[b].append(decode_cost(eng, b, args.steps, args.prompt_len))
    rows = []
    print(f"threads={torch.get_num_threads()}")
    print(
        "| batch | plain wall ms | plain cpu ms | packed wall ms | packed cpu ms | cpu ratio plain/packed |"
    )
    print("|---|---|---|---|---|---|")
    for b in batches:
        pw = min(x[0] for x in plain[b])
        pc = min(x[1] for x in plain[b])
        kw = min(x[0] for x in packed[b])
        kc = min(x[1] for x in packed[b])
        rows.append(
            {
                "batch": b,
                "plain_wall_ms": pw,
                "plain_cpu_ms": pc,
                "packed_wall_ms": kw,
                "packed_cpu_ms": kc,
            }
        )
        print(f"| {b} | {pw:.1f} | {pc:.1f} | {kw:.1f} | {kc:.1f} | {pc / kc:.2f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
