"""Scatter the new tokens' keys and values into their paged-cache slots.

Cache layout ``[num_blocks, block_size, Hkv, D]``; slot ``s`` is row
``s % block_size`` of block ``s // block_size``. A negative slot means "skip"
(padding rows of a CUDA-graph batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, next_pow2


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _store_kvcache_kernel(  # type: ignore[no-untyped-def]
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per token: copy its Hkv x D keys and values (cast to the cache dtype)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // block_size
        off = slot % block_size
        i = tl.arange(0, BLOCK)
        h = i // HEAD_DIM
        d = i % HEAD_DIM
        ok = i < NUM_KV_HEADS * HEAD_DIM
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
        tl.store(
            k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d,
            k.to(k_cache_ptr.dtype.element_ty),
            mask=ok,
        )
        tl.store(
            v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d,
            v.to(v_cache_ptr.dtype.element_ty),
            mask=ok,
        )


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.shape != v.shape or k.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v must be [T, Hkv, D] alike, got {tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold heads {tuple(k.shape[1:])}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(
            f"slot_mapping must be [T] = [{k.shape[0]}], got {tuple(slot_mapping.shape)}"
        )


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k[t]``/``v[t]`` (``[T, Hkv, D]``) to cache slot ``slot_mapping[t]`` (Triton).

    Slots ``< 0`` are skipped. Values are cast to the cache dtype. Slots must be
    distinct (two tokens in one slot race). Caches are modified in place.
    """
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, hkv, head_dim = k.shape
    if num_tokens == 0:
        return
    check_launchable(_store_kvcache_kernel, k, k_cache)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    _store_kvcache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_cache.shape[1],
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=head_dim,
        BLOCK=next_pow2(hkv * head_dim),
        num_warps=4,
    )


def store_kvcache_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch reference of :func:`store_kvcache`, one token at a time."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = k[t].to(k_cache.dtype)
        v_cache[slot // block_size, slot % block_size] = v[t].to(v_cache.dtype)
