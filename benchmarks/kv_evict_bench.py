"""Token-level eviction on paged blocks: compaction (what the engine does) vs validity masks.

The default model's KV layout (30 layers, 3 KV heads, head_dim 64, 16-token
blocks, float32). A sequence has seen ``--seen`` tokens and keeps
``--budget`` of them, chosen at random past 4 sinks (an H2O-like scattered
keep-set; streaming's contiguous window is the easy case for both).

* compaction: every ``--interval`` tokens, gather the kept tokens' keys and
  values, scatter them into the front blocks and re-rotate the moved keys
  (``KVPolicyRuntime.compact``'s work: engine/kv/policies/runtime.py); decode
  attention then reads ``budget + interval / 2`` dense slots on average.
* masks: nothing moves; decode attention reads every slot of every block that
  still has a live slot, with a validity mask; a block is freed only when all
  its slots are dead.

Per decode token: attention over all layers (torch SDPA, one query) plus, for
compaction, the compaction's cost divided by the interval. Also the blocks
each holds. Configurations alternate inside the run; medians of ``--repeats``.

    python -m benchmarks.kv_evict_bench --seen 4096 --budget 1024 --interval 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kernels.rope_shift import rope_shift_paged_ref

LAYERS, HKV, HQ, D, BS = 30, 3, 9, 64, 16


def rope_table(n: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    f = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.sin()], dim=1)


def attend(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    blocks: torch.Tensor,
    q: torch.Tensor,
    mask: torch.Tensor | None,
) -> None:
    for k, v in caches:
        kk = k.index_select(0, blocks).view(1, -1, HKV, D).transpose(1, 2)
        vv = v.index_select(0, blocks).view(1, -1, HKV, D).transpose(1, 2)
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=True)


def compact(
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    keep_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    dst_blocks: torch.Tensor,
    old_pos: torch.Tensor,
    new_pos: torch.Tensor,
    table: torch.Tensor,
) -> None:
    for k, v in caches:
        kf, vf = k.view(-1, HKV, D), v.view(-1, HKV, D)
        kd, vd = kf[keep_slots], vf[keep_slots]
        kf[dst_slots] = kd
        vf[dst_slots] = vd
    offs = torch.arange(BS)
    slots = (dst_blocks[:, None] * BS + offs).reshape(-1)
    for k, _ in caches:
        rope_shift_paged_ref(k, slots, old_pos.reshape(-1), new_pos.reshape(-1), table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seen", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--interval", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    nblk = -(-a.seen // BS)
    caches = [
        (torch.randn(nblk + 4, BS, HKV, D), torch.randn(nblk + 4, BS, HKV, D))
        for _ in range(LAYERS)
    ]
    table = rope_table(a.seen + 64)
    rest = torch.randperm(a.seen - 4)[: a.budget - 4] + 4
    keep = torch.cat([torch.arange(4), rest.sort().values])
    live_blocks = torch.unique(keep // BS)
    # masks: every block with a live slot stays; the mask marks the live slots.
    mask_blocks = live_blocks
    live = torch.zeros(len(mask_blocks) * BS, dtype=torch.bool)
    where = {int(b): i for i, b in enumerate(mask_blocks.tolist())}
    for s in keep.tolist():
        live[where[s // BS] * BS + s % BS] = True
    mask = live.view(1, 1, 1, -1)
    # compaction: kept tokens into the first ceil(budget / BS) blocks.
    m = int(keep.shape[0])
    dense_blocks = torch.arange(-(-(m + a.interval // 2) // BS))
    dst_slots = torch.arange(m)
    dst_blocks = torch.arange(-(-m // BS))
    new_pos = torch.arange(len(dst_blocks) * BS)
    old_pos = new_pos.clone()
    old_pos[:m] = keep
    q = torch.randn(1, HQ, 1, D)
    t_mask: list[float] = []
    t_dense: list[float] = []
    t_compact: list[float] = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        attend(caches, mask_blocks, q, mask)
        t_mask.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        attend(caches, dense_blocks, q, None)
        t_dense.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compact(
            caches, keep, dst_slots, dst_blocks, old_pos.view(-1, BS), new_pos.view(-1, BS), table
        )
        t_compact.append(time.perf_counter() - t0)
    med = statistics.median
    per_tok_compact = med(t_dense) + med(t_compact) / a.interval
    print(
        f"seen={a.seen} budget={a.budget} interval={a.interval} threads={torch.get_num_threads()}"
    )
    print(f"masks:      attention {med(t_mask) * 1e3:.3f} ms/token, blocks held {len(mask_blocks)}")
    print(
        f"compaction: attention {med(t_dense) * 1e3:.3f} ms/token + compaction "
        f"{med(t_compact) * 1e3:.3f} ms / {a.interval} tokens = {per_tok_compact * 1e3:.3f} "
        f"ms/token, blocks held {len(dense_blocks)}"
    )
    print(f"ratio masks / compaction per token: {med(t_mask) / per_tok_compact:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
