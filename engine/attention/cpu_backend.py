"""CPU attention backend: the torch backend with decodes on a native kernel.

Decode tokens (one per sequence) go to ``kernels.cpu_native``'s paged decode
attention, which reads keys and values in place through the block tables
instead of gathering each sequence's context per layer. Prefill/extend chunks
keep the torch path (SDPA's blocked kernel is the right tool for many query
rows), as do bf16 caches (the kernels read fp32 and fp16 caches).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import StepPlan, TorchAttentionBackend
from kernels.cpu_native import CpuKernels

# Caches the native kernels read (a float16 cache is converted as read: half
# the bytes per decode step, which is what bounds long-context decode here).
_CACHE_DTYPES = (torch.float32, torch.float16)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    # The native decode kernel reads keys and values in place: verification rows
    # cost what plain decode rows cost.
    decode_rows_for_verification = True

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()
        self.kernels = kernels

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
        if q.dtype != torch.float32 or k_cache.dtype not in _CACHE_DTYPES or q.device.type != "cpu":
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
