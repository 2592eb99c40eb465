"""Triton attention over KIVI blocks, read in place (CUDA; tested under TRITON_INTERPRET=1).

Same contract as ``kernels.kivi.kivi_attention_ref`` for every sequence of a
flattened batch (decodes and extends alike; the new tokens are stored first,
by ``kernels.kivi.kivi_store``): the query at position ``p`` reads the groups
outside its float16 window and sinks from codes, dequantized in registers
(``code * scale + zero``), and the others at float16: the step's own new rows
(rounded to float16, as stored); for window positions before the step, the
sequence's window rows as they were before the store (``tails``: a chunk's
store may reuse their slots); sink positions before the window from their
slot in the cache (never reused). One program per
(new token, kv head) serves every q head of the kv head (grouped-query
attention), streaming keys in tiles of ``BLOCK_N`` with an online softmax.

The caches are passed twice, as bytes (codes) and as float16 (scales and zero
points: the layout aligns them to 2 bytes), views of the same memory; offsets
are those of ``KiviLayout``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import next_pow2
from kernels.kivi import KiviLayout

_LOG2E = 1.4426950408889634


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _kivi_attn_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    out_ptr,
    k8_ptr,
    v8_ptr,
    k16_ptr,
    v16_ptr,
    kn_ptr,
    vn_ptr,
    kt_ptr,
    vt_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tok_seq_ptr,
    qk_scale,
    kside,
    vside,
    scale_off,
    kzero_off,
    vzero_off,
    kresid_off,
    vresid_off,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    HKV: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BS: tl.constexpr,
    G: tl.constexpr,
    GV: tl.constexpr,
    BITS: tl.constexpr,
    RING: tl.constexpr,
    SINK: tl.constexpr,
    R: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.load(tok_seq_ptr + t)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len
    p = ctx + (t - q_start)  # this token's position
    ws = tl.maximum((p // G - RING + 1) * G, 0)  # this token's window start
    w0 = tl.maximum((ctx // G - RING + 1) * G, 0)  # the step's first window start
    S = G if SINK else 0

    h = tl.arange(0, BLOCK_H)
    h_ok = h < GROUP
    head = kvh * GROUP + h
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=h_ok[:, None],
        other=0.0,
    ).to(tl.float32)
    PER: tl.constexpr = 8 // BITS
    DP: tl.constexpr = HEAD_DIM // PER
    MASK: tl.constexpr = (1 << BITS) - 1
    NGV: tl.constexpr = HEAD_DIM // GV
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    for start in range(0, p + 1, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        ok = kpos <= p
        quant = ok & (kpos < ws) & (kpos >= S)
        resid = ok & ~quant
        blk = tl.load(block_tables_ptr + seq * stride_bt + kpos // BS, mask=ok, other=0)
        blk = blk.to(tl.int64)
        off = kpos % BS
        base8 = blk * kside
        base16 = blk * (kside // 2)
        vbase8 = blk * vside
        vbase16 = blk * (vside // 2)
        gj = off // G
        if SINK:
            slot = tl.where(gj == 0, 0, 1 + (gj - 1) % RING)
        else:
            slot = gj % RING
        rrow = slot * G + off % G  # the float16 row (KiviLayout.resid_row)
        # Codes: channel c of token kpos at byte c // PER, bits (c % PER) * BITS.
        code_at = base8[:, None] + ((off * HKV + kvh) * DP)[:, None] + (d // PER)[None, :]
        shift = ((d % PER) * BITS)[None, :]
        qm = quant[:, None]
        kc = (tl.load(k8_ptr + code_at, mask=qm, other=0).to(tl.int32) >> shift) & MASK
        gi = off // G
        kp = base16[:, None] + (((gi * HKV + kvh) * HEAD_DIM)[:, None] + d[None, :])
        ks = tl.load(k16_ptr + kp + scale_off // 2, mask=qm, other=0.0).to(tl.float32)
        kz = tl.load(k16_ptr + kp + kzero_off // 2, mask=qm, other=0.0).to(tl.float32)
        # Float16 rows: this step's (position >= ctx), the pre-store window
        # tail ([w0, ctx)) or a sink row of the cache (before w0).
        new = resid & (kpos >= ctx)
        old = resid & (kpos < ctx) & (kpos >= w0)
        snk = resid & (kpos < w0)
        n_at = ((q_start + kpos - ctx) * HKV + kvh)[:, None] * HEAD_DIM + d[None, :]
        t_at = ((seq * R + kpos - w0) * HKV + kvh)[:, None] * HEAD_DIM + d[None, :]
        s_at = ((rrow * HKV + kvh) * HEAD_DIM)[:, None] + d[None, :]
        nm, om, sm = new[:, None], old[:, None], snk[:, None]
        kr = tl.load(kn_ptr + n_at, mask=nm, other=0.0).to(tl.float32)
        kr += tl.load(kt_ptr + t_at, mask=om, other=0.0).to(tl.float32)
        kr += tl.load(k16_ptr + base16[:, None] + kresid_off // 2 + s_at, mask=sm, other=0.0).to(
            tl.float32
        )
        k = tl.where(qm, kc.to(tl.float32) * ks + kz, kr)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(ok[None, :], s, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        pexp = tl.exp2(s - m_new[:, None])
        pexp = tl.where(ok[None, :], pexp, 0.0)
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        vcode_at = vbase8[:, None] + ((off * HKV + kvh) * DP)[:, None] + (d // PER)[None, :]
        vc = (tl.load(v8_ptr + vcode_at, mask=qm, other=0).to(tl.int32) >> shift) & MASK
        vp = vbase16[:, None] + (((off * HKV + kvh) * NGV)[:, None] + (d // GV)[None, :])
        vs = tl.load(v16_ptr + vp + scale_off // 2, mask=qm, other=0.0).to(tl.float32)
        vz = tl.load(v16_ptr + vp + vzero_off // 2, mask=qm, other=0.0).to(tl.float32)
        vr = tl.load(vn_ptr + n_at, mask=nm, other=0.0).to(tl.float32)
        vr += tl.load(vt_ptr + t_at, mask=om, other=0.0).to(tl.float32)
        vr += tl.load(v16_ptr + vbase16[:, None] + vresid_off // 2 + s_at, mask=sm, other=0.0).to(
            tl.float32
        )
        v = tl.where(qm, vc.to(tl.float32) * vs + vz, vr)
        acc = acc * alpha[:, None] + tl.sum(pexp[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None],
    )


def kivi_paged_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_tails: torch.Tensor,
    v_tails: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    token_seq: torch.Tensor,
    lay: KiviLayout,
    scale: float,
) -> torch.Tensor:
    """``[T, Hq, D]`` attention of every new token over KIVI caches (``uint8
    [num_blocks, lay.k.nbytes]`` / ``lay.v.nbytes``, the step already stored).
    ``k_new``/``v_new`` ``[T, Hkv, D]``: the step's keys/values;
    ``k_tails``/``v_tails`` float16 ``[B, lay.residual_length, Hkv, D]``: per
    sequence, row ``r`` the float16 row of position ``w0 + r`` (``w0 =
    lay.window_start(ctx)``, for positions before ``ctx``), read before the
    store (``kernels.kivi.window_rows``); ``token_seq`` int32 ``[T]``: the
    sequence of each row of ``q``."""
    t_rows, hq, d = q.shape
    if d != lay.head_dim or d & (d - 1) or hq % lay.num_kv_heads:
        raise ValueError("kivi_paged_attention needs a power-of-two head size matching the layout")
    if k_cache.dtype != torch.uint8 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("kivi_paged_attention needs contiguous uint8 caches")
    out = torch.empty_like(q)
    if t_rows == 0:
        return out
    group = hq // lay.num_kv_heads
    _kivi_attn_kernel[(t_rows, lay.num_kv_heads)](
        q,
        out,
        k_cache,
        v_cache,
        k_cache.view(torch.float16),
        v_cache.view(torch.float16),
        k_new.to(torch.float16).contiguous(),
        v_new.to(torch.float16).contiguous(),
        k_tails.contiguous(),
        v_tails.contiguous(),
        block_tables,
        seq_lens,
        query_start_loc,
        token_seq,
        scale * _LOG2E,
        *lay.kernel_offsets(),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        HKV=lay.num_kv_heads,
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_H=max(2, next_pow2(group)),
        BLOCK_N=32,
        BS=lay.block_size,
        G=lay.group_size,
        GV=lay.value_group,
        BITS=lay.bits,
        RING=lay.ring_groups,
        SINK=lay.sink,
        R=lay.residual_length,
    )
    return out
