"""KIVI 2-/4-bit paged KV blocks: the layout, the store, and the torch reference.

KIVI (Liu et al., ICML 2024) quantizes keys *per channel* (one scale and zero
point per channel over a group of ``G`` tokens: key outliers live in fixed
channels) and values *per token* (one scale and zero point per group of
channels of one token), asymmetric min/max, and keeps the newest tokens in
full precision. Here the newest tokens are a window of ``m`` groups
(``--kivi-residual-length = m * G``), and optionally the sequence's first
group too (attention sinks, as StreamingLLM keeps them).

Block layout (one block, one layer, one side: K or V). The two sides are rows
of two ``uint8 [num_blocks, nbytes]`` cache tensors whose sizes differ (keys
carry a scale per channel per group, values per channel group per token):

====================  =========================================  ==================
part                  shape                                      dtype
====================  =========================================  ==================
codes                 ``[bs, Hkv, D * bits / 8]``                 uint8, packed
                      (channel ``c`` of a token in byte ``c // per``, bits
                      ``(c % per) * bits``; ``per = 8 // bits``)
scale, zero           keys: ``[bs / G, Hkv, D]`` (per group,       float16
                      per channel); values: ``[bs, Hkv, D / Gv]``
                      (per token, per channel group)
float16 slots         ``[slots * G, Hkv, D]``: group slots of      float16
                      float16 rows (``slots = m``, plus one with
                      sinks); group ``j`` of the block sits in
                      slot ``slot_of_group(j)``
====================  =========================================  ==================

Who owns the float16 rows: each block owns the float16 rows of its groups,
in its slots. With sinks, slot 0 holds the block's first group for good and
groups ``j >= 1`` rotate through slots ``1 .. m`` (``1 + (j - 1) % m``);
without, group ``j`` is in slot ``j % m``. Every token is written there
first; when a group's last token (offset ``% G == G - 1``) is stored, the
whole group is also quantized into the block's codes and scales, in place.
``G`` divides the block size, so a block that becomes full has quantized its
last group in that same store: a full block, the only kind that is hashed and
shared, never changes afterwards. Its slots keep its first group (sinks) and
its last ``m`` groups at float16: a deterministic function of its tokens, so
equal prefixes have equal bytes.

What a query reads (the rule every kernel implements, and why it is a
function of positions only): the query at position ``p`` reads token ``t <=
p`` at float16 when ``t >= window_start(p) = max(0, G * (p // G - m + 1))``
(its own group and the ``m - 1`` before it) or ``t < sink_tokens`` (``G``
with sinks, else 0), and from codes otherwise. A window token's group is
fewer than ``m`` groups behind the query's, so no later group of its block
has taken its slot yet; the window reaches back at most into the previous
block, whose slots (it is full) hold its last ``m`` groups. Whatever the
chunking, batching or prefix-cache history, each (query, key) pair sees the
same values, so outputs are identical alone, batched, chunked and from the
prefix cache. (A prefix hit that ends inside a block would inherit another
sequence's slots: with ``m > 1`` the engine takes whole-block hits only.)

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
class KiviSideLayout:
    """Byte offsets of one side (K or V) of a block; ``nbytes`` per block per layer."""

    param_elems: int  # float16 elements of each of scale and zero
    scale_offset: int
    zero_offset: int
    resid_offset: int
    nbytes: int


@dataclass(frozen=True)
class KiviLayout:
    """One KIVI block layout (see the module doc for the parts and the read rule)."""

    bits: int  # 2 or 4
    group_size: int  # G: tokens per key group (and per float16 slot)
    value_group: int  # Gv: channels per value group
    block_size: int
    num_kv_heads: int
    head_dim: int
    ring_groups: int = 1  # m: the float16 window is the query's group and m - 1 before it
    sink: bool = False  # the sequence's first group stays float16 for every query

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
        if self.ring_groups < 1 or self.slots * self.group_size > self.block_size:
            raise ValueError(
                f"KIVI float16 window of {self.ring_groups} group(s) of {self.group_size}"
                f"{' plus the sink group' if self.sink else ''} must fit in a block of "
                f"{self.block_size} tokens"
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
    def slots(self) -> int:
        """float16 group slots per block."""
        return self.ring_groups + int(self.sink)

    @property
    def sink_tokens(self) -> int:
        return self.group_size if self.sink else 0

    @property
    def residual_length(self) -> int:
        """Longest float16 window a query reads (``m * G``, sinks not counted)."""
        return self.ring_groups * self.group_size

    def slot_of_group(self, j: torch.Tensor) -> torch.Tensor:
        """Slot of group ``j`` (within its block, any integer tensor)."""
        m = self.ring_groups
        if self.sink:
            return torch.where(j == 0, 0, 1 + (j - 1).remainder(m))
        return j.remainder(m)

    def resid_row(self, offset: torch.Tensor) -> torch.Tensor:
        """float16 row of the token at ``offset`` (within its block)."""
        g = self.group_size
        return self.slot_of_group(offset // g) * g + offset % g

    def window_start(self, p: int) -> int:
        """First position of the float16 window of the query at ``p``."""
        g = self.group_size
        return max(0, g * (p // g - self.ring_groups + 1))

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
    def resid_elems(self) -> int:
        return self.slots * self.group_size * self.num_kv_heads * self.head_dim

    def _side(self, param_elems: int) -> KiviSideLayout:
        # Rounded up to 16 bytes so every float16 part is aligned for the kernels.
        scale = -(-self.codes_nbytes // 16) * 16
        zero = scale + 2 * param_elems
        resid = -(-(zero + 2 * param_elems) // 16) * 16
        return KiviSideLayout(param_elems, scale, zero, resid, resid + 2 * self.resid_elems)

    @property
    def k(self) -> KiviSideLayout:
        return self._side(self.key_param_elems)

    @property
    def v(self) -> KiviSideLayout:
        return self._side(self.value_param_elems)

    def side(self, keys: bool) -> KiviSideLayout:
        return self.k if keys else self.v

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer, both sides."""
        return self.k.nbytes + self.v.nbytes

    def kernel_offsets(self) -> tuple[int, int, int, int, int, int, int]:
        """The byte sizes and offsets the native and Triton kernels take, in their
        order: key row, value row, scales (both sides), key zeros, value zeros,
        key slots, value slots."""
        k, v = self.k, self.v
        return (
            k.nbytes,
            v.nbytes,
            k.scale_offset,
            k.zero_offset,
            v.zero_offset,
            k.resid_offset,
            v.resid_offset,
        )


