"""KIVI 2-/4-bit paged KV blocks: the layout, the store, and the torch reference.

KIVI (Liu et al., ICML 2024) quantizes keys *per channel* (one scale and zero
point per channel over a group of ``G`` tokens: key outliers live in fixed
channels) and values *per token* (one scale and zero point per group of
channels of one token), asymmetric min/max, and keeps the newest tokens in
full precision.

Block layout (one block, one layer, one side: K or V), ``side_nbytes`` bytes,
row ``block_id`` of a ``uint8 [num_blocks, side_nbytes]`` cache tensor:

====================  =========================================  ==================
part                  shape                                      dtype
====================  =========================================  ==================
codes                 ``[bs, Hkv, D * bits / 8]``                 uint8, packed
                      (channel ``c`` of a token in byte ``c // per``, bits
                      ``(c % per) * bits``; ``per = 8 // bits``)
scale, zero           keys: ``[bs / G, Hkv, D]`` (per group,       float16
                      per channel); values: ``[bs, Hkv, D / Gv]``
                      (per token, per channel group); each padded
                      to the larger of the two
residual              ``[G, Hkv, D]``: the block's newest,         float16
                      not-yet-quantized group, row ``t % G``
====================  =========================================  ==================

Who owns the residual: each block owns the full-precision (float16) rows of
its *current group*: tokens are written there first; when a group's last token
(offset ``% G == G - 1``) is stored, the whole group is quantized into the
block's codes and scales, in place. ``G`` divides the block size, so a block
that becomes full has quantized its last group in that same store: a full
block, the only kind that is hashed and shared, never changes afterwards.
The residual rows of a full block keep its last group's float16 values (a
deterministic function of the tokens, so equal prefixes have equal bytes).

What a query reads (the rule every kernel implements, and why it is a
function of positions only): the query at position ``p`` reads tokens of the
groups before its own, ``t < G * (p // G)``, from codes, and the tokens of its
own group, ``G * (p // G) <= t <= p``, at float16. Whatever the chunking,
batching or prefix-cache history, each (query, key) pair sees the same
values, so outputs are identical alone, batched, chunked and from the prefix
cache. The residual window is therefore the query's own group: 1..G tokens.

Quantization (the only implementation; every backend stores through it):
over the float16 values of a group, ``lo = min``, ``hi = max`` (float32);
``scale = fp16((hi - lo) / levels)``, ``zero = fp16(lo)``; code ``=
clamp(round_half_even((x - zero) / scale), 0, levels)`` (0 where scale is 0);
dequantized ``code * scale + zero``. The error bound per element is
``scale / 2`` plus the float16 rounding of ``zero`` (tests check it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KiviLayout:
    """One KIVI block layout; ``side_nbytes`` bytes per block per layer per side."""

    bits: int  # 2 or 4
    group_size: int  # G: tokens per key group (and the residual group)
    value_group: int  # Gv: channels per value group
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"KIVI bits must be 2 or 4, got {self.bits}")
        if self.block_size % self.group_size:
            raise ValueError(
                f"KIVI group size {self.group_size} must divide the block size {self.block_size}"
            )
        if self.head_dim % self.value_group or self.head_dim % (8 // self.bits):
            raise ValueError(
                f"head size {self.head_dim} must be a multiple of the value group "
                f"{self.value_group} and of {8 // self.bits}"
            )

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def packed_dim(self) -> int:
        return self.head_dim // self.per_byte

    @property
    def codes_nbytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.packed_dim

    @property
    def key_param_elems(self) -> int:
        return (self.block_size // self.group_size) * self.num_kv_heads * self.head_dim

    @property
    def value_param_elems(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_dim // self.value_group)

    @property
    def param_elems(self) -> int:
        """float16 elements of one of scale/zero (the larger side's count)."""
        return max(self.key_param_elems, self.value_param_elems)

    @property
    def resid_elems(self) -> int:
        return self.group_size * self.num_kv_heads * self.head_dim

    @property
    def scale_offset(self) -> int:
        # Rounded up to 16 bytes so every float16 part is aligned for the kernels.
        return -(-self.codes_nbytes // 16) * 16

    @property
    def zero_offset(self) -> int:
        return self.scale_offset + 2 * self.param_elems

    @property
    def resid_offset(self) -> int:
        return self.zero_offset + 2 * self.param_elems

    @property
    def side_nbytes(self) -> int:
        return self.resid_offset + 2 * self.resid_elems


@dataclass
class KiviSide:
    """Typed views of one side (K or V) of a ``uint8 [NB, side_nbytes]`` cache."""

    codes: torch.Tensor  # uint8 [NB, bs, H, Dp]
    scale: torch.Tensor  # float16 keys [NB, bs/G, H, D]; values [NB, bs, H, D/Gv]
    zero: torch.Tensor
    resid: torch.Tensor  # float16 [NB, G, H, D]


def side_views(cache: torch.Tensor, lay: KiviLayout, keys: bool) -> KiviSide:
    """Views (no copies) of a KIVI side cache; writes through them land in ``cache``."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != lay.side_nbytes:
        raise ValueError(f"a KIVI cache is uint8 [num_blocks, {lay.side_nbytes}]")
    h, d, bs, g = lay.num_kv_heads, lay.head_dim, lay.block_size, lay.group_size
    pshape = (bs // g, h, d) if keys else (bs, h, d // lay.value_group)
    pn = lay.key_param_elems if keys else lay.value_param_elems
    nb = int(cache.shape[0])

    def half(off: int, n: int, shape: tuple[int, ...]) -> torch.Tensor:
        return cache[:, off : off + 2 * n].view(torch.float16).view(nb, *shape)

    return KiviSide(
        codes=cache[:, : lay.codes_nbytes].view(nb, bs, h, lay.packed_dim),
        scale=half(lay.scale_offset, pn, pshape),
        zero=half(lay.zero_offset, pn, pshape),
        resid=half(lay.resid_offset, lay.resid_elems, (g, h, d)),
    )


# ---------------------------------------------------------------- quantization


def _minmax_quant(
    x: torch.Tensor, dim: int, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of float16 ``x`` along ``dim``: (codes
    uint8 shaped like x, scale and zero float16 with ``dim`` reduced)."""
    xf = x.float()
    lo = xf.amin(dim)
    hi = xf.amax(dim)
    scale = ((hi - lo) / levels).half()
    zero = lo.half()
    s = scale.float().unsqueeze(dim)
    z = zero.float().unsqueeze(dim)
    q = torch.where(s > 0, torch.round((xf - z) / torch.where(s > 0, s, 1.0)), 0.0)
    return q.clamp_(0, levels).to(torch.uint8), scale, zero


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` -> ``[..., D * bits / 8]`` (channel ``c`` at bits ``(c % per) * bits``)."""
    per = 8 // bits
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``[..., Dp]`` uint8 -> ``[..., Dp * 8 / bits]`` uint8."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def quantize_key_groups(
    x: torch.Tensor, lay: KiviLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key groups float16 ``[n, G, H, D]`` -> packed codes ``[n, G, H, Dp]``, scale
    and zero ``[n, H, D]`` (per channel over the group's tokens)."""
    codes, scale, zero = _minmax_quant(x, 1, lay.levels)
    return pack_codes(codes, lay.bits), scale, zero


def quantize_value_groups(
    x: torch.Tensor, lay: KiviLayout
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Value tokens float16 ``[..., H, D]`` -> packed codes ``[..., H, Dp]``, scale
    and zero ``[..., H, D / Gv]`` (per token, per group of channels)."""
    grouped = x.reshape(*x.shape[:-1], x.shape[-1] // lay.value_group, lay.value_group)
    codes, scale, zero = _minmax_quant(grouped, -1, lay.levels)
    return pack_codes(codes.flatten(-2), lay.bits), scale, zero


def dequantize_blocks(
    side: KiviSide, blocks: torch.Tensor, lay: KiviLayout, keys: bool
) -> torch.Tensor:
    """float32 ``[n * bs, H, D]``: the codes of ``blocks`` (int64 ``[n]``) dequantized.

    Only meaningful for tokens of complete groups (the others' codes are stale
    or zero). The reference path: one sequence's blocks at a time.
    """
    codes = unpack_codes(side.codes.index_select(0, blocks), lay.bits).float()
    scale = side.scale.index_select(0, blocks).float()
    zero = side.zero.index_select(0, blocks).float()
    if keys:
        scale = scale.repeat_interleave(lay.group_size, dim=1)
        zero = zero.repeat_interleave(lay.group_size, dim=1)
    else:
        scale = scale.repeat_interleave(lay.value_group, dim=-1)
        zero = zero.repeat_interleave(lay.value_group, dim=-1)
    return (codes * scale + zero).flatten(0, 1)


# ---------------------------------------------------------------- the store


@dataclass
class KiviStorePlan:
    """Where one step's new tokens go; the same for every layer (built once per step).

    ``resid_rows``: rows of the step's k/v written to residual rows
    ``(resid_block, resid_row)``: every stored token except those whose block
    row is taken, in this same step, by a later group of the same block (that
    row then holds the later token, as it would after token-by-token decode;
    excluding it keeps the scatter free of duplicate indices).
    ``group_*``: the groups that complete in this step; ``group_src`` int64
    ``[n, G]`` is the step row of each of their tokens, -1 for tokens stored in
    an earlier step (read from the block's residual before it is overwritten).
    """

    resid_rows: torch.Tensor
    resid_block: torch.Tensor
    resid_row: torch.Tensor
    group_block: torch.Tensor
    group_index: torch.Tensor  # group within the block
    group_src: torch.Tensor

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, lay: KiviLayout) -> KiviStorePlan:
        sm = slot_mapping.long()
        g, bs = lay.group_size, lay.block_size
        n = int(sm.shape[0])
        valid = sm >= 0
        superseded = torch.zeros(n, dtype=torch.bool, device=sm.device)
        if n > g:
            # Rows of one sequence are consecutive: row i + G is the same block row
            # exactly when its slot is slot_i + G inside the same block.
            later = sm[g:]
            superseded[:-g] = valid[:-g] & (later == sm[:-g] + g) & (later // bs == sm[:-g] // bs)
        rows = torch.nonzero(valid & ~superseded).squeeze(1)
        done = torch.nonzero(valid & (sm % g == g - 1)).squeeze(1)
        last = sm[done]
        offs = torch.arange(g, device=sm.device, dtype=torch.int64)
        src = done[:, None] - (g - 1) + offs
        want = last[:, None] - (g - 1) + offs
        ok = (src >= 0) & (sm[src.clamp(min=0)] == want)
        return cls(
            resid_rows=rows,
            resid_block=sm[rows] // bs,
            resid_row=sm[rows] % g,
            group_block=last // bs,
            group_index=(last % bs) // g,
            group_src=torch.where(ok, src, -1),
        )


def kivi_store(
    k: torch.Tensor,
    v: torch.Tensor,
    ks: KiviSide,
    vs: KiviSide,
    plan: KiviStorePlan,
    lay: KiviLayout,
) -> None:
    """Store a step's new keys/values ``[T, H, D]`` into KIVI caches (views
    ``ks``/``vs``, see module doc): complete groups are quantized (from this
    step's rows and the block's residual rows of earlier steps), then the
    residual rows are written."""
    k16, v16 = k.to(torch.float16), v.to(torch.float16)
    g = lay.group_size
    ng = int(plan.group_block.shape[0])
    if ng:
        src = plan.group_src
        have = (src >= 0)[:, :, None, None]
        take = src.clamp(min=0)
        gk = torch.where(have, k16[take], ks.resid[plan.group_block])  # [ng, G, H, D]
        gv = torch.where(have, v16[take], vs.resid[plan.group_block])
        codes, scale, zero = quantize_key_groups(gk, lay)
        tok = plan.group_index[:, None] * g + torch.arange(g, device=src.device)  # [ng, G]
        blk = plan.group_block[:, None].expand(ng, g)
        ks.codes.index_put_((blk, tok), codes)
        ks.scale.index_put_((plan.group_block, plan.group_index), scale)
        ks.zero.index_put_((plan.group_block, plan.group_index), zero)
        vcodes, vscale, vzero = quantize_value_groups(gv, lay)
        vs.codes.index_put_((blk, tok), vcodes)
        vs.scale.index_put_((blk, tok), vscale)
        vs.zero.index_put_((blk, tok), vzero)
    rows = plan.resid_rows
    if rows.numel():
        ks.resid.index_put_((plan.resid_block, plan.resid_row), k16[rows])
        vs.resid.index_put_((plan.resid_block, plan.resid_row), v16[rows])


# ---------------------------------------------------------------- the reference


def kivi_attention_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    ks: KiviSide,
    vs: KiviSide,
    blocks: torch.Tensor,
    seq_len: int,
    k_tail_old: torch.Tensor,
    v_tail_old: torch.Tensor,
    lay: KiviLayout,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over a KIVI cache (reference).

    ``q`` ``[n, Hq, D]``, ``k_new``/``v_new`` ``[n, H, D]`` are the tokens at
    positions ``seq_len - n .. seq_len - 1``, already stored (the complete
    groups' codes are read from the cache views ``ks``/``vs``). ``blocks``: the sequence's block
    ids (int64). ``k_tail_old``/``v_tail_old`` ``[G, H, D]`` float16: the residual
    rows of the block holding position ``ctx = seq_len - n`` *as they were
    before the store* (only rows ``< ctx % G`` are read). Returns ``[n, Hq, D]``
    in ``q``'s dtype, computed in float32. Per-sequence dequantization of the
    sequence's own blocks (the reference, not a fast path).
    """
    g, bs = lay.group_size, lay.block_size
    n = int(q.shape[0])
    ctx = seq_len - n
    t0 = (ctx // g) * g  # first float16 position any query reads
    nq = ((seq_len - 1) // g) * g  # quantized positions any query reads: [0, nq)
    fp_k = torch.cat([k_tail_old[: ctx - t0].float(), k_new.to(torch.float16).float()])
    fp_v = torch.cat([v_tail_old[: ctx - t0].float(), v_new.to(torch.float16).float()])
    if nq:
        nblk = -(-nq // bs)
        dq_k = dequantize_blocks(ks, blocks[:nblk], lay, True)[:nq]
        dq_v = dequantize_blocks(vs, blocks[:nblk], lay, False)[:nq]
        kk, vv = torch.cat([dq_k, fp_k]), torch.cat([dq_v, fp_v])
    else:
        kk, vv = fp_k, fp_v
    qpos = torch.arange(ctx, seq_len, device=q.device)
    gstart = (qpos // g) * g
    kq = torch.arange(nq, device=q.device)
    kf = torch.arange(t0, seq_len, device=q.device)
    mask = torch.cat(
        [
            kq[None, :] < gstart[:, None],
            (kf[None, :] >= gstart[:, None]) & (kf[None, :] <= qpos[:, None]),
        ],
        dim=1,
    )
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),
        kk.transpose(0, 1).unsqueeze(0),
        vv.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(0).transpose(0, 1).to(q.dtype)


def kivi_attention_dense_ref(
    q: torch.Tensor,
    k_fp16: torch.Tensor,
    v_fp16: torch.Tensor,
    lay: KiviLayout,
    scale: float,
    ctx: int,
) -> torch.Tensor:
    """The KIVI read rule from scratch, on a whole sequence's float16 keys/values
    ``[L, H, D]`` (no cache, no pages): every query ``p >= ctx`` reads the
    groups before its own quantized-dequantized and its own group as is. The
    independent reference the paged paths are tested against."""
    g = lay.group_size
    seq_len = int(k_fp16.shape[0])
    full = (seq_len // g) * g
    kq = k_fp16[:full].reshape(full // g, g, *k_fp16.shape[1:])
    codes, s, z = quantize_key_groups(kq, lay)
    dk = unpack_codes(codes, lay.bits).float() * s.float()[:, None] + z.float()[:, None]
    vcodes, vs_, vz = quantize_value_groups(v_fp16[:full], lay)
    dv = (
        unpack_codes(vcodes, lay.bits)
        .float()
        .reshape(*vcodes.shape[:-1], lay.head_dim // lay.value_group, lay.value_group)
        * vs_.float()[..., None]
        + vz.float()[..., None]
    ).flatten(-2)
    outs = []
    for p in range(ctx, seq_len):
        gs = (p // g) * g
        kk = torch.cat([dk.flatten(0, 1)[:gs], k_fp16[gs : p + 1].float()])
        vv = torch.cat([dv[:gs], v_fp16[gs : p + 1].float()])
        o = F.scaled_dot_product_attention(
            q[p - ctx].float()[:, None, :].unsqueeze(0),
            kk.transpose(0, 1).unsqueeze(0),
            vv.transpose(0, 1).unsqueeze(0),
            scale=scale,
            enable_gqa=True,
        )
        outs.append(o.squeeze(0).squeeze(1))
    return torch.stack(outs)
