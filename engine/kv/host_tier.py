"""The host tier: KV block copies in host memory (pinned on CUDA), LRU-evicted.

On CUDA this is CPU memory below the GPU's pool; on the CPU, where the
"device" pool is the engine's main KV cache, it is a second, larger store
that prefix blocks fall into instead of vanishing, and that swapped-out
requests park their blocks in.

Storage is one ``[capacity, block_nbytes]`` uint8 tensor; a block lives in
one row ("slot"). Each stored block is a :class:`HostEntry` (a ``KVBlock``
whose ``block_id`` is its slot and whose ``ref_count`` counts *pins*).

Pins: an entry with pins > 0 is never evicted. Pins are held by

* a pending copy into the slot (from ``reserve`` until the step's transfers ran),
* a pending copy out of it (a promotion or swap-in, until the transfers ran),
* the disk writer while the row waits to be written through,
* a swapped-out request, for each of its blocks, until it resumes or ends.

Unpinned entries sit in the eviction policy (LRU by default, the same
``EvictionPolicy`` as the device pool). A *private* entry (a swapped
request's own partial block, or any block when prefix caching is off) is
dropped as soon as its last pin goes: nobody else may look it up.

Only the engine thread calls this class. The disk writer thread reads rows
of entries it holds pinned (``row_bytes``), which nobody writes meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.block_pool import EvictionPolicy, KVBlock, LRUEvictionPolicy
from engine.kv.events import MEDIUM_CPU, KVEventCollector
from engine.kv.tier import BlockMeta, KVTier, TierUsage


@dataclass(eq=False)
class HostEntry(KVBlock):
    """One stored block: ``block_id`` is its slot, ``ref_count`` its pins."""

    private: bool = False  # dropped when unpinned (never looked up by content)
    on_disk: bool = False  # a copy is known to be on the disk tier
    # Staged from the disk tier and not promoted since: a hit on it is a disk hit
    # (a request may find blocks staged by an earlier admission attempt).
    from_disk: bool = False

    @property
    def key(self) -> bytes:
        assert self.block_hash is not None
        return self.block_hash

    @property
    def slot(self) -> int:
        return self.block_id

    def meta(self) -> BlockMeta:
        return BlockMeta(self.key, self.token_ids, self.positions or (), self.parent_hash)


class HostTier(KVTier):
    name = "host"

    def __init__(
        self,
        capacity_blocks: int,
        block_nbytes: int,
        pin_memory: bool = False,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        super().__init__(block_nbytes)
        if capacity_blocks < 1:
            raise ValueError("the host KV tier needs room for at least one block")
        self.capacity_blocks = capacity_blocks
        # Uninitialised: a row is read only after a copy filled it (pages are
        # committed as blocks arrive, not at start-up).
        self.storage = torch.empty(
            (capacity_blocks, block_nbytes), dtype=torch.uint8, pin_memory=pin_memory
        )
        self._rows = self.storage.numpy()  # the same memory, for row copies
        self._free: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self._entries: dict[bytes, HostEntry] = {}
        self._by_slot: dict[int, HostEntry] = {}
        self._evictable: EvictionPolicy = eviction or LRUEvictionPolicy()
        # KV events (engine/kv/events.py): content entries stored and dropped, as "CPU".
        self.events: KVEventCollector | None = None

    # ---- lookups --------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def entry(self, key: bytes) -> HostEntry | None:
        return self._entries.get(key)

    def lookup(self, key: bytes, token_ids: Sequence[int]) -> HostEntry | None:
        """The content entry under ``key``, verified to hold exactly ``token_ids``."""
        e = self._entries.get(key)
        if e is None or e.private or e.token_ids != tuple(token_ids):
            return None
        return e

    def entries(self) -> list[HostEntry]:
        return list(self._entries.values())

    @property
    def num_evictable(self) -> int:
        """Entries that ``reserve`` may evict (unpinned)."""
        return len(self._evictable)

    @property
    def num_free_slots(self) -> int:
        """Slots ``reserve`` can fill now: empty ones plus evictable entries."""
        return len(self._free) + len(self._evictable)

    # ---- slots and pins -----------------------------------------------------
    def reserve(self, meta: BlockMeta, private: bool = False) -> HostEntry | None:
        """A new entry for ``meta`` (key not stored yet), pinned once for the
        copy that will fill it; None when every slot is pinned."""
        if meta.key in self._entries:
            raise RuntimeError("host tier: reserving a key that is already stored")
        if self._free:
            slot = self._free.pop()
        elif len(self._evictable):
            victim = self._evictable.pop_victim()
            assert isinstance(victim, HostEntry)
            self._drop(victim)
            self.counters.evicted += 1
            slot = self._free.pop()
        else:
            self.counters.dropped += 1
            return None
        e = HostEntry(
            slot,
            ref_count=1,
            block_hash=meta.key,
            token_ids=meta.token_ids,
            positions=meta.positions,
            parent_hash=meta.parent,
            private=private,
        )
        self._entries[meta.key] = e
        self._by_slot[slot] = e
        self.counters.stored += 1
        if self.events is not None and not private and meta.token_ids is not None:
            self.events.stored(meta.key, meta.parent, meta.token_ids, MEDIUM_CPU)
        return e

    def pin(self, e: HostEntry) -> None:
        if e.ref_count == 0:
            self._evictable.remove(e)
        e.ref_count += 1

    def unpin(self, e: HostEntry) -> None:
        """Drop one pin; at zero the entry becomes evictable, or goes if private."""
        if e.ref_count <= 0:
            raise RuntimeError(f"host tier: unpinning slot {e.slot} with no pin")
        e.ref_count -= 1
        if e.ref_count == 0:
            if e.private:
                self._drop(e)
            else:
                self._evictable.add(e)

    def touch(self, e: HostEntry) -> None:
        """Mark a hit: the entry moves to the most recently used end."""
        if e.ref_count == 0:
            self._evictable.remove(e)
            self._evictable.add(e)

    def _drop(self, e: HostEntry) -> None:
        if self.events is not None and not e.private and e.token_ids is not None:
            self.events.removed(e.key, MEDIUM_CPU)
        del self._entries[e.key]
        del self._by_slot[e.slot]
        self._free.append(e.slot)

    # ---- bytes ------------------------------------------------------------
    # Row copies run through numpy: memory-bound, on the calling thread, with
    # no OpenMP region to wait on (see engine/kv/format.py, _cpu_rows).
    def write_rows(self, slots: torch.Tensor, data: torch.Tensor) -> None:
        """Copy ``data`` (``[n, block_nbytes]`` uint8, CPU) into rows ``slots`` (int64)."""
        self._rows[slots.numpy()] = data.contiguous().numpy()

    def read_rows(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of rows ``slots`` (``[n, block_nbytes]``), into ``out`` (CPU,
        contiguous) when given."""
        if out is None:
            out = torch.empty((int(slots.shape[0]), self.block_nbytes), dtype=torch.uint8)
        np.take(self._rows, slots.numpy(), axis=0, out=out.numpy())
        return out

    def row_bytes(self, e: HostEntry) -> bytes:
        """The bytes of a pinned entry (the disk writer's read; any thread)."""
        return bytes(self._rows[e.slot].tobytes())

    # ---- the KVTier contract ------------------------------------------------
    def put(self, blocks: Sequence[BlockMeta], data: torch.Tensor) -> list[bool]:
        stored: list[bool] = []
        slots: list[int] = []
        rows: list[int] = []
        fresh: list[HostEntry] = []
        for i, meta in enumerate(blocks):
            old = self._entries.get(meta.key)
            if old is not None:
                self.touch(old)
                stored.append(True)
                continue
            e = self.reserve(meta)
            stored.append(e is not None)
            if e is not None:
                slots.append(e.slot)
                rows.append(i)
                fresh.append(e)
        if slots:
            self.write_rows(
                torch.tensor(slots, dtype=torch.int64),
                data.index_select(0, torch.tensor(rows, dtype=torch.int64)),
            )
        for e in fresh:
            self.unpin(e)
        return stored

    def get(self, keys: Sequence[bytes]) -> list[tuple[BlockMeta, torch.Tensor] | None]:
        found = [self._entries.get(k) for k in keys]
        hits = [e for e in found if e is not None]
        rows = (
            self.read_rows(torch.tensor([e.slot for e in hits], dtype=torch.int64))
            if hits
            else None
        )
        out: list[tuple[BlockMeta, torch.Tensor] | None] = []
        j = 0
        for e in found:
            if e is None:
                out.append(None)
                continue
            assert rows is not None
            out.append((e.meta(), rows[j]))
            j += 1
        return out

    def evict(self, num_blocks: int) -> int:
        n = 0
        while n < num_blocks and len(self._evictable):
            victim = self._evictable.pop_victim()
            assert isinstance(victim, HostEntry)
            self._drop(victim)
            self.counters.evicted += 1
            n += 1
        return n

    def usage(self) -> TierUsage:
        return TierUsage(len(self._entries), self.capacity_blocks)

    def check_invariants(self) -> None:
        if len(set(self._free)) != len(self._free):
            raise AssertionError("host tier: a slot is on the free list twice")
        if len(self._entries) + len(self._free) != self.capacity_blocks:
            raise AssertionError(
                f"host tier: {len(self._entries)} entries + {len(self._free)} free slots "
                f"!= {self.capacity_blocks}"
            )
        free = set(self._free)
        unpinned = 0
        for key, e in self._entries.items():
            if e.block_hash != key or self._by_slot.get(e.slot) is not e:
                raise AssertionError(f"host tier: entry in slot {e.slot} is indexed wrongly")
            if e.slot in free:
                raise AssertionError(f"host tier: slot {e.slot} is both used and free")
            if e.ref_count < 0:
                raise AssertionError(f"host tier: slot {e.slot} has negative pins")
            if e.ref_count == 0:
                unpinned += 1
                if e not in self._evictable:
                    raise AssertionError(f"host tier: unpinned slot {e.slot} is not evictable")
            elif e in self._evictable:
                raise AssertionError(f"host tier: pinned slot {e.slot} is evictable")
        if unpinned != len(self._evictable):
            raise AssertionError("host tier: the eviction policy holds entries that are gone")
