"""The KIVI 2-/4-bit KV format: quantized blocks in the same pool as any other.

Each layer's cache is a pair of ``uint8 [num_blocks, side_nbytes]`` tensors
(keys, values); a row is one block's packed codes, float16 scales/zero points
and float16 residual rows, laid out as ``kernels.kivi`` describes (where the
store, the read rule and the torch reference live). Because a block is still
one row per side per layer, block copies for the tiers are the plain format's
row gathers on bytes, and a block's bytes round-trip bit for bit.

Who owns what: the block pool owns block ids exactly as for plain formats;
each block owns its own residual rows (its current group at float16) and its
quantized groups. A full block is fully quantized and never written again, so
prefix hashing and sharing are unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.kv.format import LayerCaches, PlainKVFormat
from kernels.kivi import KiviLayout


class KiviKVFormat(PlainKVFormat):
    """KIVI blocks: keys per channel over groups of ``group_size`` tokens, values
    per token over groups of channels, ``bits`` (2 or 4) per element.

    Raises (at construction): ValueError for a group size that does not divide
    the block size, or a head size the value groups or the packing do not divide.
    """

    name = "kivi"

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        bits: int,
        group_size: int,
    ) -> None:
        # The plain format's byte-row copies, over uint8 rows of side_nbytes.
        super().__init__(num_layers, block_size, num_kv_heads, head_dim, torch.uint8)
        self.layout = KiviLayout(
            bits=bits,
            group_size=group_size,
            value_group=min(group_size, head_dim),
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        self._block_elems = self.layout.side_nbytes

    def allocate(self, num_blocks: int, device: torch.device) -> LayerCaches:
        n = self.layout.side_nbytes
        if device.type == "cpu":
            # One calloc'd buffer for every layer (see zeroed_layer_caches: pages
            # become resident only when written).
            whole = torch.from_numpy(np.zeros((self.num_layers, 2, num_blocks, n), dtype=np.uint8))
            return [(whole[i, 0], whole[i, 1]) for i in range(self.num_layers)]
        return [
            (
                torch.zeros((num_blocks, n), dtype=torch.uint8, device=device),
                torch.zeros((num_blocks, n), dtype=torch.uint8, device=device),
            )
            for _ in range(self.num_layers)
        ]

    def attention_layout(self) -> KiviLayout:
        return self.layout

    def describe(self) -> str:
        lay = self.layout
        return (
            f"{self.name}{lay.bits}/v{self.layout_version}/L{self.num_layers}/bs{self.block_size}"
            f"/h{self.num_kv_heads}/d{self.head_dim}/g{lay.group_size}/gv{lay.value_group}"
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
