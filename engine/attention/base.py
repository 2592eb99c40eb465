"""The attention backend contract shared by every backend (torch, Triton).

A step's batch is *flattened*: the new tokens of every scheduled sequence are
concatenated into one ``[T, ...]`` tensor. Sequences are ordered so that the
``num_decodes`` sequences whose query length is exactly 1 come first; the rest
are prefill or extend chunks (query length >= 1) whose earlier context may
already sit in the cache (chunked prefill, prefix-cache hits).

Several query-length-1 sequences may share one block table with lengths
``L + 1, L + 2, ...``: a speculative verification chunk given as rows (see
``decode_rows_for_verification``). A backend stores every new key/value of
the step before it attends, so each row sees the rows before it.

KV cache layout, per layer: ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. Slot ``s`` is
``block_id * block_size + offset``.

Quantized KV formats (``meta.kv_layout`` set, e.g. KIVI, kernels/kivi.py):
``k_cache``/``v_cache`` are ``uint8 [num_blocks, layout.k.nbytes]`` and
``[num_blocks, layout.v.nbytes]``, each row one block's packed codes, float16
scales/zero points and float16 slot rows, as the layout describes. A backend reads them through that layout (the runner
sets it from the KV format every step), so neither the scheduler nor the model
branches on the format; a backend that cannot read a layout refuses it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.attention_mass import attention_mass_ref
from kernels.kivi import KiviLayout


@dataclass
class AttentionMetadata:
    """Shape of one step's flattened batch (B sequences, T new tokens).

    Attributes:
        query_start_loc: int32 ``[B + 1]``; new tokens of sequence ``i`` are rows
            ``query_start_loc[i]:query_start_loc[i + 1]`` of q/k/v.
        seq_lens: int32 ``[B]``; tokens of sequence ``i`` after this step
            (cached context + new tokens). Its new tokens sit at positions
            ``seq_lens[i] - query_len_i ... seq_lens[i] - 1``.
        block_tables: int32 ``[B, max_blocks]``; row ``i`` lists the block ids of
            sequence ``i`` in order. Entries past ``ceil(seq_lens[i] / block_size)``
            are padding (0) and are never read.
        slot_mapping: int64 ``[T]``; cache slot where each new token's k/v is
            written. ``-1`` means "do not write" (padding rows of CUDA graphs).
        max_query_len: largest query length in the batch.
        max_seq_len: largest ``seq_lens`` entry.
        num_decodes: the first ``num_decodes`` sequences have query length 1.
        query_lens_cpu: per-sequence query lengths as Python ints (host copy).
        seq_lens_cpu: ``seq_lens`` as Python ints (host copy).
        query_start_loc_cpu: ``query_start_loc`` as Python ints (host copy).
        kv_layout: the caches' quantized block layout (None: plain
            ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches).
        attn_mass: float32 ``[B, >= max_seq_len]`` or None. When set (a KV
            policy asked), every layer adds the attention mass each cached key
            of sequence ``i`` receives this step to row ``i``
            (:meth:`AttentionBackend.accumulate_attention_mass`).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    kv_layout: KiviLayout | None = None
    attn_mass: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Attend over the paged KV cache. One instance serves every layer."""

    name: str = "abstract"
    # True when forward has no host syncs and no state carried between calls, so
    # a captured replay (engine/worker/cuda_graphs.py) recomputes it faithfully.
    graph_safe: bool = False
    # True when a speculative verification chunk (a few new tokens after cached
    # context) is cheaper as that many query-length-1 sequences over the same
    # block table (the decode kernel reads the cache in place) than as an extend
    # chunk; the runner then presents it so (engine/worker/model_runner.py).
    decode_rows_for_verification: bool = True

    @abstractmethod
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
        """Store the new keys/values, then attend.

        Args:
            q: ``[T, num_heads, head_dim]`` queries of the new tokens.
            k, v: ``[T, num_kv_heads, head_dim]`` keys/values of the new tokens.
            k_cache, v_cache: this layer's caches (layout in the module doc).
            meta: the step's batch description.
            scale: softmax scale (usually ``head_dim ** -0.5``).

        Returns:
            ``[T, num_heads, head_dim]``: for each new token, attention over its
            sequence's cached prefix plus the new tokens up to and including
            itself (causal). ``num_heads`` must be a multiple of ``num_kv_heads``
            (grouped-query attention).
        """

    def accumulate_attention_mass(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> None:
        """Add this layer's per-key attention mass to ``meta.attn_mass`` (after
        ``forward`` stored the step's keys). A separate pass over the keys (the
        torch reference here; backends may override with a kernel), so the
        attention kernels are untouched and pay nothing when no policy asks."""
        if meta.attn_mass is None:
            return
        attention_mass_ref(
            q,
            k_cache,
            meta.block_tables,
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            scale,
            meta.attn_mass,
        )
