"""Native CPU paged decode attention, microseconds per call (float16 KV, the default model's
heads: 9 query, 3 kv, head size 64, block size 16), at 32/1,000/4,000 tokens of context
for 1 and 16 sequences, 2 threads. Usage: ``python -m benchmarks.decode_attention``.
"""

from __future__ import annotations

import time

import torch

from kernels.cpu_native import CpuKernels

HQ, HKV, D, BS = 9, 3, 64, 16


def time_call(kern: CpuKernels, ctx: int, nd: int) -> float:
    """Seconds per call for ``nd`` sequences of ``ctx`` tokens (shuffled blocks)."""
    per_seq = -(-ctx // BS)
    nb = nd * per_seq + 1
    kc = torch.randn(nb, BS, HKV, D).half()
    vc = torch.randn(nb, BS, HKV, D).half()
    bt = torch.randperm(nb - 1)[: nd * per_seq].view(nd, -1).int().contiguous()
    sl = torch.full((nd,), ctx, dtype=torch.int32)
    q = torch.randn(nd, HQ, D)
    out = torch.empty_like(q)

    def call() -> None:
        kern.paged_decode_attention(q, kc, vc, bt, sl, D**-0.5, out=out, num_threads=2)

    for _ in range(20):
        call()
    n = 200 if ctx < 4000 else 50
    t = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t) / n


def main() -> None:
    kern = CpuKernels.load()
    torch.manual_seed(0)
    for ctx in (32, 1000, 4000):
        for nd in (1, 16):
            print(f"ctx {ctx} nd {nd}: {time_call(kern, ctx, nd) * 1e6:.1f} us/call")


if __name__ == "__main__":
    main()
