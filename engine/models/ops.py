"""The small ops of a decoder layer, as a swappable strategy.

``TorchModelOps`` is the reference (plain torch, any device and dtype).
``NativeCpuModelOps`` runs RMSNorm (+ residual add), rotary embedding and
SiLU-and-multiply as single native calls (kernels/csrc/cpu_ops.c) for float32
CPU tensors, each replacing 5-12 eager torch ops per call, and falls back to
the reference for anything else. Both compute the same values (the tests
compare them); the model chooses neither: the engine sets one with
``LlamaForCausalLM.set_ops``.

Residual convention (as in vLLM): ``add_rms_norm(x, w, eps, residual)`` returns
``(rmsnorm(x + residual) * w, x + residual)``, or ``(rmsnorm(x) * w, x)``
when ``residual`` is None. The native version writes ``x + residual`` into
``residual`` in place, so callers must own that tensor (the model does: it is
its running residual stream).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu_native import CpuKernels


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by half-split (GPT-NeoX / HF Llama) RoPE."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class RopeInputs:
    """One forward's rotary inputs: positions ``[T]`` and the ``[max_pos, D]`` cos|sin table.

    ``cos``/``sin`` (``[T, 1, D/2]`` in the activation dtype) are filled on first
    use by the torch path.
    """

    positions: torch.Tensor
    cos_sin: torch.Tensor
    dtype: torch.dtype
    cos: torch.Tensor | None = field(default=None)
    sin: torch.Tensor | None = field(default=None)
    # Native path: positions bounds-checked once per forward, not once per layer.
    positions_checked: bool = False

    def cos_sin_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.sin is None:
            cs = self.cos_sin.index_select(0, self.positions).to(self.dtype)
            self.cos, self.sin = cs.unsqueeze(1).chunk(2, dim=-1)
        return self.cos, self.sin


class ModelOps(ABC):
    name: str = "abstract"

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weight * rmsnorm(h), h)`` with ``h = x + residual`` (``x`` when None),
        normalised in float32 and cast back before the weight (Hugging Face's order)."""

    @abstractmethod
    def rope(
        self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]``; may work in place."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[T, 2 * I]`` (gate first)."""


class TorchModelOps(ModelOps):
    name = "torch"

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x if residual is None else x + residual
        normed = F.rms_norm(h.float(), (h.shape[-1],), eps=eps)
        return weight * normed.to(h.dtype), h

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = inputs.cos_sin_rows()
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class NativeCpuModelOps(TorchModelOps):
    """Native fused ops for float32 CPU tensors; the torch reference otherwise."""

    name = "cpu"

    def __init__(self, kernels: CpuKernels) -> None:
        self.kernels = kernels

    @staticmethod
    def _native(*ts: torch.Tensor) -> bool:
        return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ok = (
            x.dim() == 2
            and self._native(x, weight)
            and x.is_contiguous()
            and weight.is_contiguous()
            and weight.shape == (x.shape[1],)
            and (
                residual is None
                or (
                    self._native(residual)
                    and residual.is_contiguous()
                    and residual.shape == x.shape
                )
            )
        )
        if not ok:
            return super().add_rms_norm(x, weight, eps, residual)
        out = self.kernels.add_rms_norm(x, weight, eps, residual, validate=False)
        return out, (x if residual is None else residual)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, inputs: RopeInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t, hq, d = q.shape
        hkv = k.shape[1]
        # In place only when k directly follows q in each row of one buffer (a
        # fused qkv projection's output viewed without copies).
        # A size-1 leading dim's stride is arbitrary in a view (torch does not
        # normalise it), so row strides are compared only when there are rows
        # to step over: one-sequence decode steps must take the native path too.
        adjacent = (
            self._native(q, k, inputs.cos_sin)
            and t > 0
            and q.stride()[1:] == (d, 1)
            and k.stride()[1:] == (d, 1)
            and (t == 1 or k.stride(0) == q.stride(0))
            and k.data_ptr() == q.data_ptr() + hq * d * q.element_size()
            and inputs.cos_sin.is_contiguous()
            and inputs.cos_sin.shape[1] == d
            and inputs.positions.dtype == torch.int64
            and inputs.positions.is_contiguous()
            and inputs.positions.shape == (t,)
        )
        if not adjacent:
            return super().rope(q, k, inputs)
        qk = q.as_strided((t, (hq + hkv) * d), (q.stride(0), 1))
        self.kernels.rope_neox_(
            qk,
            hq + hkv,
            d,
            inputs.positions,
            inputs.cos_sin,
            check_positions=not inputs.positions_checked,
            validate=False,  # eligibility checked just above
        )
        inputs.positions_checked = True
        return q, k

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or not self._native(gate_up) or not gate_up.is_contiguous():
            return super().silu_mul(gate_up)
        return self.kernels.silu_mul(gate_up, validate=False)
