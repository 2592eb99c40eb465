"""Block-quantized weights (llama.cpp's Q8_0 and Q4_1) for the native CPU linear.

This module defines the formats and the arithmetic; ``csrc/cpu_quant.c`` is
the fast version (``CpuKernels.quant_linear``), tested against
:func:`quant_linear_ref` here.

Formats (32 weights per block, one scale per block; llama.cpp's reference
quantizers, so a Q4_1 GGUF's dequantized weights quantize back to the same
blocks):

- Q8_0: ``d = amax / 127``, ``q = round(w / d)`` in int8; ``w ~ d * q``.
- Q4_1: ``d = (max - min) / 15``, ``m = min``, ``q = round((w - m) / d)`` in
  0..15; ``w ~ d * q + m``.

Scales are stored as float16 (bit patterns in int16 tensors, read by the C
code as uint16). Q4_1 nibbles are repacked for AVX2: byte ``i`` of block
pair ``p`` holds element ``i`` of block ``2p`` (low nibble) and of block
``2p + 1`` (high nibble); an odd block count is padded with a zero block.

Activations are quantized per 32-element block too, to 15-bit codes
(``dx = amax / 127``, ``qx = round(128 * x / dx)``, held by the kernel as two
int8 planes ``128 * hi + lo``), so the product of two blocks is an integer
dot times ``d * dx / 128`` (plus ``m * dx / 128 * sum(qx)`` for Q4_1): see
:func:`quant_linear_ref`. llama.cpp rounds activations to 8 bits per block
(``round(x / dx)``); on the default model that moved the first-token
distribution by total variation 0.07 from the file's float model and flipped
the greedy answer, 15 bits by 0.0004 (docs/benchmarks/cpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK = 32
Q8_0 = 0
Q4_1 = 1


@dataclass(frozen=True)
class QuantWeight:
    """A ``[out_features, in_features]`` weight in one of the block formats.

    ``qs``: Q8_0 int8 ``[N, K]``; Q4_1 uint8 ``[N, nb / 2, 32]``. ``d`` (and
    ``m`` for Q4_1): float16 bit patterns as int16 ``[N, nb]``, where ``nb`` is
    ``K / 32`` (Q4_1: rounded up to even). All contiguous CPU tensors.
    """

    qtype: int
    out_features: int
    in_features: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK}")
    return w.detach().to(torch.float32).reshape(n, k // QK, QK)


def _half_bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.int16).contiguous()


def _from_half_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.float16).to(torch.float32)


def quantize_q8_0(w: torch.Tensor) -> QuantWeight:
    """Q8_0 blocks of a float ``[N, K]`` weight (K a multiple of 32)."""
    b = _blocks(w)
    d = b.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    n, k = w.shape
    return QuantWeight(Q8_0, n, k, q.reshape(n, k).contiguous(), _half_bits(d), None)


def quantize_q4_1(w: torch.Tensor) -> QuantWeight:
    """Q4_1 blocks of a float ``[N, K]`` weight (K a multiple of 32), repacked."""
    b = _blocks(w)
    lo = b.amin(dim=-1)
    d = (b.amax(dim=-1) - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    # llama.cpp rounds with (int)(v + 0.5) on v >= 0, i.e. half away from zero.
    q = torch.floor((b - lo[..., None]) * inv[..., None] + 0.5).clamp_(0, 15).to(torch.uint8)
    n, nb = d.shape
    if nb % 2:
        q = torch.cat([q, torch.zeros(n, 1, QK, dtype=torch.uint8)], dim=1)
        d = torch.cat([d, torch.zeros(n, 1)], dim=1)
        lo = torch.cat([lo, torch.zeros(n, 1)], dim=1)
    pairs = q.reshape(n, -1, 2, QK)
    packed = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()
    return QuantWeight(Q4_1, n, w.shape[1], packed, _half_bits(d), _half_bits(lo))


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the blocks stand for."""
    n, k = qw.out_features, qw.in_features
    d = _from_half_bits(qw.d)
    if qw.qtype == Q8_0:
        return (qw.qs.reshape(n, -1, QK).float() * d[..., None]).reshape(n, k)
    assert qw.m is not None
    q = torch.stack([qw.qs & 0x0F, qw.qs >> 4], dim=2).reshape(n, -1, QK).float()
    w = q * d[..., None] + _from_half_bits(qw.m)[..., None]
    return w.reshape(n, -1)[:, :k]


ACT_LEVELS = 128  # activation codes per int8 step: 15-bit codes in two int8 planes


def quantize_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[M, K]`` after the per-block 15-bit round trip the kernel applies:
    ``round(x * (1 / dx) * 128) * (dx / 128)`` with ``dx = amax / 127`` in float32
    (the kernel's order of operations, so the codes are the same)."""
    m, k = x.shape
    b = x.to(torch.float32).reshape(m, k // QK, QK)
    d = b.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(b * inv * ACT_LEVELS) * (d / ACT_LEVELS)).reshape(m, k)


def quant_linear_ref(
    x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference for ``CpuKernels.quant_linear``: both operands through their
    block quantization, then an exact (float64) product, as float32."""
    xq = quantize_activations_ref(x).double()
    y = xq @ dequantize(qw).double().T
    if bias is not None:
        y = y + bias.double()
    return y.float()
