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
# Layouts of the blocks (csrc/fuel_internal.h): row-major, or 16 rows
# interleaved per block (pack_x16; read by the AVX-512 VNNI kernels only).
ROWS = 0
X16 = 1


@dataclass(frozen=True)
class QuantWeight:
    """A ``[out_features, in_features]`` weight in one of the block formats.

    Layout ROWS: ``qs``: Q8_0 int8 ``[N, K]``; Q4_1 uint8 ``[N, nb / 2, 32]``.
    ``d`` (and ``m`` for Q4_1): float16 bit patterns as int16 ``[N, nb]``,
    where ``nb`` is ``K / 32`` (Q4_1: rounded up to even). Layout X16: see
    :func:`pack_x16`. All contiguous CPU tensors.
    """

    qtype: int
    out_features: int
    in_features: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    layout: int = ROWS

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


def _codes(qw: QuantWeight) -> torch.Tensor:
    """The ``[N, K / 32, 32]`` uint8/int8 codes of a ROWS-layout weight."""
    n, k = qw.out_features, qw.in_features
    if qw.qtype == Q8_0:
        return qw.qs.reshape(n, k // QK, QK)
    q = torch.stack([qw.qs & 0x0F, qw.qs >> 4], dim=2).reshape(n, -1, QK)
    return q[:, : k // QK]


def pack_x16(qw: QuantWeight) -> QuantWeight:
    """The same blocks with 16 rows interleaved per block (layout X16), as the
    AVX-512 VNNI kernels read them: rows padded with zeros to a multiple of
    16; per group of 16 rows and block, ``qs`` holds Q4_1: 4 vectors of 64
    bytes, byte ``4 i + t`` of vector ``j`` = row ``i``'s code ``4 j + t`` in
    the low nibble and ``16 + 4 j + t`` in the high one; Q8_0: 8 vectors, byte
    ``4 i + t`` of vector ``j`` = row ``i``'s code ``4 j + t``. ``d`` (and
    ``m``): ``[groups, K / 32, 16]`` float16 bits."""
    if qw.layout == X16:
        return qw
    n, k = qw.out_features, qw.in_features
    nbk, groups = k // QK, (n + 15) // 16
    pad = groups * 16 - n
    q = torch.nn.functional.pad(_codes(qw), (0, 0, 0, 0, 0, pad))  # [G*16, nbk, 32]
    q = q.reshape(groups, 16, nbk, QK).permute(0, 2, 1, 3)  # [G, nbk, 16 rows, 32 codes]
    if qw.qtype == Q4_1:
        lo, hi = q[..., :16], q[..., 16:]
        packed = (lo | (hi << 4)).reshape(groups, nbk, 16, 4, 4).permute(0, 1, 3, 2, 4)
    else:
        packed = q.reshape(groups, nbk, 16, 8, 4).permute(0, 1, 3, 2, 4)
    scales = [
        torch.nn.functional.pad(t[:, :nbk], (0, 0, 0, pad))
        .reshape(groups, 16, nbk)
        .transpose(1, 2)
        .contiguous()
        for t in (qw.d, qw.m)
        if t is not None
    ]
    return QuantWeight(
        qw.qtype,
        n,
        k,
        packed.contiguous().reshape(groups, nbk, -1),
        scales[0],
        scales[1] if qw.m is not None else None,
        X16,
    )


def unpack_x16(qw: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes ``[N, K / 32, 32]``, d, m ``[N, K / 32]`` as float32) of an X16 weight."""
    n, k = qw.out_features, qw.in_features
    nbk = k // QK
    groups = qw.qs.shape[0]
    if qw.qtype == Q4_1:
        p = qw.qs.reshape(groups, nbk, 4, 16, 4).permute(0, 1, 3, 2, 4).reshape(groups, nbk, 16, 16)
        q = torch.cat([p & 0x0F, p >> 4], dim=-1)
    else:
        q = qw.qs.reshape(groups, nbk, 8, 16, 4).permute(0, 1, 3, 2, 4).reshape(groups, nbk, 16, 32)
    codes = q.permute(0, 2, 1, 3).reshape(groups * 16, nbk, QK)[:n]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return _from_half_bits(t.transpose(1, 2).reshape(groups * 16, nbk)[:n])

    return codes, rows(qw.d), None if qw.m is None else rows(qw.m)


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the blocks stand for (either layout)."""
    n, k = qw.out_features, qw.in_features
    if qw.layout == X16:
        codes, d, m = unpack_x16(qw)
        w = codes.float() * d[..., None] + (0.0 if m is None else m[..., None])
        return w.reshape(n, k)
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
