"""The KV tier contract: a store of fixed-size, opaque KV blocks with a budget.

The memory hierarchy is device pool -> host tier -> disk tier. The device pool
is the engine's ``BlockPool`` (engine/kv/block_pool.py): its blocks are live
memory that requests reference and the model writes, so it hands out block
ids rather than storing copies. Every tier *below* it is a :class:`KVTier`: a
content-addressed store of copies, each ``block_nbytes`` bytes as the
engine's ``KVFormat`` laid them out (engine/kv/format.py), which the tier
never interprets. Tiers are strategy objects: the hierarchy
(engine/kv/hierarchy.py) composes them, and the scheduler never sees which
tier a block came from.

Keys are the chained block hash (parent hash, tokens, cache salt; see
``hash_block``) for shareable blocks, or a private key for a swapped-out
request's own blocks. Every stored block records the tokens it holds (hits
are verified against them) and the position ids its keys were rotated with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockMeta:
    """What a tier stores beside a block's bytes.

    ``token_ids`` is None for private (swap) blocks, which are never looked up
    by content. ``positions`` are the position ids the block's keys were
    rotated with, slot by slot (a ``range`` for the usual contiguous block).
    """

    key: bytes
    token_ids: tuple[int, ...] | None
    positions: Sequence[int]
    # The previous block's key in its chain, when known (KV events only; not
    # stored on disk, so a block read back from disk gets it from its lookup).
    parent: bytes | None = None


@dataclass(frozen=True)
class TierUsage:
    used_blocks: int
    capacity_blocks: int

    @property
    def fraction(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0


@dataclass
class TierCounters:
    """Monotonic counters of one tier (blocks, except where named)."""

    stored: int = 0  # blocks written into this tier (demotions, swap-outs, staging)
    read: int = 0  # blocks read out of it towards the device (promotions, swap-ins)
    evicted: int = 0  # blocks dropped to make room
    dropped: int = 0  # blocks that could not be stored (no room, queue full, disabled)
    corrupt: int = 0  # blocks found truncated, corrupted or foreign (then a miss)
    write_errors: int = 0  # failed writes (disk full, read-only)


class KVTier(ABC):
    """A store of KV block copies keyed by block key (host memory, disk, ...).

    Batched: ``put`` and ``get`` take any number of blocks in one call.
    Thread-safety is per implementation (the disk tier is shared with its
    writer thread; the host tier is touched by the engine thread only, apart
    from rows it lends out pinned).
    """

    name: str = "abstract"

    def __init__(self, block_nbytes: int) -> None:
        self.block_nbytes = block_nbytes
        self.counters = TierCounters()

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether a block with ``key`` is stored (a later ``get`` may still miss)."""

    @abstractmethod
    def put(self, blocks: Sequence[BlockMeta], data: torch.Tensor) -> list[bool]:
        """Store ``blocks`` (rows of ``data``, uint8 ``[n, block_nbytes]`` on the CPU).

        Makes room by evicting as the tier's policy says; returns, per block,
        whether it is stored now. A block already stored is left as it is
        (True).
        """

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[tuple[BlockMeta, torch.Tensor] | None]:
        """Read blocks: per key its metadata and ``[block_nbytes]`` uint8 bytes, or None (miss)."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` blocks in eviction order; returns how many went."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def check_invariants(self) -> None:
        """Debug: the tier's own accounting (raises AssertionError)."""
        return None
