"""How a model's linears run: one ``LinearStrategy`` per ``--cpu-linear`` choice.

A strategy converts every ``nn.Linear`` of a model (and its logits
projection) into the module that computes it: ``torch`` leaves them as they
are, ``onednn`` prepacks float32 weights for oneDNN (exact), ``int8`` uses
fbgemm's dynamic int8, ``q4_1`` and ``q8_0`` store llama.cpp's blocks for
the native integer-dot kernels (kernels/csrc/cpu_quant.c). The engine asks
:func:`make_linear_strategy` for one (``auto`` resolves from the device,
the dtype and what the weight file holds) and applies it once after loading;
the model knows none of them (it only exposes ``LinearHost``). Like
``ModelOps`` (engine/models/ops.py) and ``AttentionBackend``, a new way to run
linears is a new class here, not a branch in the engine.

On this project's CPUs torch's default fp32 GEMM (MKL) is slow for the small
row counts of decode steps; oneDNN with a weight prepacked for its kernels is
faster from about 8 rows up but slower for 1-4 rows. So each packed linear
keeps the plain weight too and picks per call by row count. Memory for
weights doubles (the packed copy); only one copy is read per call. Measured
by ``benchmarks/cpu_step_bench.py`` (docs/benchmarks/cpu.md).
Speculative verification makes 2-8-row steps common:
``benchmarks/spec_step_bench.py --min-rows 8,2`` compares the two thresholds
(docs/benchmarks/spec-decode.md).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import CpuLinear

if TYPE_CHECKING:
    from kernels.cpu_native import CpuKernels
    from kernels.quant_linear import QuantWeight

logger = logging.getLogger(__name__)


def onednn_packing_available() -> bool:
    return (
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    )


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W also prepacked for oneDNN (used when rows >= ``min_rows``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = 2) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.min_rows = min_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 16)

    @classmethod
    def from_linear(cls, linear: nn.Linear, min_rows: int = 2) -> PackedLinear:
        return cls(linear.weight, linear.bias, min_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= self.min_rows:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)


class Int8DynamicLinear(nn.Module):
    """Weight-int8 (per output channel, symmetric), activation-int8 (dynamic) linear.

    Uses torch's fbgemm/x86 quantized kernels, 5-10x faster than fp32 GEMM on
    AVX2 CPUs for decode-sized batches because it reads a quarter of the bytes.
    It is an approximation (like any quantization): opt-in via
    ``--cpu-linear int8``, never the default, since outputs then differ from
    the unquantized model's.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantLinear

        w = weight.detach().float()
        out_features, in_features = w.shape
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        qweight = torch.quantize_per_channel(
            w, scales, torch.zeros(out_features, dtype=torch.long), 0, torch.qint8
        )
        self.inner = DynamicQuantLinear(  # type: ignore[no-untyped-call]
            in_features, out_features, bias_=bias is not None
        )
        self.inner.set_weight_bias(qweight, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x)
        return out


class Fp16Linear(nn.Module):
    """Float16 weights (fbgemm, prepacked), float32 activations and accumulation.

    Half the bytes of fp32 weights with no activation quantization: the
    accurate choice for large batches of block-quantized weights, whose
    values fp16 holds to ~3 significant digits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        b = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float(), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        return out


class BlockQuantLinear(nn.Module):
    """Block-quantized weight (Q4_1 or Q8_0, kernels/quant_linear.py) on the CPU.

    Every call runs the native kernel (kernels/csrc/cpu_quant.c), which reads
    0.56 bytes per Q4_1 weight: integer dots over 15-bit activation codes per
    32-block. ``layout`` X16 (AVX-512 VNNI builds) interleaves 16 weight rows
    per block, which measured 2x faster than row-major blocks from one row to
    512 (docs/benchmarks/cpu.md). A row's output does not depend on the batch
    at all (the kernel computes each output the same way whatever the row
    count). With ``max_native_rows`` set (builds without AVX-512 VNNI, where
    fbgemm's fp16 GEMM measured faster for wide batches), batches above it go
    to an Fp16Linear of the blocks' weight instead, and a sequence's logits
    can then differ slightly with its batch's size.

    The float weight handed in is not kept. For a Q4_1 GGUF, whose weights
    were dequantized on load, quantizing again reproduces the file's blocks
    exactly (tests/test_kernels.py checks it).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: CpuKernels,
        qtype: int,
        max_native_rows: int | None = None,
        layout: int = 0,
    ) -> None:
        super().__init__()
        from kernels.quant_linear import (
            Q4_1,
            X16,
            dequantize,
            pack_x16,
            quantize_q4_1,
            quantize_q8_0,
        )

        w = weight.detach().float()
        qw = quantize_q4_1(w) if qtype == Q4_1 else quantize_q8_0(w)
        self.qweight: QuantWeight = pack_x16(qw) if layout == X16 else qw
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        # The blocks' weight, not the float one: both paths compute with one model.
        self.large = None if max_native_rows is None else Fp16Linear(dequantize(self.qweight), bias)
        self.kernels = kernels
        self.max_native_rows = max_native_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.large is not None and self.max_native_rows is not None:
            if rows > self.max_native_rows:
                out: torch.Tensor = self.large(x)
                return out
        flat = x if x.dim() == 2 else x.reshape(rows, x.shape[-1])
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.float().contiguous()
        y = self.kernels.quant_linear(flat, self.qweight, self.bias_f32, validate=False)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])


