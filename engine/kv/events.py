"""KV cache events in vLLM's wire format, for a KV-aware router.

What a router such as vllm-router's ``kv_aware`` policy (``--kv-event-source``)
reads to know which blocks each replica holds, and in which tier:

* :class:`BlockStored`: blocks entered a tier's prefix cache (``medium``
  ``"GPU"``: the device pool, whatever the device is, as vLLM names its
  primary pool; ``"CPU"``: the host tier; ``"DISK"``: the disk tier).
* :class:`BlockRemoved`: blocks left a tier (evicted, dropped by a reset).
* :class:`AllBlocksCleared`: the device prefix cache was reset.

The structs mirror vLLM's ``vllm/distributed/kv_events.py`` field for field
and are encoded with msgspec as vLLM encodes them: the batch is an
``array_like`` struct (a msgpack array in field order), each event a tagged
msgpack map (``"type"``: the class name, then the fields by name; fields at
their defaults, vLLM's later optional ones such as ``extra_keys`` and
``group_idx``, left out)::

    KVEventBatch  = [ts: float, events: [event, ...], data_parallel_rank: int]
    BlockStored   = {"type": "BlockStored", "block_hashes": [bin32, ...],
                     "parent_block_hash": bin32 | nil, "token_ids": [int, ...],
                     "block_size": int, "lora_id": nil, "medium": str, "lora_name": nil}
    BlockRemoved  = {"type": "BlockRemoved", "block_hashes": [bin32, ...], "medium": str}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

vllm-router 0.1.17's ``kv_aware`` decoder insists on exactly this shape ("KV
event batch must be an array", "KV event must be a tagged map" otherwise):
tried on loopback, see tests/test_kv_events.py.

Hashes: a block's key is our chained sha256 digest (``hash_block``: parent
key, the block's tokens, the cache salt), sent as 32 raw bytes (msgpack
``bin``), the type vLLM sends with its sha256 prefix-caching hashes
(``ExternalBlockHash = bytes | int``). Consumers treat it as an opaque id
that links a block to its parent; a router matches prompts by hashing the
``token_ids`` of stored blocks itself.

Collection is the engine thread's, apart from the disk tier's writer thread
(which adds disk evictions): :class:`KVEventCollector` appends under a lock,
merges consecutive blocks of one chain into one event (O(1) per block) and
hands the step's events over once per step. When events are off nobody holds
a collector and the hooks cost one ``is None`` test.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged union (``"type"``: the class name)."""


class BlockStored(KVCacheEvent):
    """``block_hashes`` form a chain: the first block's parent is
    ``parent_block_hash`` (None: the first block of a sequence), each next
    block's parent the one before it; ``token_ids`` are the blocks' tokens
    concatenated (``block_size`` each)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events. ``ts`` is wall-clock seconds (time.time())."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass
class KVEventCounters:
    """Monotonic counters (blocks, except ``batches``)."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    batches: int = 0


class KVEventCollector:
    """The events of the step being run; see the module doc.

    Contract: ``stored`` is called once per block when it enters a tier's
    cache, ``removed`` once when it leaves, each with the tier's medium;
    ``take`` returns everything since the last ``take`` in order.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.counters = KVEventCounters()
        self._events: list[KVEvent] = []
        # Why a lock: the disk writer thread reports disk evictions. Uncontended
        # otherwise (the engine thread is the only other caller).
        self._lock = threading.Lock()

    def stored(
        self, key: bytes, parent: bytes | None, token_ids: Sequence[int], medium: str
    ) -> None:
        with self._lock:
            self.counters.stored += 1
            last = self._events[-1] if self._events else None
            if (
                isinstance(last, BlockStored)
                and last.medium == medium
                and last.block_hashes[-1] == parent
            ):
                last.block_hashes.append(key)
                last.token_ids.extend(token_ids)
                return
            self._events.append(
                BlockStored([key], parent, list(token_ids), self.block_size, None, medium, None)
            )

    def removed(self, key: bytes, medium: str) -> None:
        with self._lock:
            self.counters.removed += 1
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.append(key)
                return
            self._events.append(BlockRemoved([key], medium))

    def cleared(self) -> None:
        with self._lock:
            self.counters.cleared += 1
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events
