"""Attention over the paged KV cache for a mixed batch of decodes and extends.

Layout (see ``engine/attention/base.py``): q ``[T, Hq, D]`` holds the new tokens
of ``B`` sequences back to back; sequence ``i`` owns rows
``query_start_loc[i]:query_start_loc[i + 1]`` and, after this step, has
``seq_lens[i]`` tokens whose keys/values are already in the cache
``[num_blocks, block_size, Hkv, D]`` (the caller stores the new ones first).
The first ``num_decodes`` sequences have exactly one new token each.

A new token at absolute position ``p`` attends to cached positions ``0..p``:
full attention over the prefix written by earlier steps, causal within the new
chunk.

The Triton version is one kernel launched twice: once over the decode
sequences with the context split across ``num_splits`` programs per (sequence,
kv head) followed by a small reduction kernel (flash-decoding), and once over
the extend sequences, each cut into tiles of query tokens. A program always
handles every q head of one kv head (grouped-query attention), so the keys and
values it loads are shared by the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_launchable, needs_fp32_dot, next_pow2

# Log2(e): the kernels use exp2, so scores are pre-scaled by scale * LOG2E.
_LOG2E = 1.4426950408889634
# Upper bound on decode splits: the partial buffers grow linearly with it and
# beyond this the reduction pass costs more than the extra parallelism buys.
_MAX_KV_SPLITS = 64
# A split shorter than this many tokens does too little work to pay for its
# partial-result write and the reduction.
_MIN_SPLIT_TOKENS = 256


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _attn_kernel(  # type: ignore[no-untyped-def]
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    qk_scale,
    seq_offset,
    block_size,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """One program: BLOCK_Q new tokens x all GROUP q heads of one kv head, one split.

    Grid: (sequences of this launch, query tiles * NUM_SPLITS, kv heads). Rows of
    the score tile are (token, head) pairs: row r is token ``r // BLOCK_H`` of
    the tile and head ``r % BLOCK_H`` of the group. With NUM_SPLITS > 1 the
    program writes its normalised partial output and its log2-sum-exp to the
    partial buffers, indexed by token row, for the reduction kernel.
    """
    seq = seq_offset + tl.program_id(0)
    q_tile = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kvh = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len
    tile_q0 = q_tile * BLOCK_Q

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = tile_q0 + rows // BLOCK_H
    hi = rows % BLOCK_H
    row_ok = (qi < q_len) & (hi < GROUP)
    head = kvh * GROUP + hi
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    tok = q_start + qi
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = ctx_len + qi

    # Keys this tile can see end at its last token's position (causal); a tile
    # past the sequence's query length gets an empty range and stores nothing.
    kv_end = tl.minimum(seq_len, ctx_len + tile_q0 + BLOCK_Q)
    kv_end = tl.where(tile_q0 < q_len, kv_end, 0)
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi_end = tl.minimum(lo + chunk, kv_end)

    if UPCAST_DOT:
        q = q.to(tl.float32)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_Q * BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < hi_end
        blk = tl.load(block_tables_ptr + seq * stride_bt + kpos // block_size, mask=k_ok, other=0)
        off = kpos % block_size
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_cache_ptr
            + blk[:, None].to(tl.int64) * stride_kb
            + off[:, None] * stride_ks
            + kvh * stride_kh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr
            + blk[:, None].to(tl.int64) * stride_vb
            + off[:, None] * stride_vs
            + kvh * stride_vh
            + d[None, :],
            mask=kv_mask,
            other=0.0,
        )
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        visible = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Rows with nothing visible in this split keep l_i == 0: divide by 1 instead
    # and give them lse -inf so the reduction weighs them 0.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        tl.store(
            part_out_ptr
            + tok[:, None] * stride_pt
            + head[:, None] * stride_ph
            + split * stride_ps
            + d[None, :],
            o,
            mask=out_mask,
        )
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit  # type: ignore[untyped-decorator,misc,unused-ignore]
def _reduce_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_lt,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Combine the per-split partial outputs of one (decode token, q head)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + t * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        part_out_ptr + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + t * stride_ot + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def choose_num_kv_splits(
    max_seq_len: int,
    num_decodes: int,
    num_kv_heads: int,
    device: torch.device,
    kv_split_size: int | None = None,
) -> int:
    """How many programs share one decode sequence's context (1 = no split).

    With ``kv_split_size`` the context is cut into pieces of about that many
    tokens (tests use it to force the split path). Otherwise, on CUDA, split only
    when ``num_decodes * num_kv_heads`` programs would leave SMs idle: aim for two
    programs per SM, never below ``_MIN_SPLIT_TOKENS`` tokens a split. Off CUDA
    (the interpreter) there is no parallelism to gain.
    """
    if kv_split_size is not None:
        if kv_split_size < 1:
            raise ValueError(f"kv_split_size must be positive, got {kv_split_size}")
        return max(1, min(int(triton.cdiv(max_seq_len, kv_split_size)), _MAX_KV_SPLITS))
    if device.type != "cuda" or num_decodes == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = int(triton.cdiv(2 * sms, num_decodes * num_kv_heads))
    by_length = int(triton.cdiv(max_seq_len, _MIN_SPLIT_TOKENS))
    return max(1, min(wanted, by_length, _MAX_KV_SPLITS))


def _validate(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_decodes: int,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and caches [blocks, block_size, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"q heads {hq} x {d} do not fit cache heads {hkv} x {k_cache.shape[3]}")
    b = seq_lens.shape[0]
    if query_start_loc.shape[0] != b + 1 or block_tables.shape[0] < b:
        raise ValueError("query_start_loc must have B + 1 entries and block_tables B rows")
    if not 0 <= num_decodes <= b:
        raise ValueError(f"num_decodes {num_decodes} outside [0, {b}]")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_decodes: int,
    out: torch.Tensor | None = None,
    *,
    kv_split_size: int | None = None,
) -> torch.Tensor:
    """Attention of every new token over its sequence's cache (Triton).

    Args:
        q: ``[T, Hq, D]`` new-token queries (fp32/fp16/bf16).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, already holding
            the new tokens' keys/values. ``Hq`` must be a multiple of ``Hkv``.
        block_tables: int32 ``[B, max_blocks]``.
        seq_lens: int32 ``[B]``, tokens per sequence including the new ones.
        query_start_loc: int32 ``[B + 1]``.
        max_query_len: the largest query length (sizes the extend grid; may
            exceed the true maximum, e.g. under CUDA graphs).
        max_seq_len: the largest ``seq_lens`` entry (or an upper bound); picks
            the number of decode splits.
        scale: softmax scale.
        num_decodes: the first ``num_decodes`` sequences have query length 1.
        out: optional ``[T, Hq, D]`` output buffer (written in place, returned).
        kv_split_size: force decode split-K with about this many tokens per split.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype (``out`` if given). Scores and the
        softmax accumulate in fp32; q is cast to the cache dtype for the dot.
    """
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_decodes)
    check_launchable(_attn_kernel, q, k_cache)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with contiguous last dim")
    num_tokens, hq, head_dim = q.shape
    hkv = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = hq // hkv
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    on_cuda = q.device.type == "cuda"
    block_d = max(16, next_pow2(head_dim))
    upcast = needs_fp32_dot(k_cache)
    ieee = k_cache.dtype == torch.float32 or upcast
    # Larger key tiles on the GPU (bandwidth); small ones in the interpreter so
    # tests cross tile and block boundaries at tiny sizes.
    block_n = (64 if block_d <= 128 else 32) if on_cuda else 16
    num_warps = 4 if block_d <= 64 else 8
    common = dict(
        qk_scale=scale * _LOG2E,
        block_size=block_size,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_kb=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_bt=block_tables.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        UPCAST_DOT=upcast,
        IEEE_DOT=ieee,
        num_warps=num_warps,
    )

    if num_decodes:
        splits = choose_num_kv_splits(max_seq_len, num_decodes, hkv, q.device, kv_split_size)
        # tl.dot needs at least 16 rows: pad the head group, not the tokens.
        block_h = max(16, next_pow2(group))
        if splits > 1:
            part_out = torch.empty(
                (num_decodes, hq, splits, head_dim), dtype=torch.float32, device=q.device
            )
            part_lse = torch.empty((num_decodes, hq, splits), dtype=torch.float32, device=q.device)
        else:
            # Unused by the kernel when NUM_SPLITS == 1; any fp32 tensor will do.
            part_out = part_lse = out
        _attn_kernel[(num_decodes, splits, hkv)](
            q,
            k_cache,
            v_cache,
            out,
            part_out,
            part_lse,
            block_tables,
            seq_lens,
            query_start_loc,
            seq_offset=0,
            stride_pt=part_out.stride(0),
            stride_ph=part_out.stride(1),
            stride_ps=part_out.stride(2) if splits > 1 else 0,
            stride_lt=part_lse.stride(0),
            stride_lh=part_lse.stride(1),
            BLOCK_H=block_h,
            BLOCK_Q=1,
            NUM_SPLITS=splits,
            **common,
        )
        if splits > 1:
            _reduce_splits_kernel[(num_decodes, hq)](
                out,
                part_out,
                part_lse,
                out.stride(0),
                out.stride(1),
                part_out.stride(0),
                part_out.stride(1),
                part_out.stride(2),
                part_lse.stride(0),
                part_lse.stride(1),
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=splits,
                BLOCK_S=next_pow2(splits),
                num_warps=4,
            )

    num_extends = num_seqs - num_decodes
    if num_extends:
        block_h = next_pow2(group)
        # About 64 (token, head) rows a program on the GPU; 16 (tl.dot's minimum)
        # in the interpreter so tests exercise several query tiles cheaply.
        target_rows = 64 if on_cuda else 16
        block_q = max(1, target_rows // block_h)
        if block_q * block_h < 16:
            block_q = 16 // block_h
        q_tiles = triton.cdiv(max(max_query_len, 1), block_q)
        _attn_kernel[(num_extends, q_tiles, hkv)](
            q,
            k_cache,
            v_cache,
            out,
            out,
            out,
            block_tables,
            seq_lens,
            query_start_loc,
            seq_offset=num_decodes,
            stride_pt=0,
            stride_ph=0,
            stride_ps=0,
            stride_lt=0,
            stride_lh=0,
            BLOCK_H=block_h,
            BLOCK_Q=block_q,
            NUM_SPLITS=1,
            **common,
        )
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_decodes: int,
    out: torch.Tensor | None = None,
    *,
    kv_split_size: int | None = None,
) -> torch.Tensor:
    """Plain-torch reference of :func:`paged_attention`, one sequence at a time.

    Same contract. It also checks what the kernel trusts: the first
    ``num_decodes`` query lengths are 1, and ``max_query_len``/``max_seq_len``
    bound the real lengths. ``kv_split_size`` only changes how the kernel divides
    work, so here it is just validated. Computes in fp32, returns q's dtype.
    """
    _validate(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, num_decodes)
    if kv_split_size is not None and kv_split_size < 1:
        raise ValueError(f"kv_split_size must be positive, got {kv_split_size}")
    res = torch.empty_like(q) if out is None else out
    hq, head_dim = q.shape[1], q.shape[2]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        qlen = e - s
        if i < num_decodes and qlen != 1:
            raise ValueError(f"sequence {i} is a decode but has query length {qlen}")
        if qlen > max_query_len or seq_len > max_seq_len or qlen > seq_len:
            raise ValueError(f"sequence {i}: lengths ({qlen}, {seq_len}) break the stated bounds")
        if qlen == 0:
            continue
        nblk = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :nblk].long()
        kk = k_cache[blocks].reshape(-1, hkv, head_dim)[:seq_len].float()
        vv = v_cache[blocks].reshape(-1, hkv, head_dim)[:seq_len].float()
        kk = kk.repeat_interleave(group, dim=1)
        vv = vv.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), kk) * scale
        qpos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        kpos = torch.arange(seq_len, device=q.device)
        scores = scores.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        res[s:e] = torch.einsum("hqk,khd->qhd", probs, vv).to(res.dtype)
    return res