# --------------------------------------------------------------------------- strategies


class LinearHost(Protocol):
    """What a strategy needs from a model: the module tree holding its linears,
    the weight of its logits projection (the tied embedding or ``lm_head``), and
    a slot for the module that computes logits (None: ``F.linear`` on that
    weight). A separate logits module keeps a tied embedding one tensor for
    lookups."""

    logits_linear: nn.Module | None

    def linear_root(self) -> nn.Module: ...

    def logits_weight(self) -> torch.Tensor: ...

    def use_expert_linears(
        self, make: Callable[[torch.Tensor], nn.Module], keep_stacked: bool
    ) -> int:
        """Replace every expert matrix (Mixture-of-Experts models) by ``make(weight)``;
        ``keep_stacked``: the modules share the stacked weights' storage."""
        ...


class LinearStrategy(ABC):
    """How every linear of a model runs. ``apply`` replaces each ``nn.Linear``
    under ``model.linear_root()`` by ``self.linear(...)`` and sets the logits
    module to ``self.logits(...)``; both see the float weight, which the new
    module may keep or drop. Applied once, after the weights are loaded and
    before the first forward.

    ``exact``: outputs equal the float32 model's up to float32 rounding (no
    quantization). Expert matrices of MoE models (bare weights) become
    ``self.matrix(weight)`` when ``takes_experts``; ``keeps_stacked``: those
    modules share the stacked weights' storage (so the stacked path stays)."""

    name: str = "abstract"
    exact: bool = False
    takes_experts: bool = True
    keeps_stacked: bool = False

    def apply(self, model: LinearHost) -> int:
        """Convert ``model`` in place; returns how many linears (logits and expert
        matrices included) it converted."""
        n = self._replace(model.linear_root())
        model.logits_linear = self.logits(model.logits_weight())
        if self.takes_experts:
            n += model.use_expert_linears(self.matrix, self.keeps_stacked)
        return n + (model.logits_linear is not None)

    def matrix(self, weight: torch.Tensor) -> nn.Module:
        """The module computing ``x @ weight.T`` (no bias): an expert matrix."""
        out_features, in_features = weight.shape
        lin = nn.Linear(in_features, out_features, bias=False, device="meta")
        lin.weight = nn.Parameter(weight, requires_grad=False)
        return self.linear(lin)

    def _replace(self, root: nn.Module) -> int:
        count = 0
        for name, child in list(root.named_children()):
            if isinstance(child, nn.Linear):
                new = self.linear(child)
                if new is not child:
                    setattr(root, name, new)
                    count += 1
            else:
                count += self._replace(child)
        return count

    @abstractmethod
    def linear(self, linear: nn.Linear) -> nn.Module:
        """The module computing ``linear`` (``linear`` itself: unchanged)."""

    @abstractmethod
    def logits(self, weight: torch.Tensor) -> nn.Module | None:
        """The module computing ``hidden @ weight.T`` (None: plain ``F.linear``)."""


class TorchLinears(LinearStrategy):
    """Plain ``F.linear`` in the model's dtype (any device): nothing to convert."""

    name = "torch"
    exact = True
    takes_experts = False

    def linear(self, linear: nn.Linear) -> nn.Module:
        return linear

    def logits(self, weight: torch.Tensor) -> nn.Module | None:
        return None


class OneDnnLinears(LinearStrategy):
    """float32 weights also prepacked for oneDNN (PackedLinear): exact, and the
    fastest float32 path from ``min_rows`` rows up."""

    name = "onednn"
    exact = True
    keeps_stacked = True  # PackedLinear keeps a view of the float weight

    def __init__(self, min_rows: int = 8) -> None:
        self.min_rows = min_rows

    def linear(self, linear: nn.Linear) -> nn.Module:
        if linear.weight.dtype != torch.float32:
            return linear
        return PackedLinear.from_linear(linear, self.min_rows)

    def logits(self, weight: torch.Tensor) -> nn.Module | None:
        return PackedLinear(weight, None, self.min_rows)


class Int8Linears(LinearStrategy):
    """fbgemm dynamic int8 (per-channel weights, per-tensor 7-bit activations)."""

    name = "int8"

    def linear(self, linear: nn.Linear) -> nn.Module:
        return Int8DynamicLinear(linear.weight, linear.bias)

    def logits(self, weight: torch.Tensor) -> nn.Module | None:
        return Int8DynamicLinear(weight, None)


