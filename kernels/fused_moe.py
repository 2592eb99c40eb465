"""Fused Mixture-of-Experts MLP: tokens sorted by expert, grouped GEMMs, weighted scatter.

Inputs are the routed layer's ``x`` ``[T, H]``, the stacked expert weights
``w13`` ``[E, 2I, H]`` (gate rows then up rows, as ``nn.Linear`` stores them)
and ``w2`` ``[E, H, I]``, and the routing: ``expert_ids`` ``[T, k]`` (``-1``:
a dropped slot, which contributes nothing) and ``weights`` ``[T, k]``.
Output: ``out[t] = sum_s weights[t, s] * w2[e] @ (silu(g) * u)`` with
``g, u = split(w13[e] @ x[t])`` and ``e = expert_ids[t, s]``.

``moe_align`` sorts the ``T * k`` token slots by expert into blocks of
``BLOCK_M`` rows, each block holding one expert's slots (the last one padded
with an out-of-range slot), using fixed-size torch ops only (no host sync:
the block count is the upper bound ``ceil((T*k + E*(BLOCK_M-1)) / BLOCK_M)``
and unused blocks are marked ``-1``). Two Triton kernels then run one program
per (block, output tile): the first gathers the block's token rows and
computes gate and up tiles against that expert's ``w13`` with the SiLU-and-
multiply fused in; the second multiplies by ``w2``, scales each row by its
slot's weight and scatters it to that slot's row of a ``[T * k, H]`` buffer,
which ``fused_moe`` sums over the ``k`` slots (a fixed order, so results are
deterministic, unlike atomic adds).

``fused_moe_ref`` is the plain-torch reference: every slot computed on its
own from gathered weights (no sorting), so it checks the sorting as well as
the GEMMs. Routing itself (softmax, top-k, capacity) is done by the caller
(engine/models/moe_routing.py) with torch ops on the same device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_launchable, needs_fp32_dot


def moe_align(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort token slots by expert into ``block_m``-row blocks.

    Returns ``(sorted_slots [P], block_experts [P // block_m])`` (int32):
    ``sorted_slots`` lists flat slot indices ``t * k + s`` grouped by expert in
    ascending expert order and, within an expert, ascending slot order; padding
    entries hold ``T * k``. ``block_experts[b]`` is the expert of block ``b``,
    ``-1`` for blocks past the last expert's. Dropped slots (``-1``) appear nowhere.
    """
    flat = expert_ids.reshape(-1).long()
    n = flat.numel()
    e = num_experts
    device = flat.device
    num_blocks = (n + e * (block_m - 1) + block_m - 1) // block_m
    p = num_blocks * block_m
    mapped = torch.where(flat >= 0, flat, e)  # dropped slots sort last, as "expert E"
    counts = torch.zeros(e + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, mapped, torch.ones_like(mapped))
    padded = (counts[:e] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(mapped, stable=True)
    sorted_experts = mapped[order]
    start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=device) - start[sorted_experts]
    real = sorted_experts < e
    dest = torch.where(real, padded_start[sorted_experts.clamp(max=e - 1)] + rank, p)
    slots = torch.full((p + 1,), n, dtype=torch.int32, device=device)
    slots.scatter_(0, dest, order.to(torch.int32))  # index p collects the dropped: discarded
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_end, block_start, right=True)
    block_experts = torch.where(block_experts < e, block_experts, -1).to(torch.int32)
    return slots[:p], block_experts


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _moe_gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    w_ptr,
    out_ptr,
    slots_ptr,
    block_experts_ptr,
    num_slots,
    top_k,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """One program per (block of one expert's slots, tile of I): silu(x W_g^T) * (x W_u^T)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slots_ptr + rows)
        row_ok = slot < num_slots
        tok = (slot // top_k).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            a = tl.load(
                x_ptr + tok[:, None] * stride_xt + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_mask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(
                w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=w_mask,
                other=0.0,
            )
            wu = tl.load(
                w_base + (cols[None, :] + inter).to(tl.int64) * stride_wn + ks[:, None],
                mask=w_mask,
                other=0.0,
            )
            if UPCAST_DOT:
                a = a.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            if IEEE_DOT:
                acc_g += tl.dot(a, wg, input_precision="ieee")
                acc_u += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_g += tl.dot(a, wg)
                acc_u += tl.dot(a, wu)
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(
            out_ptr + slot[:, None].to(tl.int64) * stride_ot + cols[None, :],
            act.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _moe_down_kernel(  # type: ignore[no-untyped-def]
    a_ptr,
    w_ptr,
    out_ptr,
    weights_ptr,
    slots_ptr,
    block_experts_ptr,
    num_slots,
    inter,
    hidden,
    stride_at,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """One program per (block, tile of H): ``weight[slot] * (a[slot] W_down^T)`` to row ``slot``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= 0:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slots_ptr + rows)
        row_ok = slot < num_slots
        slot64 = slot.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < inter
            a = tl.load(
                a_ptr + slot64[:, None] * stride_at + ks[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            if IEEE_DOT:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        scale = tl.load(weights_ptr + slot64, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        tl.store(
            out_ptr + slot64[:, None] * stride_ot + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )


def _check(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[int, int, int, int, int]:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x must be [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
            f"{tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    t, h = x.shape
    e, two_i, h1 = w13.shape
    if h1 != h or two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"weights do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if expert_ids.dim() != 2 or expert_ids.shape[0] != t or weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_ids and weights must both be [T, k] with T = {t}; got "
            f"{tuple(expert_ids.shape)}, {tuple(weights.shape)}"
        )
    return t, h, e, two_i // 2, expert_ids.shape[1]


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in ``x.dtype`` (Triton; see the module doc).

    Blocks must be powers of two of at least 16 (``tl.dot``'s minimum).
    """
    t, h, e, i, k = _check(x, w13, w2, expert_ids, weights)
    if t == 0:
        return torch.zeros_like(x)
    check_launchable(_moe_gate_up_kernel, x, w13)
    x = x.contiguous()
    w13 = w13.contiguous()
    w2 = w2.contiguous()
    slots, block_experts = moe_align(expert_ids, e, block_m)
    num_slots = t * k
    inter = torch.empty((num_slots, i), dtype=x.dtype, device=x.device)
    upcast = needs_fp32_dot(w13)
    ieee = x.dtype == torch.float32
    grid_m = block_experts.shape[0]
    _moe_gate_up_kernel[(grid_m, triton.cdiv(i, block_n))](
        x,
        w13,
        inter,
        slots,
        block_experts,
        num_slots,
        k,
        h,
        i,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST_DOT=upcast,
        IEEE_DOT=ieee,
        num_warps=4,
    )
    # Zeros: dropped slots are never written and must add nothing.
    per_slot = torch.zeros((num_slots, h), dtype=x.dtype, device=x.device)
    flat_weights = weights.reshape(-1).contiguous()
    _moe_down_kernel[(grid_m, triton.cdiv(h, block_n))](
        inter,
        w2,
        per_slot,
        flat_weights,
        slots,
        block_experts,
        num_slots,
        i,
        h,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_slot.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST_DOT=upcast,
        IEEE_DOT=ieee,
        num_warps=4,
    )
    return per_slot.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Plain-torch reference of :func:`fused_moe`: each slot on its own, in float32."""
    i = _check(x, w13, w2, expert_ids, weights)[3]
    kept = expert_ids >= 0
    ids = expert_ids.clamp(min=0).long()
    xf = x.float()
    w13_s = w13.float()[ids]  # [T, k, 2I, H]
    w2_s = w2.float()[ids]  # [T, k, H, I]
    gate_up = torch.einsum("th,tknh->tkn", xf, w13_s)
    act = F.silu(gate_up[..., :i]) * gate_up[..., i:]
    down = torch.einsum("tki,tkhi->tkh", act, w2_s)
    scale = torch.where(kept, weights.float(), torch.zeros((), device=x.device))
    return (down * scale[..., None]).sum(dim=1).to(x.dtype)
