"""The pool of KV cache blocks: O(1) allocate/free, reference counts, prefix-cache index.

Ownership contract
------------------
* A block id is valid for a holder from the moment ``allocate`` (or ``touch``
  on a cache hit) hands it out until the holder passes it back to ``free``.
  Each hand-out adds one reference; each ``free`` drops one.
* A block with reference count 0 is either *free* (no contents worth keeping)
  or *evictable* (it holds a full, hashed block that the prefix cache can still
  hand out). Evictable blocks are reclaimed, least recently freed first (the
  eviction policy decides), only when no free block is left.
* Only full blocks are hashed. A hashed block's contents never change while it
  is hashed: the KV manager hashes a block only after every slot in it is
  written, and nobody writes into a block whose reference count is above 1.
* Cached blocks are also indexed by their *family* (the key of the block
  before them in their chain, or a per-tenant root key for a chain's first
  block), so that a prompt whose next block is not cached can still find the
  cached blocks that continue the same prefix and share a partial tail with
  one of them (``children``; partial prefix hits, engine/kv/manager.py).
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv.events import MEDIUM_GPU, KVEventCollector


@dataclass(eq=False)
class KVBlock:
    """Bookkeeping for one block of ``block_size`` KV slots.

    ``positions`` are the position ids the block's keys were rotated with,
    slot by slot (kept for RoPE: ``KVFormat.rerotate_keys`` moves them). The
    KV manager sets them when it hands the block to a request; a plain
    request's block ``i`` holds positions ``i * block_size ...``. The host and
    disk tiers store them beside each block they keep. The tiers below the
    device reuse this class for their own entries (``block_id`` is then their
    slot or serial number, ``ref_count`` their pin count), so that one
    ``EvictionPolicy`` serves every tier.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens a hashed block holds (hit verification)
    positions: Sequence[int] | None = None
    parent_hash: bytes | None = None  # the previous block's key in its chain (KV events)
    family: bytes | None = None  # the children index it is listed under (hashed blocks only)


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained, collision-resistant key of a full block (sha256).

    The key covers the parent block's key, so equal keys mean equal prefixes,
    plus ``extra`` (cache salt, adapter ids) so that tenants never share.
    """
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(extra)
    return h.digest()


class EvictionPolicy(ABC):
    """Chooses which evictable (cached, unreferenced) block to reclaim."""

    @abstractmethod
    def add(self, block: KVBlock) -> None:
        """``block`` became evictable (reference count dropped to 0)."""

    @abstractmethod
    def remove(self, block: KVBlock) -> None:
        """``block`` is referenced again (a cache hit); it must no longer be evicted."""

    @abstractmethod
    def pop_victim(self) -> KVBlock:
        """Remove and return the block to reclaim. Only called when non-empty."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: KVBlock) -> bool: ...


