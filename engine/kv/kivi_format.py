"""The KIVI 2-/4-bit KV format: quantized blocks in the same pool as any other.

Each layer's cache is a pair of ``uint8`` tensors, keys ``[num_blocks,
layout.k.nbytes]`` and values ``[num_blocks, layout.v.nbytes]`` (the sides
differ: keys carry scales per channel per group, values per channel group per
token); a row is one block's packed codes, float16 scales/zero points and
float16 slot rows, laid out as ``kernels.kivi`` describes (where the store,
the read rule and the torch reference live). A block's bytes (what the tiers
move) are, per layer, its key row then its value row; they round-trip bit for
bit.

Who owns what: the block pool owns block ids exactly as for plain formats;
each block owns its quantized groups and the float16 rows of its slots. A
full block is fully quantized and never written again, so prefix hashing and
sharing are unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.kv.format import KVFormat, LayerCaches, _cpu_rows
from kernels.kivi import KiviLayout


class KiviKVFormat(KVFormat):
    """KIVI blocks: keys per channel over groups of ``group_size`` tokens, values
    per token over groups of channels, ``bits`` (2 or 4) per element, a float16
    window of ``ring_groups`` groups and optionally the sink group.

    Raises (at construction): ValueError for a group size that does not divide
    the block size, a window that does not fit in a block, or a head size the
    value groups or the packing do not divide.
    """

    name = "kivi"
    # v2: float16 slots (window ring and sinks), key and value rows of their own sizes.
    layout_version = 2

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int,
        group_size: int,
        ring_groups: int = 1,
        sink: bool = False,
    ) -> None:
        super().__init__(num_layers, block_size, num_kv_heads, head_dim)
        self.layout = KiviLayout(
            bits=bits,
            group_size=group_size,
            # Values per token in groups of 32 channels (what divides the head size).
            value_group=math.gcd(32, head_dim),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            ring_groups=ring_groups,
            sink=sink,
        )
        self._kn = self.layout.k.nbytes
        self._vn = self.layout.v.nbytes

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * (self._kn + self._vn)

    def allocate(self, num_blocks: int, device: torch.device) -> LayerCaches:
        kn, vn = self._kn, self._vn
        if device.type == "cpu":
            # One calloc'd buffer per side for every layer (see zeroed_layer_caches:
            # pages become resident only when written); each layer's rows contiguous.
            wk = torch.from_numpy(np.zeros((self.num_layers, num_blocks, kn), dtype=np.uint8))
            wv = torch.from_numpy(np.zeros((self.num_layers, num_blocks, vn), dtype=np.uint8))
            return [(wk[i], wv[i]) for i in range(self.num_layers)]
        return [
            (
                torch.zeros((num_blocks, kn), dtype=torch.uint8, device=device),
                torch.zeros((num_blocks, vn), dtype=torch.uint8, device=device),
            )
            for _ in range(self.num_layers)
        ]

    def read_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self._read_buffer(caches, block_ids, out)
        n = int(block_ids.shape[0])
        kn = self._kn
        if out.device.type == "cpu":
            o = out.numpy().reshape(n, self.num_layers, -1)
            ids = block_ids.numpy()
            for layer, (k_cache, v_cache) in enumerate(caches):
                o[:, layer, :kn] = _cpu_rows(k_cache)[ids]
                o[:, layer, kn:] = _cpu_rows(v_cache)[ids]
            return out
        o_t = out.view(n, self.num_layers, -1)
        for layer, (k_cache, v_cache) in enumerate(caches):
            o_t[:, layer, :kn] = k_cache.index_select(0, block_ids)
            o_t[:, layer, kn:] = v_cache.index_select(0, block_ids)
        return out

    def write_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, data: torch.Tensor
    ) -> None:
        data = self._write_data(caches, block_ids, data)
        n = int(block_ids.shape[0])
        kn = self._kn
        if data.device.type == "cpu":
            d = data.numpy().reshape(n, self.num_layers, -1)
            ids = block_ids.numpy()
            for layer, (k_cache, v_cache) in enumerate(caches):
                _cpu_rows(k_cache)[ids] = d[:, layer, :kn]
                _cpu_rows(v_cache)[ids] = d[:, layer, kn:]
            return
        d_t = data.view(n, self.num_layers, -1)
        for layer, (k_cache, v_cache) in enumerate(caches):
            k_cache.index_copy_(0, block_ids, d_t[:, layer, :kn].contiguous())
            v_cache.index_copy_(0, block_ids, d_t[:, layer, kn:].contiguous())

    def attention_layout(self) -> KiviLayout:
        return self.layout

    def describe(self) -> str:
        lay = self.layout
        return (
            f"{self.name}{lay.bits}/v{self.layout_version}/L{self.num_layers}/bs{self.block_size}"
            f"/h{self.num_kv_heads}/d{self.head_dim}/g{lay.group_size}/gv{lay.value_group}"
            f"/w{lay.ring_groups}/s{int(lay.sink)}"
        )

    def rerotate_keys(
        self,
        caches: LayerCaches,
        block_ids: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> None:
        """Refused: a rotation mixes channel pairs, and KIVI keys are quantized per
        channel, so rotating codes in place is not exact (it would need a
        dequantize-rotate-requantize that changes a block's bytes and values)."""
        raise ValueError("KIVI KV blocks cannot be re-rotated in place (per-channel key codes)")