@dataclass(frozen=True)
class RowLimits:
    """How BlockQuantLinear runs: ``max_native_rows`` (None: every batch through
    the native kernel) and the block ``layout`` (kernels/quant_linear.py)."""

    max_native_rows: int | None
    layout: int

    @staticmethod
    def measured(kernels: CpuKernels) -> RowLimits:
        """What measured fastest for this build (docs/benchmarks/cpu.md): AVX-512
        VNNI builds run every batch natively on x16-interleaved blocks; others
        read row-major blocks and hand batches above 8 rows to fbgemm's fp16 GEMM."""
        from kernels.quant_linear import ROWS, X16

        if kernels.has_avx512_vnni:
            return RowLimits(None, X16)
        return RowLimits(8, ROWS)


class BlockQuantLinears(LinearStrategy):
    """llama.cpp block formats through the native kernels: every linear in
    ``qtype`` (Q4_1 or Q8_0), the logits projection in Q8_0, as llama.cpp's
    quantizations keep the (tied) embedding at 8 bits: 4-bit logits cost more
    accuracy than they save. ``limits``: see RowLimits (by default what this
    build measured fastest)."""

    def __init__(self, kernels: CpuKernels, qtype: int, limits: RowLimits | None = None) -> None:
        from kernels.quant_linear import Q4_1

        self.kernels = kernels
        self.qtype = qtype
        lim = limits if limits is not None else RowLimits.measured(kernels)
        self.max_native_rows = lim.max_native_rows
        self.layout = lim.layout
        self.name = "q4_1" if qtype == Q4_1 else "q8_0"

    def linear(self, linear: nn.Linear) -> nn.Module:
        return BlockQuantLinear(
            linear.weight,
            linear.bias,
            self.kernels,
            self.qtype,
            self.max_native_rows,
            self.layout,
        )

    def logits(self, weight: torch.Tensor) -> nn.Module | None:
        from kernels.quant_linear import Q8_0

        return BlockQuantLinear(weight, None, self.kernels, Q8_0, self.max_native_rows, self.layout)


# GGUF tensor types whose blocks the q4_1 / q8_0 strategies hold without
# losing more than the file already lost (Q4_0 and Q4_K blocks re-fit as
# Q4_1; 5- and 6-bit types as Q8_0).
_Q4_FILE_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
_Q8_FILE_TYPES = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})


@dataclass(frozen=True)
class LinearChoice:
    """What ``auto`` resolved to, and why (for the startup log)."""

    strategy: LinearStrategy
    reason: str


def make_linear_strategy(
    choice: CpuLinear,
    *,
    device: torch.device,
    dtype: torch.dtype,
    weight_type: str,
    kernels: Callable[[], CpuKernels],
) -> LinearChoice:
    """The strategy for ``--cpu-linear choice``.

    ``weight_type`` is what the file holds for its linear weights (a GGUF
    tensor type name such as ``Q4_1``, or ``float`` for a float checkpoint).
    ``auto``: on the CPU in float32, the native block-quantized path in the
    file's own format for a Q4_x/Q8_0-class GGUF (as llama.cpp, Ollama and
    vLLM's GGUF path run a quantized file), oneDNN-prepacked float32 for a
    float file; plain torch elsewhere (CUDA, half precision).
    ``kernels`` builds the native library on demand.

    Raises:
        ValueError: a choice this device/dtype cannot run (the message names the flag).
    """
    from kernels.cpu_native import NativeBuildError
    from kernels.quant_linear import Q4_1, Q8_0

    cpu32 = device.type == "cpu" and dtype == torch.float32

    def native(qtype: int) -> BlockQuantLinears:
        return BlockQuantLinears(kernels(), qtype)

    if choice == "auto":
        if not cpu32:
            return LinearChoice(TorchLinears(), f"{device.type} in {str(dtype)[6:]}")
        qtype = Q4_1 if weight_type in _Q4_FILE_TYPES else Q8_0
        if weight_type in _Q4_FILE_TYPES | _Q8_FILE_TYPES:
            try:
                return LinearChoice(native(qtype), f"the file holds {weight_type} blocks")
            except NativeBuildError as e:
                logger.warning("native CPU kernels unavailable (%s); float linears instead", e)
        if onednn_packing_available():
            return LinearChoice(OneDnnLinears(), f"{weight_type} weights, float32 on the CPU")
        return LinearChoice(TorchLinears(), "torch has no oneDNN packing here")
    if choice == "torch":
        return LinearChoice(TorchLinears(), "--cpu-linear torch")
    if not cpu32:
        raise ValueError(f"--cpu-linear {choice} is for the CPU in float32")
    if choice == "onednn":
        if not onednn_packing_available():
            raise ValueError("--cpu-linear onednn needs a torch built with oneDNN")
        return LinearChoice(OneDnnLinears(), "--cpu-linear onednn")
    if choice == "int8":
        return LinearChoice(Int8Linears(), "--cpu-linear int8")
    try:
        return LinearChoice(native(Q4_1 if choice == "q4_1" else Q8_0), f"--cpu-linear {choice}")
    except NativeBuildError as e:
        raise ValueError(f"--cpu-linear {choice} needs the native CPU kernels: {e}") from e
