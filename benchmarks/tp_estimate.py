"""A paper estimate (not a measurement) of tensor-parallel decode on H200s.

For a model that needs TP on an H200 (Llama-3.1-70B in bfloat16: 141 GB of
weights, one H200 holds 141 GB), per decode step and TP degree N:

* weights read: 2 * params / N bytes per GPU at ``--hbm-gbs`` (memory bound);
* all-reduces: 2 per layer + 1 (vocab-parallel embedding), each of
  ``tokens * hidden * 2`` bytes; ring time ``latency + 2(N-1)/N * bytes / bw``
  at ``--nvlink-gbs`` per direction and ``--latency-us`` per all-reduce;
* the logits gather to rank 0: ``tokens * vocab / N * 4`` bytes at the same bw.

Attention's KV reads, other kernels and any compute/communication overlap are
left out (they depend on context length and implementation). Usage::

    python -m benchmarks.tp_estimate
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=70.6e9)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hbm-gbs", type=float, default=4800 * 0.8, help="achieved HBM GB/s")
    ap.add_argument("--nvlink-gbs", type=float, default=450 * 0.8, help="achieved GB/s/direction")
    ap.add_argument("--latency-us", type=float, default=10.0, help="NCCL small all-reduce")
    args = ap.parse_args()
    print(
        "| N | tokens/step | bytes/all-reduce | all-reduces/step | weights ms | all-reduce ms "
        "| gather ms | step ms | steps/s | tokens/s | all-reduce share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    count = 2 * args.layers + 1
    for n in (2, 4, 8):
        for tokens in (1, 64, 256):
            size = tokens * args.hidden * 2
            ar_s = args.latency_us * 1e-6 + 2 * (n - 1) / n * size / (args.nvlink_gbs * 1e9)
            ar_ms = count * ar_s * 1000
            w_ms = 2 * args.params / n / (args.hbm_gbs * 1e9) * 1000
            gather = tokens * args.vocab / n * 4 * (n - 1)
            g_ms = (args.latency_us * 1e-6 + gather / (args.nvlink_gbs * 1e9)) * 1000
            step = w_ms + ar_ms + g_ms
            print(
                f"| {n} | {tokens} | {size / 1024:.0f} KiB | {count} | {w_ms:.2f} | {ar_ms:.2f} "
                f"| {g_ms:.3f} | {step:.2f} | {1000 / step:.0f} | {tokens * 1000 / step:.0f} "
                f"| {ar_ms / step:.0%} |"
            )


if __name__ == "__main__":
    main()
