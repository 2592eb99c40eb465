"""Move stored keys to other positions: re-rotate paged keys by a RoPE position delta.

RoPE rotates each (x1, x2) pair of a key's half-split (GPT-NeoX / Hugging Face
Llama) layout by the angle ``p * inv_freq``. Rotations of one plane compose
by adding angles, so a key rotated at ``p`` and then by ``p' - p`` equals the
raw key rotated at ``p'``. The delta's cos and sin come from the model's own
``[max_pos, head_dim]`` cos|sin table (rows ``p`` and ``p'``, angle-difference
identities), so any RoPE scaling baked into the table (linear, llama3) holds
without this module knowing about it, and no angle is recomputed here.

Cache layout ``[num_blocks, block_size, Hkv, D]``; slot ``s`` is row
``s % block_size`` of block ``s // block_size``. Work is done in float32 and
cast back to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, next_pow2


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _rope_shift_kernel(  # type: ignore[no-untyped-def]
    k_cache_ptr,
    slot_ptr,
    old_ptr,
    new_ptr,
    cos_sin_ptr,
    block_size,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cos,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per slot: rotate its Hkv x D key by (new - old) in place."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    p_old = tl.load(old_ptr + t).to(tl.int64)
    p_new = tl.load(new_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    d = tl.arange(0, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    dm = d < HALF
    co = tl.load(cos_sin_ptr + p_old * stride_cos + d, mask=dm, other=1.0)
    so = tl.load(cos_sin_ptr + p_old * stride_cos + HALF + d, mask=dm, other=0.0)
    cn = tl.load(cos_sin_ptr + p_new * stride_cos + d, mask=dm, other=1.0)
    sn = tl.load(cos_sin_ptr + p_new * stride_cos + HALF + d, mask=dm, other=0.0)
    # cos(b - a) and sin(b - a) from the table's rows a (old) and b (new).
    c = cn * co + sn * so
    s = sn * co - cn * so
    base = k_cache_ptr + blk * stride_cb + off * stride_cs
    ptr1 = base + h[:, None] * stride_ch + d[None, :]
    ptr2 = ptr1 + HALF
    m = (h[:, None] < NUM_KV_HEADS) & dm[None, :]
    x1 = tl.load(ptr1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=m, other=0.0).to(tl.float32)
    y1 = x1 * c[None, :] - x2 * s[None, :]
    y2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(ptr1, y1.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(ptr2, y2.to(k_cache_ptr.dtype.element_ty), mask=m)


def _check(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}"
        )
    n = slots.shape[0]
    if slots.dim() != 1 or old_positions.shape != (n,) or new_positions.shape != (n,):
        raise ValueError("slots, old_positions and new_positions must be [N] alike")
    d = k_cache.shape[3]
    if d % 2 or cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError(f"cos_sin must be [max_pos, {d}] with an even head_dim")
    if n and (
        int(torch.minimum(old_positions.min(), new_positions.min())) < 0
        or int(torch.maximum(old_positions.max(), new_positions.max())) >= cos_sin.shape[0]
    ):
        raise ValueError("a position lies outside the cos/sin table")


def rope_shift_paged(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    """Re-rotate the key in cache slot ``slots[i]`` from ``old_positions[i]`` to
    ``new_positions[i]`` (Triton), in place. Slots must be distinct."""
    _check(k_cache, slots, old_positions, new_positions, cos_sin)
    n = int(slots.shape[0])
    if n == 0:
        return
    check_launchable(_rope_shift_kernel, k_cache, slots)
    if k_cache.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("the cache's and the table's last dimension must be contiguous")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    _rope_shift_kernel[(n,)](
        k_cache,
        slots,
        old_positions,
        new_positions,
        cos_sin,
        k_cache.shape[1],
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        cos_sin.stride(0),
        NUM_KV_HEADS=hkv,
        HALF=d // 2,
        BLOCK_H=next_pow2(hkv),
        BLOCK_D=next_pow2(d // 2),
        num_warps=1,
    )


def rope_shift_paged_ref(
    k_cache: torch.Tensor,
    slots: torch.Tensor,
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    cos_sin: torch.Tensor,
) -> None:
    """Plain-torch :func:`rope_shift_paged` (one gather, one rotation, one scatter).

    Also the CPU implementation: vectorised over slots and heads, no Python loop.
    """
    _check(k_cache, slots, old_positions, new_positions, cos_sin)
    if slots.shape[0] == 0:
        return
    nb, bs, hkv, d = k_cache.shape
    half = d // 2
    flat = k_cache.view(nb * bs, hkv, d)
    x = flat.index_select(0, slots).float()
    table = cos_sin.float()
    co, so = table[old_positions, :half], table[old_positions, half:]
    cn, sn = table[new_positions, :half], table[new_positions, half:]
    c = (cn * co + sn * so)[:, None, :]
    s = (sn * co - cn * so)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    flat.index_copy_(0, slots, out.to(k_cache.dtype))
