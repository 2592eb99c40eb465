"""CPU attention backend: the torch backend with decodes on a native kernel.

Decode tokens (one per sequence) go to ``kernels.cpu_native``'s paged decode
attention, which reads keys and values in place through the block tables
instead of gathering each sequence's context per layer. Prefill/extend chunks
keep the torch path (SDPA's blocked kernel is the right tool for many query
rows), as do non-fp32 caches (the kernel is fp32 only).
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, _StepPlan
from kernels.cpu_native import CpuKernels


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()
        self.kernels = kernels

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: _StepPlan,
        scale: float,
    ) -> torch.Tensor:
        if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu":
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
