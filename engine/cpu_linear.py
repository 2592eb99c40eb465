"""oneDNN-prepacked linears for the CPU path.

On this project's CPUs (AVX2, no AVX-512) torch's default fp32 GEMM (MKL) is
slow for the small row counts of decode steps; oneDNN with a weight prepacked
for its kernels is faster from about 8 rows up but slower for 1-4 rows. So
each packed linear keeps the plain weight too and picks per call by row
count. Memory for weights doubles (the packed copy); only one copy is read
per call. Measured by ``loadtest/cpu_step_bench.py`` (docs/benchmarks/cpu.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_packing_available() -> bool:
    return (
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with W also prepacked for oneDNN (used when rows >= ``min_rows``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.min_rows = min_rows
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 16)

    @classmethod
    def from_linear(cls, linear: nn.Linear, min_rows: int = 8) -> PackedLinear:
        return cls(linear.weight, linear.bias, min_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] >= self.min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def pack_linears(model: nn.Module, min_rows: int = 8) -> int:
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
        self.inner = DynamicQuantLinear(in_features, out_features, bias_=bias is not None)
        self.inner.set_weight_bias(qweight, None if bias is None else bias.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


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
