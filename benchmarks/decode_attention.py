"""Native CPU paged decode attention, microseconds per call (float16 KV, the default model's
heads: 9 query, 3 kv, head size 64, block size 16), at 32/1,000/4,000 tokens of context
for 1 and 16 sequences, 2 threads. Usage: ``python -m benchmarks.decode_attention``.
"""

import time

import torch

from kernels.cpu_native import CpuKernels

k = CpuKernels.load()
torch.manual_seed(0)
hq, hkv, d, bs = 9, 3, 64, 16
for ctx in (32, 1000, 4000):
    for nd in (1, 16):
        nb = nd * (-(-ctx // bs)) + 1
        kc = torch.randn(nb, bs, hkv, d).half()
        vc = torch.randn(nb, bs, hkv, d).half()
        bt = torch.randperm(nb - 1)[: nd * (-(-ctx // bs))].view(nd, -1).int().contiguous()
        sl = torch.full((nd,), ctx, dtype=torch.int32)
        q = torch.randn(nd, hq, d)
        out = torch.empty_like(q)
        for _ in range(20):
            k.paged_decode_attention(q, kc, vc, bt, sl, 0.125, out=out, num_threads=2)
        n = 200 if ctx < 4000 else 50
        t = time.perf_counter()
        for _ in range(n):
            k.paged_decode_attention(q, kc, vc, bt, sl, 0.125, out=out, num_threads=2)
        dt = (time.perf_counter() - t) / n
        print(f"ctx {ctx} nd {nd}: {dt * 1e6:.1f} us/call")
