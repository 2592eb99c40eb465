"""KV formats: how one block's keys and values are laid out in memory, per layer.

A *format* owns the per-layer cache tensors' shapes and dtypes and the
operations that move whole blocks in and out of them. Everything outside the
format, the KV tiers in particular, sees a block only as ``block_nbytes``
opaque bytes: a host or disk tier stores those bytes and never knows whether
they hold float32, float16 or (later) quantized keys with per-block scales.

Contracts every format keeps:

* ``allocate(num_blocks, device)`` returns the per-layer caches the attention
  backends read (for ``PlainKVFormat``: ``(k_cache, v_cache)`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``, the layout in
  ``engine/attention/base.py``).
* ``read_blocks(caches, ids)`` returns ``[n, block_nbytes]`` uint8 on the
  caches' device, one row per block in ``ids`` order; ``write_blocks`` is its
  exact inverse (``write_blocks(c, ids, read_blocks(c, ids))`` is a no-op, and
  bytes read from one engine and written into another with the same
  ``describe()`` reproduce the block bit for bit). Both are batched: one call
  moves any number of blocks (a few tensor ops per layer, never one per block).
* ``rerotate_keys`` moves stored keys from the positions they were rotated
  with to others (RoPE is a rotation, so rotating by the position delta equals
  rotating the raw key at the new position). Values are not positional.
* ``describe()`` names the layout (format, dtype, shape, layout version); it is
  part of the disk tier's model fingerprint, so bytes are never read back
  into a different layout.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from kernels.kivi import KiviLayout
from kernels.rope_shift import rope_shift_paged, rope_shift_paged_ref

# Per-layer cache tensors as the attention backends take them. Plain formats
# use (k_cache, v_cache); a quantized format may carry scales in extra tensors
# and extend the backends' signature (issue 16), which is why the format, not
# its callers, interprets them.
LayerCaches = list[tuple[torch.Tensor, torch.Tensor]]


class KVFormat(ABC):
    """How a block's bytes are laid out per layer, and batched block copies."""

    name: str = "abstract"
    # Bumped whenever a format's byte layout changes: stale disk blocks then miss.
    layout_version: int = 1

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @property
    @abstractmethod
    def block_nbytes(self) -> int:
        """Bytes of one block across every layer, keys and values (what a tier stores)."""

    @abstractmethod
    def allocate(self, num_blocks: int, device: torch.device) -> LayerCaches:
        """Zeroed per-layer caches holding ``num_blocks`` blocks."""

    @abstractmethod
    def read_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[n, block_nbytes]`` uint8 (caches' device): the bytes of ``block_ids``
        (int64), written into ``out`` (contiguous, same shape) when given."""

    @abstractmethod
    def write_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, data: torch.Tensor
    ) -> None:
        """Overwrite blocks ``block_ids`` with rows of ``data`` (``[n, block_nbytes]`` uint8)."""

    @abstractmethod
    def rerotate_keys(
        self,
        caches: LayerCaches,
        block_ids: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> None:
        """Move the keys of ``block_ids`` from ``old_positions`` to ``new_positions``.

        ``old_positions``/``new_positions`` are int64 ``[n, block_size]`` (slot
        ``j`` of block ``i``); ``cos_sin`` is the model's ``[max_pos, head_dim]``
        table (cos | sin, engine/models/llama.py), so RoPE scaling is whatever
        the model uses. In place, every layer.
        """

    def _check(self, caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(caches) != self.num_layers:
            raise ValueError(f"got {len(caches)} layer caches, format has {self.num_layers}")

    def _read_buffer(
        self, caches: LayerCaches, block_ids: torch.Tensor, out: torch.Tensor | None
    ) -> torch.Tensor:
        """``out`` checked, or a new ``[n, block_nbytes]`` uint8 buffer (read_blocks)."""
        self._check(caches)
        n = int(block_ids.shape[0])
        if out is None:
            return torch.empty(
                (n, self.block_nbytes), dtype=torch.uint8, device=caches[0][0].device
            )
        if out.dtype != torch.uint8 or tuple(out.shape) != (n, self.block_nbytes):
            raise ValueError(f"out must be uint8 [{n}, {self.block_nbytes}]")
        return out

    def _write_data(
        self, caches: LayerCaches, block_ids: torch.Tensor, data: torch.Tensor
    ) -> torch.Tensor:
        """``data`` checked and contiguous (write_blocks)."""
        self._check(caches)
        n = int(block_ids.shape[0])
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, self.block_nbytes):
            raise ValueError(
                f"block data must be uint8 [{n}, {self.block_nbytes}], got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        return data.contiguous()

    def copy_blocks(self, caches: LayerCaches, sources: torch.Tensor, dests: torch.Tensor) -> None:
        """Copy whole blocks ``sources`` onto ``dests`` (int64, caches' device), every
        layer: a gather of the sources' bytes, then a scatter (partial prefix hits)."""
        self.write_blocks(caches, dests, self.read_blocks(caches, sources))

    def attention_layout(self) -> KiviLayout | None:
        """The quantized layout the attention backends read (``AttentionMetadata.kv_layout``);
        None for plain ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches."""
        return None

    @property
    def bytes_per_token(self) -> float:
        """KV bytes one token takes across every layer (block bytes / block size)."""
        return self.block_nbytes / self.block_size

    def describe(self) -> str:
        """The layout's identity (goes into the disk tier's fingerprint)."""
        return (
            f"{self.name}/v{self.layout_version}/L{self.num_layers}/bs{self.block_size}"
            f"/h{self.num_kv_heads}/d{self.head_dim}"
        )


def _cpu_rows(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache as ``[num_blocks, block bytes]`` uint8 numpy rows (a view, no copy).

    Why numpy for CPU block copies: they are memory-bound row gathers, which
    one thread does at memory speed, and numpy runs them on the calling thread.
    torch's ``index_select`` opens an OpenMP parallel region per call, and on a
    loaded machine (more runnable threads than cores) every region waits for
    its slowest thread. Measured on the shared 2-core machine (load ~10, 2
    torch threads; ``python -m benchmarks.kv_copy_bench``), gathering 32
    blocks of the default model's layout (23.6 MB): 216 ms median through
    ``index_select``, 22 ms through numpy; scattering 147 ms vs 20 ms.
    """
    return cache.view(cache.shape[0], -1).view(torch.uint8).numpy()


class PlainKVFormat(KVFormat):
    """Unquantized keys and values in one dtype (float32, float16 or bfloat16).

    A block's bytes are, per layer, its key slice ``[block_size, num_kv_heads,
    key_dim]`` then its value slice ``[block_size, num_kv_heads, head_dim]``,
    elements of ``dtype``, row-major: exactly the block's slices of the
    per-layer caches, concatenated. ``key_dim`` is the head size unless keys
    are stored in a low-rank basis (``--kv-low-rank-keys``,
    engine/kv/low_rank.py): then the key cache is ``[num_blocks, block_size,
    num_kv_heads, rank]``, ``key_basis`` (the basis' digest) is part of
    ``describe()``, and keys cannot be re-rotated (RoPE does not commute with
    the basis).
    """

    name = "plain"

    def __init__(
        self,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        key_dim: int | None = None,
        key_basis: str | None = None,
    ) -> None:
        super().__init__(num_layers, block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.key_dim = head_dim if key_dim is None else key_dim
        if not 1 <= self.key_dim <= head_dim:
            raise ValueError(f"key rows of {self.key_dim} elements for head size {head_dim}")
        self.key_basis = key_basis
        self._elem = torch.empty((), dtype=dtype).element_size()
        self._k_elems = block_size * num_kv_heads * self.key_dim
        self._v_elems = block_size * num_kv_heads * head_dim

    @property
    def block_nbytes(self) -> int:
        return self.num_layers * (self._k_elems + self._v_elems) * self._elem

    def allocate(self, num_blocks: int, device: torch.device) -> LayerCaches:
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return zeroed_layer_caches(self.num_layers, shape, self.dtype, device, self.key_dim)

    def read_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self._read_buffer(caches, block_ids, out)
        n = int(block_ids.shape[0])
        kb = self._k_elems * self._elem
        if out.device.type == "cpu":
            o = out.numpy().reshape(n, self.num_layers, -1)
            ids = block_ids.numpy()
            for layer, (k_cache, v_cache) in enumerate(caches):
                o[:, layer, :kb] = _cpu_rows(k_cache)[ids]
                o[:, layer, kb:] = _cpu_rows(v_cache)[ids]
            return out
        # One gather per layer and side into the block's byte order.
        o_t = out.view(self.dtype).view(n, self.num_layers, self._k_elems + self._v_elems)
        ke = self._k_elems
        for layer, (k_cache, v_cache) in enumerate(caches):
            o_t[:, layer, :ke] = k_cache.view(k_cache.shape[0], -1).index_select(0, block_ids)
            o_t[:, layer, ke:] = v_cache.view(v_cache.shape[0], -1).index_select(0, block_ids)
        return out

    def write_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, data: torch.Tensor
    ) -> None:
        data = self._write_data(caches, block_ids, data)
        n = int(block_ids.shape[0])
        kb = self._k_elems * self._elem
        if data.device.type == "cpu":
            d = data.numpy().reshape(n, self.num_layers, -1)
            ids = block_ids.numpy()
            for layer, (k_cache, v_cache) in enumerate(caches):
                _cpu_rows(k_cache)[ids] = d[:, layer, :kb]
                _cpu_rows(v_cache)[ids] = d[:, layer, kb:]
            return
        elems = data.view(self.dtype).view(n, self.num_layers, self._k_elems + self._v_elems)
        ke = self._k_elems
        for layer, (k_cache, v_cache) in enumerate(caches):
            k_cache.view(k_cache.shape[0], -1).index_copy_(0, block_ids, elems[:, layer, :ke])
            v_cache.view(v_cache.shape[0], -1).index_copy_(0, block_ids, elems[:, layer, ke:])

    def describe(self) -> str:
        base = f"{super().describe()}/{str(self.dtype).removeprefix('torch.')}"
        if self.key_dim == self.head_dim and self.key_basis is None:
            return base
        return f"{base}/kr{self.key_dim}/{self.key_basis}"

    def rerotate_keys(
        self,
        caches: LayerCaches,
        block_ids: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> None:
        self._check(caches)
        if self.key_basis is not None:
            raise ValueError(
                "keys stored in a low-rank basis cannot be re-rotated (RoPE does not commute "
                "with the basis)"
            )
        n = int(block_ids.shape[0])
        bs = self.block_size
        if tuple(old_positions.shape) != (n, bs) or tuple(new_positions.shape) != (n, bs):
            raise ValueError(f"positions must be [{n}, {bs}]")
        device = caches[0][0].device
        offs = torch.arange(bs, device=device, dtype=torch.int64)
        slots = (block_ids.to(device=device, dtype=torch.int64)[:, None] * bs + offs).reshape(-1)
        old = old_positions.to(device=device, dtype=torch.int64).reshape(-1)
        new = new_positions.to(device=device, dtype=torch.int64).reshape(-1)
        table = cos_sin.to(device=device, dtype=torch.float32)
        # Triton on CUDA; the vectorised torch version everywhere else (it is the
        # reference too: one gather, one rotation, one scatter per layer).
        shift = rope_shift_paged if device.type == "cuda" else rope_shift_paged_ref
        for k_cache, _ in caches:
            shift(k_cache, slots, old, new, table)


class GroupedKVFormat(KVFormat):
    """Several models' caches addressed by the same block ids, as one format.

    A draft model (speculative decoding) keeps its own KV layer group in the
    target's block ids: block ``b`` of the target and block ``b`` of the draft
    hold the same tokens. The tiers must move both, or a block promoted from
    host or disk would come back with the draft's half missing. A grouped
    block's bytes are each group's bytes in order; ``caches`` is every group's
    layers concatenated in the same order (``groups[0]``'s layers first).
    """

    name = "grouped"

    def __init__(self, groups: Sequence[KVFormat]) -> None:
        if not groups:
            raise ValueError("a grouped KV format needs at least one group")
        bs = {g.block_size for g in groups}
        if len(bs) != 1:
            raise ValueError(f"grouped KV formats must share one block size, got {sorted(bs)}")
        first = groups[0]
        super().__init__(
            sum(g.num_layers for g in groups), first.block_size, first.num_kv_heads, first.head_dim
        )
        self.groups = tuple(groups)

    @property
    def block_nbytes(self) -> int:
        return sum(g.block_nbytes for g in self.groups)

    def _split(self, caches: LayerCaches) -> list[LayerCaches]:
        if len(caches) != self.num_layers:
            raise ValueError(f"got {len(caches)} layer caches, format has {self.num_layers}")
        out, at = [], 0
        for g in self.groups:
            out.append(caches[at : at + g.num_layers])
            at += g.num_layers
        return out

    def _columns(self) -> list[tuple[int, int]]:
        cols, at = [], 0
        for g in self.groups:
            cols.append((at, at + g.block_nbytes))
            at += g.block_nbytes
        return cols

    def allocate(self, num_blocks: int, device: torch.device) -> LayerCaches:
        return [layer for g in self.groups for layer in g.allocate(num_blocks, device)]

    def read_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        n = int(block_ids.shape[0])
        parts = self._split(caches)
        if out is None:
            out = torch.empty((n, self.block_nbytes), dtype=torch.uint8, device=caches[0][0].device)
        elif out.dtype != torch.uint8 or tuple(out.shape) != (n, self.block_nbytes):
            raise ValueError(f"out must be uint8 [{n}, {self.block_nbytes}]")
        for g, c, (a, b) in zip(self.groups, parts, self._columns()):
            # Column slices of ``out`` are strided: each group reads into its own
            # contiguous rows, copied into place (one copy per group per call).
            out[:, a:b] = g.read_blocks(c, block_ids)
        return out

    def write_blocks(
        self, caches: LayerCaches, block_ids: torch.Tensor, data: torch.Tensor
    ) -> None:
        n = int(block_ids.shape[0])
        if data.dtype != torch.uint8 or tuple(data.shape) != (n, self.block_nbytes):
            raise ValueError(
                f"block data must be uint8 [{n}, {self.block_nbytes}], got "
                f"{data.dtype} {tuple(data.shape)}"
            )
        for g, c, (a, b) in zip(self.groups, self._split(caches), self._columns()):
            g.write_blocks(c, block_ids, data[:, a:b].contiguous())

    def rerotate_keys(
        self,
        caches: LayerCaches,
        block_ids: torch.Tensor,
        old_positions: torch.Tensor,
        new_positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> None:
        """Every group rotated with the one ``cos_sin`` table: valid when the groups
        share RoPE (a model and its self-draft, or a draft with the same table);
        groups of different head sizes are refused."""
        if len({g.head_dim for g in self.groups}) != 1:
            raise ValueError("groups of different head sizes cannot share one RoPE table")
        for g, c in zip(self.groups, self._split(caches)):
            g.rerotate_keys(c, block_ids, old_positions, new_positions, cos_sin)

    def describe(self) -> str:
        return "grouped[" + "+".join(g.describe() for g in self.groups) + "]"


_NUMPY_KV_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def zeroed_layer_caches(
    num_layers: int,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    key_dim: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed ``(k, v)`` caches of ``shape`` per layer (keys ``key_dim`` wide
    in their last dimension when given: low-rank keys).

    On the CPU all layers share one calloc'd buffer (numpy's zeros): the kernel
    hands back untouched zero pages, resident only once a block is written, so
    the server's RSS follows the cache in use; ``torch.zeros`` writes every page
    at start-up (1 GiB resident for the default ``--kv-cache-memory``). Each
    layer's k and v are contiguous views of it.
    """
    kshape = shape if key_dim is None else (*shape[:3], key_dim)
    ke, ve = math.prod(kshape), math.prod(shape)
    if device.type == "cpu" and dtype in _NUMPY_KV_DTYPES:
        whole = torch.from_numpy(np.zeros((num_layers, ke + ve), dtype=_NUMPY_KV_DTYPES[dtype]))
        return [(whole[i, :ke].view(kshape), whole[i, ke:].view(shape)) for i in range(num_layers)]
    return [
        (
            torch.zeros(kshape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]
