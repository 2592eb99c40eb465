"""Triton attention backend: store the new k/v, then one paged-attention pass.

Both steps are Triton kernels (``kernels.cache_write``, ``kernels.paged_attention``),
so the whole call is device-side: no host syncs, and the grid depends only on
host ints already in the metadata, which keeps it capturable in a CUDA graph
(``max_seq_len`` then fixes the number of decode splits at capture time).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels.attention_mass import attention_mass_triton
from kernels.cache_write import store_kvcache
from kernels.kivi import KiviLayout, KiviSide, KiviStorePlan, kivi_store, side_views
from kernels.kivi_attention import kivi_paged_attention
from kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    """:class:`AttentionBackend` on Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    graph_safe = True

    def __init__(self) -> None:
        # KIVI (meta.kv_layout): the step's store plan and row -> sequence map,
        # built on the first layer of a step (by metadata identity), and the
        # caches' views. The KIVI path has host syncs (the store plan): the
        # runner does not capture KIVI steps in CUDA graphs.
        self._kivi_step: (
            tuple[AttentionMetadata, KiviStorePlan, torch.Tensor, torch.Tensor, torch.Tensor] | None
        ) = None
        self._kivi_views: dict[int, tuple[torch.Tensor, KiviSide]] = {}

    def _views(self, cache: torch.Tensor, lay: KiviLayout, keys: bool) -> KiviSide:
        hit = self._kivi_views.get(id(cache))
        if hit is not None and hit[0] is cache:
            return hit[1]
        if len(self._kivi_views) > 1024:
            self._kivi_views.clear()
        side = side_views(cache, lay, keys)
        self._kivi_views[id(cache)] = (cache, side)
        return side

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
        step = self._kivi_step
        if step is None or step[0] is not meta:
            qlens = torch.tensor(meta.query_lens_cpu, device=q.device)
            rows = torch.repeat_interleave(
                torch.arange(meta.num_seqs, device=q.device, dtype=torch.int32), qlens
            )
            # Where each sequence's window rows before its first new position
            # are: row r is position w0 + r (rows at or past ctx are never read;
            # clamped to a position the sequence has).
            ctx = meta.seq_lens.long() - qlens
            g, bs = lay.group_size, lay.block_size
            w0 = ((ctx // g - lay.ring_groups + 1) * g).clamp(min=0)
            pos = w0[:, None] + torch.arange(lay.residual_length, device=q.device)
            pos = torch.minimum(pos, (ctx - 1).clamp(min=0)[:, None])
            blk = meta.block_tables.gather(1, pos // bs).long()
            step = (
                meta,
                KiviStorePlan.build(meta.slot_mapping, lay),
                rows,
                blk,
                lay.resid_row(pos % bs),
            )
            self._kivi_step = step
        ks, vs = self._views(k_cache, lay, True), self._views(v_cache, lay, False)
        k_tails = ks.resid[step[3], step[4]]
        v_tails = vs.resid[step[3], step[4]]
        kivi_store(k, v, ks, vs, step[1], lay)
        return kivi_paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            k_tails,
            v_tails,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            step[2],
            lay,
            scale,
        )

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
        """See :meth:`AttentionBackend.forward`."""
        if meta.kv_layout is not None:
            return self._kivi_forward(q, k, v, k_cache, v_cache, meta, meta.kv_layout, scale)
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
            meta.num_decodes,
        )

    def accumulate_attention_mass(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> None:
        """The Triton mass kernel (kernels/attention_mass.py)."""
        if meta.attn_mass is None:
            return
        attention_mass_triton(
            q,
            k_cache,
            meta.block_tables,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            scale,
            meta.attn_mass,
        )
