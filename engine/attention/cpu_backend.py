"""CPU attention backend: the torch backend with decodes on a native kernel.

Decode tokens (one per sequence) go to ``kernels.cpu_native``'s paged decode
attention, which reads keys and values in place through the block tables
instead of gathering each sequence's context per layer. Prefill/extend chunks
keep the torch path (SDPA's blocked kernel is the right tool for many query
rows), as do bf16 caches (the kernels read fp32 and fp16 caches). KIVI caches
(``meta.kv_layout``): every row reads the quantized blocks in place through
``CpuKernels.kivi_decode_attention``, extend chunks too (``_kivi_forward``:
one group-aligned piece at a time, so nothing of a cache is dequantized into
a temporary); the store is the torch backend's ``kivi_store``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import StepPlan, TorchAttentionBackend
from kernels.cpu_native import CpuKernels
from kernels.kivi import KiviLayout, KiviStorePlan, kivi_store

# Caches the native kernels read (a float16 cache is converted as read: half
# the bytes per decode step, which is what bounds long-context decode here).
_CACHE_DTYPES = (torch.float32, torch.float16)


@dataclass
class _KiviPiece:
    """Rows of one step stored and attended together (``_kivi_forward``): each
    row as a sequence of its own, of length its position + 1."""

    rows: torch.Tensor  # int64 rows of the step
    plan: KiviStorePlan
    block_tables: torch.Tensor  # int32 [n, max_blocks]
    seq_lens: torch.Tensor  # int32 [n]


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    # The native decode kernel reads keys and values in place: verification rows
    # cost what plain decode rows cost.
    decode_rows_for_verification = True

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()
        self.kernels = kernels
        # The step's KIVI pieces (built on its first layer, for every layer).
        self._kivi_step: tuple[AttentionMetadata, list[_KiviPiece]] | None = None

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
        # Decode-only steps (every sequence has one new token) store and attend
        # in one native call per layer, reading q/k/v in place: the generic
        # path's per-layer cache writes, copies and checks cost more than the
        # attention itself for a few short sequences.
        nd = q.shape[0]
        if (
            meta.num_decodes == meta.num_seqs
            and q.dtype == k.dtype == v.dtype == torch.float32
            and k_cache.dtype in _CACHE_DTYPES
            and k_cache.shape[-1] == v_cache.shape[-1]  # not low-rank keys: one head size
            and q.device.type == "cpu"
            and q.stride()[1:] == k.stride()[1:] == v.stride()[1:] == (q.shape[2], 1)
            and (nd <= 1 or q.stride(0) == k.stride(0) == v.stride(0))
        ):
            plan = self._step_plan(meta, k_cache.shape[1])
            # Layout and bounds are the same for every layer of a step: checked
            # on its first layer only (host reductions are not free).
            first = not plan.lengths_checked
            plan.lengths_checked = True
            return self.kernels.paged_decode_store_attention(
                q,
                k,
                v,
                k_cache,
                v_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                scale,
                validate=first,
            )
        return super().forward(q, k, v, k_cache, v_cache, meta, scale)

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: StepPlan,
        scale: float,
    ) -> torch.Tensor:
        if (
            q.dtype != torch.float32
            or k_cache.dtype not in _CACHE_DTYPES
            or q.device.type != "cpu"
            # Low-rank keys (narrower than values): the kernel reads one head size.
            or k_cache.shape[-1] != v_cache.shape[-1]
        ):
            return super()._decode(q, k_cache, v_cache, meta, plan, scale)
        nd = q.shape[0]
        # Bounds of seq_lens are checked on the step's first layer only: every
        # layer of a step sees the same metadata (a host sync per layer is not free).
        first = not plan.lengths_checked
        plan.lengths_checked = True
        return self.kernels.paged_decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            scale,
            check_lengths=first,
        )

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
        """Store and attend in group-aligned pieces, every row on the native kernel.

        Why pieces: the kernel reads float16 window rows from the cache after the
        store, and a chunk spanning more than the window would reuse (overwrite)
        a slot an earlier row of the same chunk still reads. Within one group of
        one sequence no slot is reused, so piece ``i`` holds, per sequence, the
        step's tokens of its ``i``-th group (decodes are in piece 0); storing
        piece by piece leaves each piece's rows exactly the cache they read.
        """
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._kivi_forward(q, k, v, k_cache, v_cache, meta, lay, scale)
        step = self._kivi_step
        if step is None or step[0] is not meta:
            step = (meta, self._kivi_pieces(meta, lay))
            self._kivi_step = step
        ks, vs = self.kivi_views(k_cache, lay, True), self.kivi_views(v_cache, lay, False)
        out = torch.empty_like(q)
        first = True
        for piece in step[1]:
            rows = piece.rows
            kivi_store(k[rows], v[rows], ks, vs, piece.plan, lay)
            out[rows] = self.kernels.kivi_decode_attention(
                q[rows].contiguous(),
                k_cache,
                v_cache,
                piece.block_tables,
                piece.seq_lens,
                lay,
                scale,
                check_lengths=first,
            )
            first = False
        return out

    @staticmethod
    def _kivi_pieces(meta: AttentionMetadata, lay: KiviLayout) -> list[_KiviPiece]:
        g = lay.group_size
        starts = meta.query_start_loc_cpu
        pieces: dict[int, list[int]] = {}
        for i in range(meta.num_seqs):
            ctx = meta.seq_lens_cpu[i] - meta.query_lens_cpu[i]
            for r in range(starts[i], starts[i + 1]):
                # Piece of this row: its group, counted from the sequence's first new one.
                pieces.setdefault((ctx + r - starts[i]) // g - ctx // g, []).append(r)
        seq_of = torch.repeat_interleave(
            torch.arange(meta.num_seqs), torch.tensor(meta.query_lens_cpu)
        )
        pos = torch.cat(
            [torch.arange(s - n, s) for s, n in zip(meta.seq_lens_cpu, meta.query_lens_cpu)]
        )
        out = []
        for key in sorted(pieces):
            rows = torch.tensor(pieces[key], dtype=torch.int64)
            out.append(
                _KiviPiece(
                    rows=rows,
                    plan=KiviStorePlan.build(meta.slot_mapping[rows], lay),
                    block_tables=meta.block_tables[seq_of[rows]].contiguous(),
                    seq_lens=(pos[rows] + 1).to(torch.int32),
                )
            )
        return out

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
        if q.dtype != torch.float32 or q.device.type != "cpu":
            return super()._kivi_decode(q, k_cache, v_cache, meta, lay, plan, scale)
        nd = q.shape[0]
        first = not plan.lengths_checked
        plan.lengths_checked = True
        return self.kernels.kivi_decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.block_tables[:nd],
            meta.seq_lens[:nd],
            lay,
            scale,
            check_lengths=first,
        )