@dataclass
class KiviSide:
    """Typed views of one side (K or V) of a ``uint8 [NB, nbytes]`` cache."""

    codes: torch.Tensor  # uint8 [NB, bs, H, Dp]
    scale: torch.Tensor  # float16 keys [NB, bs/G, H, D]; values [NB, bs, H, D/Gv]
    zero: torch.Tensor
    resid: torch.Tensor  # float16 [NB, slots * G, H, D]


def side_views(cache: torch.Tensor, lay: KiviLayout, keys: bool) -> KiviSide:
    """Views (no copies) of a KIVI side cache; writes through them land in ``cache``."""
    sl = lay.side(keys)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != sl.nbytes:
        raise ValueError(
            f"a KIVI {'key' if keys else 'value'} cache is uint8 [num_blocks, {sl.nbytes}]"
        )
    h, d, bs, g = lay.num_kv_heads, lay.head_dim, lay.block_size, lay.group_size
    pshape = (bs // g, h, d) if keys else (bs, h, d // lay.value_group)
    nb = int(cache.shape[0])

    def half(off: int, n: int, shape: tuple[int, ...]) -> torch.Tensor:
        return cache[:, off : off + 2 * n].view(torch.float16).view(nb, *shape)

    return KiviSide(
        codes=cache[:, : lay.codes_nbytes].view(nb, bs, h, lay.packed_dim),
        scale=half(sl.scale_offset, sl.param_elems, pshape),
        zero=half(sl.zero_offset, sl.param_elems, pshape),
        resid=half(sl.resid_offset, lay.resid_elems, (lay.slots * g, h, d)),
    )


def window_rows(
    side: KiviSide, blocks: torch.Tensor, lo: int, hi: int, lay: KiviLayout
) -> torch.Tensor:
    """float16 ``[hi - lo, H, D]``: the float16 rows of positions ``[lo, hi)`` of
    one sequence (``blocks``: its block ids, int64), read from their blocks'
    slots. Valid for positions in some query's window or sink (module doc)."""
    pos = torch.arange(lo, hi, device=side.resid.device)
    bs = lay.block_size
    return side.resid[blocks[pos // bs], lay.resid_row(pos % bs)]


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

    ``resid_rows``: rows of the step's k/v written to float16 rows
    ``(resid_block, resid_row)``: every stored token except those whose block
    row is taken, in this same step, by a later group of the same block (that
    row then holds the later token, as it would after token-by-token decode;
    excluding it keeps the scatter free of duplicate indices).
    ``group_*``: the groups that complete in this step; ``group_src`` int64
    ``[n, G]`` is the step row of each of their tokens, -1 for tokens stored in
    an earlier step (read from the group's slot before the store).
    """

    resid_rows: torch.Tensor
    resid_block: torch.Tensor
    resid_row: torch.Tensor
    group_block: torch.Tensor
    group_index: torch.Tensor  # group within the block
    group_slot: torch.Tensor  # its float16 slot
    group_src: torch.Tensor

    @classmethod
    def build(cls, slot_mapping: torch.Tensor, lay: KiviLayout) -> KiviStorePlan:
        sm = slot_mapping.long()
        g, bs = lay.group_size, lay.block_size
        period = lay.ring_groups * g  # a slot is reused this many tokens later
        n = int(sm.shape[0])
        valid = sm >= 0
        off = sm.remainder(bs)
        superseded = torch.zeros(n, dtype=torch.bool, device=sm.device)
        if n > period:
            # Rows of one sequence are consecutive: row i + period reuses row i's
            # slot row exactly when its slot is slot_i + period in the same block
            # (and, with sinks, row i is not in the block's first group).
            later = sm[period:]
            head = sm[:-period]
            same = valid[:-period] & (later == head + period) & (later // bs == head // bs)
            if lay.sink:
                same &= off[:-period] >= g
            superseded[:-period] = same
        rows = torch.nonzero(valid & ~superseded).squeeze(1)
        done = torch.nonzero(valid & (sm % g == g - 1)).squeeze(1)
        last = sm[done]
        offs = torch.arange(g, device=sm.device, dtype=torch.int64)
        src = done[:, None] - (g - 1) + offs
        want = last[:, None] - (g - 1) + offs
        ok = (src >= 0) & (sm[src.clamp(min=0)] == want)
        gidx = (last % bs) // g
        return cls(
            resid_rows=rows,
            resid_block=sm[rows] // bs,
            resid_row=lay.resid_row(off[rows]),
            group_block=last // bs,
            group_index=gidx,
            group_slot=lay.slot_of_group(gidx),
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
    step's rows and the group's float16 slot for tokens of earlier steps),
    then the float16 rows are written."""
    k16, v16 = k.to(torch.float16), v.to(torch.float16)
    g = lay.group_size
    ng = int(plan.group_block.shape[0])
    if ng:
        src = plan.group_src
        have = (src >= 0)[:, :, None, None]
        take = src.clamp(min=0)
        slot_rows = plan.group_slot[:, None] * g + torch.arange(g, device=src.device)
        gblk = plan.group_block[:, None].expand(ng, g)
        gk = torch.where(have, k16[take], ks.resid[gblk, slot_rows])  # [ng, G, H, D]
        gv = torch.where(have, v16[take], vs.resid[gblk, slot_rows])
        codes, scale, zero = quantize_key_groups(gk, lay)
        tok = plan.group_index[:, None] * g + torch.arange(g, device=src.device)  # [ng, G]
        ks.codes.index_put_((gblk, tok), codes)
        ks.scale.index_put_((plan.group_block, plan.group_index), scale)
        ks.zero.index_put_((plan.group_block, plan.group_index), zero)
        vcodes, vscale, vzero = quantize_value_groups(gv, lay)
        vs.codes.index_put_((gblk, tok), vcodes)
        vs.scale.index_put_((gblk, tok), vscale)
        vs.zero.index_put_((gblk, tok), vzero)
    rows = plan.resid_rows
    if rows.numel():
        ks.resid.index_put_((plan.resid_block, plan.resid_row), k16[rows])
        vs.resid.index_put_((plan.resid_block, plan.resid_row), v16[rows])


# ---------------------------------------------------------------- the reference


def read_mask(
    qpos: torch.Tensor, kpos: torch.Tensor, lay: KiviLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float16, quantized) boolean masks ``[nq, nk]``: which keys at positions
    ``kpos`` the queries at ``qpos`` read at float16 and which from codes."""
    g, m = lay.group_size, lay.ring_groups
    wstart = ((qpos // g - m + 1) * g).clamp(min=0)[:, None]
    t = kpos[None, :]
    causal = t <= qpos[:, None]
    fp = causal & ((t >= wstart) | (t < lay.sink_tokens))
    return fp, causal & ~fp


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
    positions ``ctx = seq_len - n .. seq_len - 1``, already stored (complete
    groups' codes and the sink rows are read from the cache views
    ``ks``/``vs``). ``blocks``: the sequence's block ids (int64).
    ``k_tail_old``/``v_tail_old`` ``[ctx - w0, H, D]`` float16, ``w0 =
    lay.window_start(ctx)``: the float16 rows of positions ``[w0, ctx)`` *as
    they were before the store* (:func:`window_rows`; the store may reuse
    their slots). Returns ``[n, Hq, D]`` in ``q``'s dtype, computed in
    float32. Per-sequence dequantization of the sequence's own blocks (the
    reference, not a fast path).
    """
    bs = lay.block_size
    n = int(q.shape[0])
    ctx = seq_len - n
    w0 = lay.window_start(ctx)
    nq = lay.window_start(seq_len - 1)  # quantized positions any query reads: [0, nq)
    if k_tail_old.shape[0] != ctx - w0:
        raise ValueError(f"the tail must be the {ctx - w0} float16 rows before the step")
    dev = q.device
    fp_k = torch.cat([k_tail_old.float(), k_new.to(torch.float16).float()])
    fp_v = torch.cat([v_tail_old.float(), v_new.to(torch.float16).float()])
    qpos = torch.arange(ctx, seq_len, device=dev)
    parts_k, parts_v, masks = [], [], []
    if nq:
        nblk = -(-nq // bs)
        parts_k.append(dequantize_blocks(ks, blocks[:nblk], lay, True)[:nq])
        parts_v.append(dequantize_blocks(vs, blocks[:nblk], lay, False)[:nq])
        masks.append(read_mask(qpos, torch.arange(nq, device=dev), lay)[1])
    sink = min(lay.sink_tokens, w0)  # sinks before the window (the window has the rest)
    if sink:
        parts_k.append(window_rows(ks, blocks, 0, sink, lay).float())
        parts_v.append(window_rows(vs, blocks, 0, sink, lay).float())
        masks.append(read_mask(qpos, torch.arange(sink, device=dev), lay)[0])
    parts_k.append(fp_k)
    parts_v.append(fp_v)
    fmask = read_mask(qpos, torch.arange(w0, seq_len, device=dev), lay)[0]
    masks.append(fmask)
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1).unsqueeze(0),
        torch.cat(parts_k).transpose(0, 1).unsqueeze(0),
        torch.cat(parts_v).transpose(0, 1).unsqueeze(0),
        attn_mask=torch.cat(masks, dim=1),
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
    ``[L, H, D]`` (no cache, no pages): every query ``p >= ctx`` reads keys
    outside its float16 window and sinks quantized-dequantized, the others as
    is. The independent reference the paged paths are tested against."""
    g = lay.group_size
    seq_len = int(k_fp16.shape[0])
    full = (seq_len // g) * g
    kq = k_fp16[:full].reshape(full // g, g, *k_fp16.shape[1:])
    codes, s, z = quantize_key_groups(kq, lay)
    # Dequantized keys/values of every complete group; the tokens of an
    # incomplete group are always in their own queries' window.
    dk = torch.zeros(seq_len, *k_fp16.shape[1:])
    dk[:full] = (
        unpack_codes(codes, lay.bits).float() * s.float()[:, None] + z.float()[:, None]
    ).flatten(0, 1)
    vcodes, vs_, vz = quantize_value_groups(v_fp16[:full], lay)
    dv = torch.zeros(seq_len, *v_fp16.shape[1:])
    dv[:full] = (
        unpack_codes(vcodes, lay.bits)
        .float()
        .reshape(*vcodes.shape[:-1], lay.head_dim // lay.value_group, lay.value_group)
        * vs_.float()[..., None]
        + vz.float()[..., None]
    ).flatten(-2)
    outs = []
    for p in range(ctx, seq_len):
        w = lay.window_start(p)
        keep = torch.arange(p + 1)
        fp = (keep >= w) | (keep < lay.sink_tokens)
        kk = k_fp16[: p + 1].float().clone()
        vv = v_fp16[: p + 1].float().clone()
        qd = ~fp
        kk[qd] = dk[: p + 1][qd]
        vv[qd] = dv[: p + 1][qd]
        o = F.scaled_dot_product_attention(
            q[p - ctx].float()[:, None, :].unsqueeze(0),
            kk.transpose(0, 1).unsqueeze(0),
            vv.transpose(0, 1).unsqueeze(0),
            scale=scale,
            enable_gqa=True,
        )
        outs.append(o.squeeze(0).squeeze(1))
    return torch.stack(outs)
