"""Fused element-wise kernels of a Llama-style layer, each with a torch reference.

- ``rms_norm``: RMSNorm, optionally fused with the residual add before it.
- ``rotary_embedding``: neox-style (rotate-half) RoPE applied in place to q and k.
- ``silu_and_mul``: the SwiGLU activation ``silu(gate) * up`` of a merged
  gate/up projection.

All of them compute in fp32 and round once to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, next_pow2

# ---------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per row: (x + residual) -> RMS-normalise -> scale by weight."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        # The new residual is rounded to the input dtype, and the norm reads the
        # rounded value: the same numbers an unfused add-then-norm would see.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (xf * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim (Triton).

    Without ``residual``: returns ``x * rsqrt(mean(x^2) + eps) * weight``. With
    ``residual`` (same shape as ``x``): ``h = x + residual`` (rounded to x's
    dtype) and returns ``(rms_norm(h), h)``. Inputs are not modified.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    check_launchable(_rms_norm_kernel, x)
    x2 = x.reshape(-1, hidden)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = x2
    new_res = out
    if residual is not None:
        r2 = residual.reshape(-1, hidden)
        r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
        new_res = torch.empty_like(out)
    rows = x2.shape[0]
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            new_res,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            new_res.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=next_pow2(hidden),
            num_warps=min(16, max(1, next_pow2(hidden) // 256)),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), new_res.view(x.shape)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`rms_norm` (same contract)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    out = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return out if residual is None else (out, h)


# ---------------------------------------------------------------- rotary


@triton.jit
def _rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_c,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: rotate the first 2*HALF dims of every q and k head."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    j_ok = j < HALF
    cos = tl.load(cache_ptr + pos * stride_c + j, mask=j_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + j, mask=j_ok, other=0.0).to(tl.float32)

    hq = tl.arange(0, BLOCK_HQ)
    m = (hq < NUM_Q_HEADS)[:, None] & j_ok[None, :]
    p1 = q_ptr + t * stride_qt + hq[:, None] * stride_qh + j[None, :]
    x1 = tl.load(p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=m, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=m)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=m)

    hk = tl.arange(0, BLOCK_HK)
    mk = (hk < NUM_K_HEADS)[:, None] & j_ok[None, :]
    pk = k_ptr + t * stride_kt + hk[:, None] * stride_kh + j[None, :]
    y1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
    y2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
    tl.store(pk, (y1 * cos - y2 * sin).to(k_ptr.dtype.element_ty), mask=mk)
    tl.store(pk + HALF, (y2 * cos + y1 * sin).to(k_ptr.dtype.element_ty), mask=mk)


def _rope_views(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``[T, H, head_dim]`` views of q/k (no copy) and half the rotary dim."""
    num_tokens = positions.shape[0]
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, rot_dim <= {head_dim}], even rot_dim")
    if q.shape[0] != num_tokens or k.shape[0] != num_tokens:
        raise ValueError("q, k and positions must have the same number of tokens")
    qv = q.view(num_tokens, -1, head_dim)
    kv = k.view(num_tokens, -1, head_dim)
    return qv, kv, rot // 2


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary embedding, in place on ``q`` and ``k`` (Triton).

    Args:
        positions: int ``[T]`` absolute positions.
        q, k: ``[T, Hq * head_dim]`` or ``[T, Hq, head_dim]`` (likewise k with its
            own head count); the last dim must be contiguous. Modified in place.
        cos_sin_cache: ``[max_pos, rot_dim]``: ``cos`` in the first half of each
            row, ``sin`` in the second (``rot_dim <= head_dim``; only the first
            ``rot_dim`` dims of each head rotate).
        head_dim: size of one head.

    Returns:
        ``(q, k)``, the same tensors, for chaining.
    """
    qv, kv, half = _rope_views(positions, q, k, cos_sin_cache, head_dim)
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return q, k
    check_launchable(_rope_kernel, q, k)
    if qv.stride(-1) != 1 or kv.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("q, k and cos_sin_cache need a contiguous last dim")
    _rope_kernel[(num_tokens,)](
        positions,
        qv,
        kv,
        cos_sin_cache,
        qv.stride(0),
        qv.stride(1),
        kv.stride(0),
        kv.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=qv.shape[1],
        NUM_K_HEADS=kv.shape[1],
        HALF=half,
        BLOCK_HQ=next_pow2(qv.shape[1]),
        BLOCK_HK=next_pow2(kv.shape[1]),
        BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )
    return q, k


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of :func:`rotary_embedding` (same contract, in place)."""
    qv, kv, half = _rope_views(positions, q, k, cos_sin_cache, head_dim)
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half : 2 * half]
    for x in (qv, kv):
        x1 = x[..., :half].float()
        x2 = x[..., half : 2 * half].float()
        rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x[..., : 2 * half] = rot.to(x.dtype)
    return q, k


# ---------------------------------------------------------------- SiLU and mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    """Grid (rows, column blocks): out = silu(x[:, :I]) * x[:, I:]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    res = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, res.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of last dim ``2 * I`` (Triton)."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    check_launchable(_silu_and_mul_kernel, x)
    x2 = x.reshape(-1, 2 * inter)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(inter))
    if x2.shape[0] and inter:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference of :func:`silu_and_mul`."""
    inter = x.shape[-1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[..., :inter]) * xf[..., inter:]).to(x.dtype)
