"""Decode-step cost on the CPU: torch vs native attention, torch vs native fused ops.

One engine, one process: three configurations are swapped into the same model
and measured alternately at each (batch, context) point, so machine drift hits
all of them: ``torch`` (torch attention, torch ops), ``attn`` (native decode
attention, torch ops) and ``native`` (native attention and fused native
norm/RoPE/SiLU ops, the CPU default). Reports wall ms per decode step (best of
``--rounds``). Usage::

    python -m benchmarks.attention_step_bench --points 1x100,1x1100,16x200,16x1100 --cpu-linear int8
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.cpu_step_bench import decode_cost
from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.attention.registry import get_attention_backend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.ops import ModelOps, NativeCpuModelOps, TorchModelOps


def use(eng: LLMEngine, backend: AttentionBackend, ops: ModelOps) -> None:
    for m in eng.model.modules():
        if hasattr(m, "attn_backend"):
            m.attn_backend = backend
    eng.model.set_ops(ops)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="1x100,1x1100,16x200,16x1100", help="BATCHxCONTEXT,...")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-linear", default="int8")
    args = ap.parse_args(argv)
    points: list[tuple[int, int]] = []
    for p in args.points.split(","):
        b, ctx = p.split("x")
        points.append((int(b), int(ctx)))
    eng = LLMEngine(
        EngineConfig(
            kv_cache_memory=1 << 30,
            max_num_seqs=64,
            enable_prefix_caching=False,
            cpu_linear=args.cpu_linear,
        )
    )
    cpu = torch.device("cpu")
    native = get_attention_backend("cpu", cpu)
    assert isinstance(native, CpuNativeAttentionBackend)
    configs: dict[str, tuple[AttentionBackend, ModelOps]] = {
        "torch": (get_attention_backend("torch", cpu), TorchModelOps()),
        "attn": (native, TorchModelOps()),
        "native": (native, NativeCpuModelOps(native.kernels)),
    }
    best: dict[tuple[int, int], dict[str, float]] = {p: {} for p in points}
    for _ in range(args.rounds):
        for b, ctx in points:
            for name, (backend, ops) in configs.items():
                use(eng, backend, ops)
                wall, _cpu = decode_cost(eng, b, args.steps, ctx)
                prev = best[(b, ctx)].get(name, float("inf"))
                best[(b, ctx)][name] = min(prev, wall)
    print(f"threads={torch.get_num_threads()} cpu_linear={args.cpu_linear}")
    print("| batch | context | torch ms/step | attn ms/step | native ms/step | torch/native |")
    print("|---|---|---|---|---|---|")
    rows = []
    for (b, ctx), r in best.items():
        print(
            f"| {b} | {ctx} | {r['torch']:.1f} | {r['attn']:.1f} | {r['native']:.1f} "
            f"| {r['torch'] / r['native']:.2f}x |"
        )
        rows.append({"batch": b, "context": ctx, **{f"{k}_ms": v for k, v in r.items()}})
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
