"""CPU linear kernels side by side on the default model's real layer weights.

For each row count (tokens in a step), every linear of a stride of layers runs
through each implementation in turn, alternating within one process so
machine drift hits all of them alike: ``native`` (Q4_1 blocks through
kernels/csrc/cpu_quant.c as ``--cpu-linear q4_1`` runs them: x16-interleaved
on AVX-512 VNNI builds; there also ``native_rows``, the row-major blocks, and
``native_avx2``, the AVX2 build),
``int8`` (fbgemm dynamic int8, ``--cpu-linear int8``), ``fp16`` (fbgemm fp16
weights, q4_1's path above 8 rows) and ``onednn`` (prepacked fp32,
``--cpu-linear auto``). Weights of 10 layers (~35M parameters) are cycled, so
they come from memory, not cache, as in a real step. Reports best-of-rounds
milliseconds per pass and each one's ratio to native. Usage::

    python -m benchmarks.quant_linear_bench --rows 1,4,8,16,32,128
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from engine.models.linear import Fp16Linear, Int8DynamicLinear, PackedLinear
from engine.models.loader import iter_weights, resolve_model_path
from kernels.cpu_native import CpuKernels
from kernels.quant_linear import QuantWeight, pack_x16, quantize_q4_1
from loadtest.report import bench_record, write_json

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8,16,32,128")
    ap.add_argument("--layer-stride", type=int, default=3, help="use every Nth layer")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*quantize_per_channel.*")
    kernels = CpuKernels.load()
    # The AVX2 build of the same source, where this CPU has the AVX-512 path.
    avx2 = CpuKernels.load(extra_flags=("-mno-avx512f",)) if kernels.has_avx512_vnni else None
    weights: list[torch.Tensor] = []
    for name, w in iter_weights(resolve_model_path(None)):
        parts = name.split(".")
        if len(parts) > 3 and parts[-2] in _LINEARS and int(parts[2]) % args.layer_stride == 0:
            weights.append(w)
    q4: list[QuantWeight] = [quantize_q4_1(w) for w in weights]
    x16 = [pack_x16(q) for q in q4] if kernels.has_avx512_vnni else q4
    int8 = [Int8DynamicLinear(w, None) for w in weights]
    fp16 = [Fp16Linear(w, None) for w in weights]
    onednn = [PackedLinear(w, None, min_rows=1) for w in weights]
    results = []
    print(f"threads={torch.get_num_threads()} linears={len(weights)}")
    impls: dict[str, Callable[[int, torch.Tensor], torch.Tensor]] = {
        "native": lambda i, x: kernels.quant_linear(x, x16[i]),
        "int8": lambda i, x: int8[i](x),
        "fp16": lambda i, x: fp16[i](x),
        "onednn": lambda i, x: onednn[i](x),
    }
    if avx2 is not None:
        impls["native_rows"] = lambda i, x: kernels.quant_linear(x, q4[i])
        impls["native_avx2"] = lambda i, x: avx2.quant_linear(x, q4[i])
    others = [k for k in impls if k != "native"]
    print(
        f"native: {'AVX-512 VNNI' if kernels.has_avx512_vnni else 'AVX2/portable'}\n"
        "| rows | native ms | "
        + " | ".join(f"{k} ms" for k in others)
        + " | "
        + " | ".join(f"{k}/native" for k in others)
        + " |"
    )
    print("|---|---|" + "---|---|" * len(others))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        inputs = [xs[w.shape[1]] for w in weights]
        best = dict.fromkeys(impls, float("inf"))
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, fn in impls.items():
                    t0 = time.perf_counter()
                    for i, x in enumerate(inputs):
                        fn(i, x)
                    best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        n = best["native"]
        print(
            f"| {rows} | {n:.2f} | "
            + " | ".join(f"{best[k]:.2f}" for k in others)
            + " | "
            + " | ".join(f"{best[k] / n:.2f}x" for k in others)
            + " |"
        )
        results.append({"rows": rows, **{f"{k}_ms": v for k, v in best.items()}})
    if args.json:
        write_json(args.json, bench_record("quant_linear_bench", args, {"json"}, results=results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
