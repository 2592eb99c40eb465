"""Plain-PyTorch attention over the paged KV cache (CPU and CUDA).

Decode sequences (query length 1) are attended in one batched
``scaled_dot_product_attention`` call over their gathered, padded contexts.
The gather uses ``index_select`` over a flattened block list (on CPU about
5x faster than advanced indexing ``cache[table]``), and the gather index and
padding mask are built once per step, not once per layer: every layer shares
the step's metadata.
Prefill/extend chunks are attended one sequence per call: their query lengths
differ, and padding a 512-token chunk to share a call with 1-token decodes
would waste more than the loop costs (a step holds few prefill chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels.kivi import (
    KiviLayout,
    KiviSide,
    KiviStorePlan,
    kivi_attention_ref,
    kivi_store,
    side_views,
    window_rows,
)

# Query rows per attention call of a chunk that follows cached context (see
# TorchAttentionBackend._extend); 64-256 measured alike on the CPU.
EXTEND_QUERY_BLOCK = 128


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> None:
    """Write new keys/values into their cache slots.

    ``keep``: indices of the rows to write (those whose slot is >= 0), or
    ``None`` when every row is written. Computing it is a host sync, so the
    caller does it once per step (``StepPlan``), not once per layer.
    """
    num_kv_heads = k.shape[1]
    # Keys may be narrower than values (low-rank keys, engine/kv/low_rank.py).
    kc = k_cache.view(-1, num_kv_heads, k.shape[2])
    vc = v_cache.view(-1, num_kv_heads, v.shape[2])
    if keep is not None:
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    kc.index_copy_(0, slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, slot_mapping, v.to(vc.dtype))


@dataclass
class StepPlan:
    """What every layer of one step shares: built from the step's metadata once.

    ``keep_rows()`` is None when every new token is stored (no ``-1`` slots);
    it is computed on first use (a host sync the native fused path never
    needs: its kernel skips ``-1`` slots itself). The decode fields describe the first ``meta.num_decodes`` sequences:
    ``flat_blocks`` int64 ``[nd * nblk]`` (block ids row by row) and ``mask``
    bool ``[nd, 1, 1, nblk * block_size]`` (position < seq_len).
    """

    meta: AttentionMetadata
    flat_blocks: torch.Tensor | None = None
    nblk: int = 0
    mask: torch.Tensor | None = None
    lengths_checked: bool = False  # native kernel: seq_lens bounds checked this step
    # KIVI caches (meta.kv_layout): where the step's tokens are stored.
    kivi: KiviStorePlan | None = None
    _keep: torch.Tensor | None = None
    _keep_known: bool = False

    def keep_rows(self) -> torch.Tensor | None:
        if not self._keep_known:
            sm = self.meta.slot_mapping
            if sm.numel() and bool((sm < 0).any()):
                self._keep = torch.nonzero(sm >= 0).squeeze(1)
            self._keep_known = True
        return self._keep


class TorchAttentionBackend(AttentionBackend):
    """Reference-grade paged attention in plain PyTorch.

    The backend is shared by every layer; it memoises the plan of the step
    whose metadata it last saw (compared by identity), so a plan is valid
    exactly while the same ``AttentionMetadata`` object is passed in (the
    model runner builds a new one per step and never mutates it).
    """

    name = "torch"
    # Decode rows gather their whole context each: one extend chunk gathers it once.
    decode_rows_for_verification = False

    def __init__(self) -> None:
        self._plan: StepPlan | None = None
        # KIVI cache views per cache tensor (by identity; the tensor is kept so
        # its id is not reused): building them costs more than a decode's store.
        self._kivi_views: dict[int, tuple[torch.Tensor, KiviSide]] = {}

    def kivi_views(self, cache: torch.Tensor, lay: KiviLayout, keys: bool) -> KiviSide:
        """``side_views(cache)``, memoised for the caches this backend serves."""
        hit = self._kivi_views.get(id(cache))
        if hit is not None and hit[0] is cache:
            return hit[1]
        if len(self._kivi_views) > 1024:  # caches replaced (a profiling runner): forget
            self._kivi_views.clear()
        side = side_views(cache, lay, keys)
        self._kivi_views[id(cache)] = (cache, side)
        return side

    def _step_plan(self, meta: AttentionMetadata, block_size: int) -> StepPlan:
        plan = self._plan
        if plan is not None and plan.meta is meta:
            return plan
        plan = StepPlan(meta)
        self._plan = plan
        return plan

    @staticmethod
    def _gather_plan(plan: StepPlan, block_size: int) -> None:
        """Fill the decode gather fields of ``plan`` (once per step, on first use)."""
        meta = plan.meta
        nd = meta.num_decodes
        max_len = max(meta.seq_lens_cpu[:nd])
        plan.nblk = (max_len + block_size - 1) // block_size
        plan.flat_blocks = meta.block_tables[:nd, : plan.nblk].reshape(-1).long()
        pos = torch.arange(plan.nblk * block_size, device=meta.seq_lens.device)
        plan.mask = (pos[None, :] < meta.seq_lens[:nd, None]).view(nd, 1, 1, -1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.kv_layout is not None:
            return self._kivi_forward(q, k, v, k_cache, v_cache, meta, meta.kv_layout, scale)
        block_size = k_cache.shape[1]
        plan = self._step_plan(meta, block_size)
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.keep_rows())
        # Values' width: a low-rank key cache is narrower than its values.
        out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, plan, scale)
        starts = meta.query_start_loc_cpu
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            out[s:e] = self._extend(
                q[s:e], k[s:e], v[s:e], k_cache, v_cache, meta, i, scale, block_size
            )
        return out

    def _kivi_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        lay: KiviLayout,
        scale: float,
    ) -> torch.Tensor:
        """Store into KIVI caches, then attend (read rule in kernels/kivi.py).

        Prefill/extend chunks go through the per-sequence reference, which
        dequantizes that sequence's own blocks; decodes go to ``_kivi_decode``
        (the native backend reads the blocks in place there).
        """
        plan = self._step_plan(meta, lay.block_size)
        if plan.kivi is None:
            plan.kivi = KiviStorePlan.build(meta.slot_mapping, lay)
        nd = meta.num_decodes
        ks, vs = self.kivi_views(k_cache, lay, True), self.kivi_views(v_cache, lay, False)
        # Each extend sequence's float16 window rows before its first new
        # position, read before the store (it may reuse their slots).
        tails = []
        for i in range(nd, meta.num_seqs):
            seq_len, n = meta.seq_lens_cpu[i], meta.query_lens_cpu[i]
            ctx = seq_len - n
            blocks = self._kivi_blocks(meta, i, seq_len, lay)
            w0 = lay.window_start(ctx)
            tails.append(
                (
                    blocks,
                    window_rows(ks, blocks, w0, ctx, lay),
                    window_rows(vs, blocks, w0, ctx, lay),
                )
            )
        kivi_store(k, v, ks, vs, plan.kivi, lay)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._kivi_decode(q[:nd], k_cache, v_cache, meta, lay, plan, scale)
        starts = meta.query_start_loc_cpu
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            blocks, k_tail, v_tail = tails[i - nd]
            out[s:e] = kivi_attention_ref(
                q[s:e],
                k[s:e],
                v[s:e],
                ks,
                vs,
                blocks,
                meta.seq_lens_cpu[i],
                k_tail,
                v_tail,
                lay,
                scale,
            )
        return out

    @staticmethod
    def _kivi_blocks(
        meta: AttentionMetadata, i: int, seq_len: int, lay: KiviLayout
    ) -> torch.Tensor:
        return meta.block_tables[i, : -(-seq_len // lay.block_size)].long()

    def _kivi_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        lay: KiviLayout,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        """Decodes over KIVI caches after the store: the per-sequence reference.
        A decode's store reuses only the slot row of a token ``m`` groups back,
        outside its window, so the stored float16 rows serve as the pre-store
        window; its own k/v are read back from its row, exactly as stored."""
        ks, vs = self.kivi_views(k_cache, lay, True), self.kivi_views(v_cache, lay, False)
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            seq_len = meta.seq_lens_cpu[i]
            ctx = seq_len - 1
            blocks = self._kivi_blocks(meta, i, seq_len, lay)
            w0 = lay.window_start(ctx)
            kw = window_rows(ks, blocks, w0, seq_len, lay)
            vw = window_rows(vs, blocks, w0, seq_len, lay)
            out[i : i + 1] = kivi_attention_ref(
                q[i : i + 1],
                kw[-1:],
                vw[-1:],
                ks,
                vs,
                blocks,
                seq_len,
                kw[:-1],
                vw[:-1],
                lay,
                scale,
            )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        """Attention for the first ``nd = q.shape[0]`` sequences (one new token each)."""
        nd = q.shape[0]
        block_size, hkv, d, dv = (
            k_cache.shape[1],
            k_cache.shape[2],
            k_cache.shape[3],
            v_cache.shape[3],
        )
        if plan.flat_blocks is None:
            self._gather_plan(plan, block_size)
        assert plan.flat_blocks is not None and plan.mask is not None
        s = plan.nblk * block_size
        # [nd * nblk, bs, Hkv, D] -> [nd, Hkv, S, D]
        kk = k_cache.index_select(0, plan.flat_blocks).view(nd, s, hkv, d).transpose(1, 2)
        vv = v_cache.index_select(0, plan.flat_blocks).view(nd, s, hkv, dv).transpose(1, 2)
        # The wider of the two dtypes: a float16 cache under a float32 model is
        # read at float32 (storage precision only), not the query rounded down.
        ct = torch.promote_types(q.dtype, kk.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(ct),
            kk.to(ct),
            vv.to(ct),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2).to(q.dtype)

    @staticmethod
    def _extend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
        block_size: int,
    ) -> torch.Tensor:
        qlen = q.shape[0]
        seq_len = meta.seq_lens_cpu[i]
        ctx = seq_len - qlen
        qt = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        if ctx == 0:
            # Whole sequence is new: attend over the fresh k/v, no gather, rounded
            # to the cache's element type as every later read of them is (a float16
            # cache): a prompt's answer must not depend on how it was chunked.
            kt = k.to(k_cache.dtype).transpose(0, 1).unsqueeze(0).to(q.dtype)
            vt = v.to(v_cache.dtype).transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = F.scaled_dot_product_attention(
                qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            nblk = (seq_len + block_size - 1) // block_size
            blocks = meta.block_tables[i, :nblk].long()
            hkv, d, dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
            kt = k_cache.index_select(0, blocks).reshape(-1, hkv, d)[:seq_len]
            vt = v_cache.index_select(0, blocks).reshape(-1, hkv, dv)[:seq_len]
            kt = kt.transpose(0, 1).unsqueeze(0)
            vt = vt.transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(ctx, seq_len, device=q.device)
            kpos = torch.arange(seq_len, device=q.device)
            ct = torch.promote_types(q.dtype, kt.dtype)
            qt, kt, vt = qt.to(ct), kt.to(ct), vt.to(ct)
            # A masked call cannot skip the masked half (is_causal aligns top-left,
            # so it does not fit a chunk after cached context): query blocks that
            # each read only the keys up to their own last position do about the
            # causal half of the work (measured 1.8x faster at 1,700 tokens after
            # a 33-token prefix hit, the common chat case).
            parts = []
            for b0 in range(0, qlen, EXTEND_QUERY_BLOCK):
                b1 = min(qlen, b0 + EXTEND_QUERY_BLOCK)
                kl = ctx + b1
                mask = kpos[None, :kl] <= qpos[b0:b1, None]
                parts.append(
                    F.scaled_dot_product_attention(
                        qt[:, :, b0:b1],
                        kt[:, :, :kl],
                        vt[:, :, :kl],
                        attn_mask=mask,
                        scale=scale,
                        enable_gqa=True,
                    )
                )
            o = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)).to(q.dtype)
        return o.squeeze(0).transpose(0, 1)