class LRUEvictionPolicy(EvictionPolicy):
    """Least recently freed first; O(1) add, remove and pop (an ordered dict)."""

    def __init__(self) -> None:
        self._blocks: OrderedDict[int, KVBlock] = OrderedDict()

    def add(self, block: KVBlock) -> None:
        self._blocks[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        del self._blocks[block.block_id]

    def pop_victim(self) -> KVBlock:
        return self._blocks.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._blocks

    def order(self) -> list[int]:
        """Block ids from next victim to last (for tests and debugging)."""
        return list(self._blocks)


class BlockPool:
    """All KV blocks of the cache, with a free stack and a prefix-cache index."""

    def __init__(
        self,
        num_blocks: int,
        eviction: EvictionPolicy | None = None,
        on_evict: Callable[[KVBlock], None] | None = None,
    ) -> None:
        """``on_evict(block)`` is called when a cached block is reclaimed for reuse,
        before its hash is dropped and before anyone can write into it (the KV
        manager demotes it to the host tier there)."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Reversed so that pop() hands out low ids first (easier to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: EvictionPolicy = eviction or LRUEvictionPolicy()
        self._cached: dict[bytes, KVBlock] = {}
        # family key -> {block id: block}: the cached blocks continuing one prefix.
        self._children: dict[bytes, dict[int, KVBlock]] = {}
        self._on_evict = on_evict
        self.num_evicted = 0  # cached blocks reclaimed for reuse (counter)
        # KV events (engine/kv/events.py): set by the engine when they are on.
        self.events: KVEventCollector | None = None

    # ---- counts -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def eviction_policy(self) -> EvictionPolicy:
        return self._evictable

    # ---- allocation ---------------------------------------------------
    def allocate(self) -> KVBlock:
        """Hand out one block with reference count 1. Caller checks capacity first."""
        if self._free:
            block = self.blocks[self._free.pop()]
        elif len(self._evictable):
            block = self._evictable.pop_victim()
            self.num_evicted += 1
            if self._on_evict is not None:
                self._on_evict(block)
            self._uncache(block)
        else:
            raise RuntimeError("KV block pool exhausted")
        block.ref_count = 1
        return block

    def free(self, block: KVBlock) -> None:
        """Drop one reference; at zero the block becomes evictable (hashed) or free."""
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block.block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._evictable.add(block)
            else:
                self._free.append(block.block_id)

    def touch(self, block: KVBlock) -> None:
        """Take one more reference to a block (a prefix-cache hit or a shared prefix)."""
        if block.ref_count == 0:
            self._evictable.remove(block)
        block.ref_count += 1

    # ---- prefix-cache index --------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block with this key, verified to hold exactly ``token_ids``."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(
        self,
        block: KVBlock,
        block_hash: bytes,
        token_ids: Sequence[int],
        parent: bytes | None = None,
        family: bytes | None = None,
    ) -> None:
        """Register a full, written block under its key (first writer wins);
        ``parent`` is the key of the block before it in its chain (None: first).
        ``family`` lists it in the children index (``children``): the parent's
        key, or for a chain's first block a root key that keeps tenants apart;
        None leaves it out of the index."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent_hash = parent
        self._cached[block_hash] = block
        if family is not None:
            block.family = family
            self._children.setdefault(family, {})[block.block_id] = block
        if self.events is not None:
            self.events.stored(block_hash, parent, block.token_ids, MEDIUM_GPU)

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash, MEDIUM_GPU)
            if block.family is not None:
                siblings = self._children[block.family]
                del siblings[block.block_id]
                if not siblings:
                    del self._children[block.family]
                block.family = None
            block.block_hash = None
            block.token_ids = None
            block.parent_hash = None
        block.positions = None

    def children(self, family: bytes) -> list[KVBlock]:
        """The cached blocks (referenced or evictable) listed under ``family``:
        every cached continuation of one prefix. Valid until the pool changes."""
        siblings = self._children.get(family)
        return list(siblings.values()) if siblings else []

    def cached_blocks(self) -> list[KVBlock]:
        """Every block registered in the prefix cache (referenced or evictable)."""
        return list(self._cached.values())

    def reset_prefix_cache(self) -> int:
        """Forget every evictable cached block; returns how many were dropped.

        KV events: one ``AllBlocksCleared``, then a ``BlockStored`` for each
        cached block still referenced (a running request's prefix stays
        cached, so a consumer's view stays exact)."""
        events, self.events = self.events, None  # the reset is reported as a whole
        n = 0
        try:
            while len(self._evictable):
                block = self._evictable.pop_victim()
                self._uncache(block)
                self._free.append(block.block_id)
                n += 1
        finally:
            self.events = events
        if events is not None:
            events.cleared()
            for b in self._cached.values():
                assert b.block_hash is not None and b.token_ids is not None
                events.stored(b.block_hash, b.parent_hash, b.token_ids, MEDIUM_GPU)
        return n

    def check_invariants(self) -> None:
        """Free + evictable + referenced == all blocks; no id listed twice."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block id is on the free stack twice")
        referenced = sum(1 for b in self.blocks if b.ref_count > 0)
        if referenced + len(self._free) + len(self._evictable) != self.num_blocks:
            raise AssertionError(
                f"block accounting broken: {referenced} referenced + {len(self._free)} free "
                f"+ {len(self._evictable)} evictable != {self.num_blocks}"
            )
        for family, siblings in self._children.items():
            for bid, b in siblings.items():
                if b.block_id != bid or b.family != family or b.block_hash is None:
                    raise AssertionError(f"children index lists block {bid} wrongly")
        for key, b in self._cached.items():
            if b.block_hash != key:
                raise AssertionError(f"cached block {b.block_id} is indexed under another key")
        for b in self.blocks:
            if b.block_hash is not None and self._cached.get(b.block_hash) is not b:
                raise AssertionError(f"hashed block {b.block_id} is missing from the index")
            if b.ref_count < 0:
                raise AssertionError(f"block {b.block_id} has negative reference count")
            if b.family is not None and (
                b.block_hash is None or self._children.get(b.family, {}).get(b.block_id) is not b
            ):
                raise AssertionError(f"block {b.block_id} is misfiled in the children index")
            if b.ref_count > 0 and (b.block_id in free or b in self._evictable):
                raise AssertionError(f"referenced block {b.block_id} is also free")
