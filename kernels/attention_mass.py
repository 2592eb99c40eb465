"""Attention mass: how much softmax probability each cached key receives.

For KV policies that rank tokens by attention (H2O heavy hitters, R-KV,
the vote's mass scorer). A separate pass that recomputes the softmax rows of
one step's queries over their sequence's cached keys, so the attention
kernels themselves stay as they are; it runs only when a policy asks
(``AttentionMetadata.attn_mass``).

``out[i, p] += sum over this step's queries of sequence i, over query heads,
of softmax(q . k_p * scale)`` for every key position ``p`` the query sees
(causal: ``p <= query position``). Cache layout as in engine/attention/base.py.
:func:`attention_mass_ref` is the torch reference; :func:`attention_mass_triton`
the Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``), tested
against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl


def attention_mass_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Add each key's attention mass to ``out`` (float32 ``[B, >= max seq_len]``)."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    hq = q.shape[1]
    g = hq // hkv
    for i in range(len(seq_lens)):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        n, qlen = seq_lens[i], e - s
        if qlen == 0:
            continue
        ctx = n - qlen
        nblk = (n + bs - 1) // bs
        keys = k_cache.index_select(0, block_tables[i, :nblk].long()).reshape(-1, hkv, d)[:n]
        qq = q[s:e].float().view(qlen, hkv, g, d)
        scores = torch.einsum("qhgd,khd->hgqk", qq, keys.float()) * scale
        qpos = torch.arange(ctx, n, device=q.device)
        kpos = torch.arange(n, device=q.device)
        visible = kpos[None, :] <= qpos[:, None]  # [qlen, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[i, :n] += torch.softmax(scores, dim=-1).sum(dim=(0, 1, 2))


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _mass_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_ptr,
    tables_ptr,
    tok_seq_ptr,
    tok_pos_ptr,
    out_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ob,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (query token, query head): two passes over the visible
    # keys, the first for the row max and sum, the second adds the probabilities.
    t = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq = tl.load(tok_seq_ptr + t)
    pos = tl.load(tok_pos_ptr + t)
    dims = tl.arange(0, HEAD_DIM)
    qv = tl.load(q_ptr + t * stride_qt + h * stride_qh + dims).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    for start in range(0, pos + 1, BLOCK_N):
        kp = start + tl.arange(0, BLOCK_N)
        valid = kp <= pos
        blk = tl.load(tables_ptr + seq * stride_tb + kp // BLOCK_SIZE, mask=valid, other=0)
        kptr = k_ptr + blk[:, None] * stride_kb + (kp % BLOCK_SIZE)[:, None] * stride_ks
        kv = tl.load(kptr + kvh * stride_kh + dims[None, :], mask=valid[:, None], other=0.0)
        s = tl.sum(kv.to(tl.float32) * qv[None, :], axis=1) * scale
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new), axis=0)
        m_i = m_new
    for start in range(0, pos + 1, BLOCK_N):
        kp = start + tl.arange(0, BLOCK_N)
        valid = kp <= pos
        blk = tl.load(tables_ptr + seq * stride_tb + kp // BLOCK_SIZE, mask=valid, other=0)
        kptr = k_ptr + blk[:, None] * stride_kb + (kp % BLOCK_SIZE)[:, None] * stride_ks
        kv = tl.load(kptr + kvh * stride_kh + dims[None, :], mask=valid[:, None], other=0.0)
        s = tl.sum(kv.to(tl.float32) * qv[None, :], axis=1) * scale
        p = tl.where(valid, tl.exp(s - m_i) / l_i, 0.0)
        tl.atomic_add(out_ptr + seq * stride_ob + kp, p, mask=valid)


def attention_mass_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """:func:`attention_mass_ref` as one Triton launch (``out`` float32, contiguous rows)."""
    t_total, hq, d = q.shape
    if t_total == 0:
        return
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    # Each query row's sequence and position, vectorised (no loop over tokens):
    # row j of sequence i is at seq_lens[i] - qlen_i + (j - start_i).
    starts = torch.tensor(list(query_start_loc), dtype=torch.int64)
    qlens = starts[1:] - starts[:-1]
    tok_seq64 = torch.repeat_interleave(torch.arange(len(seq_lens)), qlens)
    offset = torch.tensor(list(seq_lens), dtype=torch.int64) - qlens - starts[:-1]
    tok_pos64 = torch.arange(int(starts[-1])) + offset[tok_seq64]
    tok_seq = tok_seq64.to(device=q.device, dtype=torch.int32)
    tok_pos = tok_pos64.to(device=q.device, dtype=torch.int32)
    qc = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    _mass_kernel[(t_total, hq)](
        qc,
        k_cache,
        tables,
        tok_seq,
        tok_pos,
        out,
        scale,
        qc.stride(0),
        qc.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        out.stride(0),
        GROUP=hq // hkv,
        BLOCK_SIZE=bs,
        HEAD_DIM=d,
        BLOCK_N=16,
    )
