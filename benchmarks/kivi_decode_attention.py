"""Native CPU decode attention over KIVI blocks against float16 KV, microseconds
per call: the default model's heads (9 query, 3 kv, head size 64), one
sequence at 1,000 and 4,000 tokens of context, 2 threads; kivi4 (groups of 32,
a one-group window) and kivi2 (groups of 8, a 32-token window and sinks) in
1,024-token blocks, float16 in 16-token blocks (each format's defaults). The
caches hold random codes with plausible scales: speed only. The first line
says which KIVI body ran (csrc/cpu_kivi.c: integer on AVX-512 VNNI builds).

    python -m benchmarks.kivi_decode_attention
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch

from kernels.cpu_native import CpuKernels
from kernels.kivi import KiviLayout, side_views

HQ, HKV, D = 9, 3, 64
FORMATS = {"kivi4": (4, 32, 1, False), "kivi2": (2, 8, 4, True)}


def best_us(call: Callable[[], object], n: int = 200) -> float:
    call()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def kivi_caches(lay: KiviLayout, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randint(0, 256, (blocks, lay.k.nbytes), dtype=torch.uint8)
    v = torch.randint(0, 256, (blocks, lay.v.nbytes), dtype=torch.uint8)
    for cache, keys in ((k, True), (v, False)):
        side = side_views(cache, lay, keys)
        side.scale.copy_(torch.rand(side.scale.shape).half() * 0.1)
        side.zero.copy_(torch.randn(side.zero.shape).half())
        side.resid.copy_(torch.randn(side.resid.shape).half())
    return k, v


def main() -> int:
    kern = CpuKernels.load()
    torch.manual_seed(0)
    q = torch.randn(1, HQ, D)
    out = torch.empty_like(q)
    bodies = {
        name: "integer"
        if kern.kivi_integer_body(KiviLayout(b, g, 32, 1024, HKV, D, r, s))
        else "float"
        for name, (b, g, r, s) in FORMATS.items()
    }
    print("KIVI body: " + ", ".join(f"{name} {body}" for name, body in bodies.items()) + "\n")
    print(
        "| context | float16 (us) | kivi4 (us) | kivi4 / float16 | kivi2 (us) | kivi2 / float16 |"
    )
    print("|---|---|---|---|---|---|")
    for ctx in (1000, 4000):
        sl = torch.tensor([ctx], dtype=torch.int32)
        nb = -(-ctx // 16)
        kc = torch.randn(nb, 16, HKV, D).half()
        vc = torch.randn(nb, 16, HKV, D).half()
        bt = torch.randperm(nb).view(1, -1).int().contiguous()
        f16 = best_us(
            partial(kern.paged_decode_attention, q, kc, vc, bt, sl, 0.125, out=out, num_threads=2)
        )
        cells = [f"{ctx}", f"{f16:.0f}"]
        for bits, group, ring, sink in FORMATS.values():
            lay = KiviLayout(bits, group, 32, 1024, HKV, D, ring, sink)
            blocks = -(-ctx // 1024)
            kk, vv = kivi_caches(lay, blocks)
            btk = torch.arange(blocks).view(1, -1).int().contiguous()
            us = best_us(
                partial(
                    kern.kivi_decode_attention, q, kk, vv, btk, sl, lay, 0.125, check_lengths=False
                )
            )
            cells += [f"{us:.0f}", f"{us / f16:.2f}x"]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
