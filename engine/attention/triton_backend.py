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
from kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    """:class:`AttentionBackend` on Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

    name = "triton"
    graph_safe = True

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
