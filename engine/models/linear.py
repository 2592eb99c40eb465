"""CPU linears: oneDNN-prepacked fp32, dynamic int8 (fbgemm), block-quantized (native).

On this project's CPUs (AVX2, no AVX-512) torch's default fp32 GEMM (MKL) is
slow for the small row counts of decode steps: at 2-8 rows it cost 2.5-3.5x
its one-row GEMV, while oneDNN with a weight prepacked for its kernels costs
about the same for 1-5 rows as MKL's one row (SmolLM2-135M's linears, one
thread; docs/benchmarks/spec-decode.md). So each packed linear keeps the
plain weight too and picks per call by row count: one row (a lone decode)
on torch's GEMV, two or more (batched decodes, speculative verification
chunks of 1 + k rows, prefill) on oneDNN. The threshold was 8 rows before
speculation made 2-8-row steps common; ``benchmarks/spec_step_bench.py
--min-rows 8,2`` compares the two. Memory for weights doubles (the packed
copy); only one copy is read per call. See also ``benchmarks/cpu_step_bench.py``
(docs/benchmarks/cpu.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from kernels.cpu_native import CpuKernels
    from kernels.quant_linear import QuantWeight


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


def pack_linears(model: nn.Module, min_rows: int = 2) -> int:
    """Replace every float32 ``nn.Linear`` under ``model`` by a PackedLinear; returns the count."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
            setattr(model, name, PackedLinear.from_linear(child, min_rows))
            count += 1
        else:
            count += pack_linears(child, min_rows)
    return count


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


def quantize_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model`` by an Int8DynamicLinear; returns the count."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8DynamicLinear(child.weight, child.bias))
            count += 1
        else:
            count += quantize_linears(child)
    return count


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

    Batches of up to ``max_native_rows`` rows (decode steps of a few
    sequences) run the native integer-dot kernel (kernels/csrc/cpu_quant.c),
    which reads 0.625 bytes per Q4_1 weight: ~2.5x faster than fbgemm int8 or
    fp16 at one row, on par with int8 at 8 rows. Larger batches (prefill
    chunks, wide decode steps) go to an Fp16Linear of the blocks' weight:
    fbgemm int8 would be ~1.2-1.5x faster there, but its per-tensor 7-bit
    activations cost accuracy (on SmolLM2 the prompt's first-token
    distribution moved by total variation 0.5, against 0.001 with fp16;
    tests/test_models.py). Routing only batches with an outlier row to fp16
    was tried and did not help: the row maxima of prefill and decode batches
    look alike (1.2-4x apart) except in a few down projections.
    The native path rounds activations to 8 bits per 32-block, as llama.cpp
    does, so a sequence's logits can differ slightly with its batch's size.

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
        max_native_rows: int = 8,
    ) -> None:
        super().__init__()
        from kernels.quant_linear import Q4_1, dequantize, quantize_q4_1, quantize_q8_0

        w = weight.detach().float()
        self.qweight: QuantWeight = quantize_q4_1(w) if qtype == Q4_1 else quantize_q8_0(w)
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        # The blocks' weight, not the float one: both paths compute with one model.
        self.large = Fp16Linear(dequantize(self.qweight), bias)
        self.kernels = kernels
        self.max_native_rows = max_native_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.dim() == 2
            and x.shape[0] <= self.max_native_rows
            and x.dtype == torch.float32
            and x.is_contiguous()
        ):
            return self.kernels.quant_linear(x, self.qweight, self.bias_f32, validate=False)
        out: torch.Tensor = self.large(x)
        return out


def quantize_linears_blockwise(model: nn.Module, kernels: CpuKernels, qtype: int) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a BlockQuantLinear; returns the count."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, BlockQuantLinear(child.weight, child.bias, kernels, qtype))
            count += 1
        else:
            count += quantize_linears_blockwise(child, kernels, qtype)
    return count
