"""The disk tier: a persistent, content-addressed store of KV blocks, one file each.

Keys and names
--------------
A block's key is its chained block hash (parent hash, tokens, cache salt).
Its file name is ``sha256(fingerprint || key)`` in hex, under a two-character
subdirectory: the *model fingerprint* (engine/kv/fingerprint.py: weights,
dtypes, KV format and block size, layout version) is part of the name, so
engines of different models or settings can share one directory without ever
reading each other's blocks, and an engine restarted with the same model
finds its blocks again.

File format (little-endian; no pickle, nothing executable)
-----------------------------------------------------------
``header | token ids | positions | checksum | payload`` where the header is
``magic "FUELKVB1", format version u32, header bytes u32, tokens n u32,
fingerprint 32 B, key 32 B, payload bytes u64``; token ids and positions are
``n`` int64 each; the checksum is xxh3-128 over everything before it plus the
payload. A read checks the size, magic, version, fingerprint, key, token
count, payload size and checksum; any mismatch (truncated, corrupted,
foreign, renamed) is counted in ``counters.corrupt``, the file is removed and
the lookup is a miss. Nothing unchecked is ever served.

Writes go to a temporary file in the same directory and are renamed into
place (``os.replace``, atomic on POSIX), so a reader, a second server on the
same directory or a crash mid-write never sees a partial block under a real
name. (There is no fsync: after a power loss a renamed file may be torn, and
the checksum turns that into a counted miss.) Leftover temporary files older
than an hour are removed at start-up.

Faults: a write that fails (disk full, read-only or vanished directory,
permissions) is logged once, counted in ``counters.write_errors``, and turns
writes off for the rest of the run; reads of valid blocks carry on. Nothing
here raises into a request.

Budget: ``capacity_bytes``; beyond it the least recently used files go
(LRU through the same ``EvictionPolicy`` as the other tiers; order at
start-up by modification time, refreshed on every hit). Files written by
another server on the directory are found on a lookup miss (one ``stat``) and
join the index.

Threads: the engine thread looks blocks up and reads them; the
:class:`DiskWriter` thread writes through; both go through one lock for the
index (file I/O happens outside it).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
import xxhash

from engine.kv.block_pool import EvictionPolicy, KVBlock, LRUEvictionPolicy
from engine.kv.events import MEDIUM_DISK, KVEventCollector
from engine.kv.tier import BlockMeta, KVTier, TierUsage

logger = logging.getLogger(__name__)

MAGIC = b"FUELKVB1"
FILE_VERSION = 1
_HEAD = struct.Struct("<8sIII32s32sQ")
_DIGEST = 16
_SUFFIX = ".kvb"
_STALE_TMP_S = 3600.0


@dataclass(eq=False)
class DiskEntry(KVBlock):
    """One file in the index: ``block_id`` is a serial number, ``block_hash`` the name."""

    nbytes: int = 0
    key: bytes | None = None  # the block key, for blocks written by this process (KV events)

    @property
    def name(self) -> str:
        assert self.block_hash is not None
        return self.block_hash.hex()


class DiskTier(KVTier):
    name = "disk"

    def __init__(
        self,
        root: Path,
        capacity_bytes: int,
        block_nbytes: int,
        block_size: int,
        fingerprint: bytes,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        """Open (creating if needed) the store at ``root``.

        Raises:
            OSError: ``root`` cannot be created or listed (the caller then runs
                without a disk tier).
        """
        super().__init__(block_nbytes)
        if len(fingerprint) != 32:
            raise ValueError("the model fingerprint must be 32 bytes")
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.header_nbytes = _HEAD.size + 16 * block_size + _DIGEST
        self.file_nbytes = self.header_nbytes + block_nbytes
        self.writable = True
        self._lock = threading.Lock()
        # KV events (engine/kv/events.py): blocks this process wrote and evicted, as "DISK"
        # (any thread: the collector locks).
        self.events: KVEventCollector | None = None
        self._index: dict[bytes, DiskEntry] = {}
        self._lru: EvictionPolicy = eviction or LRUEvictionPolicy()
        self._serial = 0
        self.used_bytes = 0
        self._warned: set[str] = set()
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    # ---- names --------------------------------------------------------
    def _name(self, key: bytes) -> bytes:
        return hashlib.sha256(self.fingerprint + key).digest()

    def _path(self, name: bytes) -> Path:
        h = name.hex()
        return self.root / h[:2] / (h + _SUFFIX)

    def _scan(self) -> None:
        """Index the files already in the directory, oldest first."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f.name.endswith(_SUFFIX):
                    try:
                        name = bytes.fromhex(f.name[: -len(_SUFFIX)])
                    except ValueError:
                        continue
                    if len(name) == 32:
                        found.append((st.st_mtime, name, st.st_size))
                elif f.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    # A crash mid-write left it; a live writer renames within seconds.
                    try:
                        f.unlink()
                    except OSError:
                        pass
        found.sort()
        with self._lock:
            for _, name, size in found:
                self._add_locked(name, size)
            self._evict_over_budget_locked()

    def _add_locked(self, name: bytes, size: int, key: bytes | None = None) -> DiskEntry:
        e = DiskEntry(self._serial, block_hash=name, nbytes=size, key=key)
        self._serial += 1
        self._index[name] = e
        self._lru.add(e)
        self.used_bytes += size
        return e

    def _forget_locked(self, e: DiskEntry) -> None:
        if self._index.get(e.block_hash or b"") is e:
            del self._index[e.block_hash or b""]
            if e in self._lru:
                self._lru.remove(e)
            self.used_bytes -= e.nbytes

    def _pop_victim_locked(self) -> None:
        victim = self._lru.pop_victim()
        assert isinstance(victim, DiskEntry) and victim.block_hash is not None
        del self._index[victim.block_hash]
        self.used_bytes -= victim.nbytes
        if self.events is not None and victim.key is not None:
            self.events.removed(victim.key, MEDIUM_DISK)
        self._unlink(self._path(victim.block_hash))
        self.counters.evicted += 1

    def _evict_over_budget_locked(self) -> None:
        while self.used_bytes > self.capacity_bytes and len(self._lru):
            self._pop_victim_locked()

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass  # already gone (another server evicted it) or not ours to remove

    def _warn_once(self, what: str, err: BaseException) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("KV disk tier %s: %s: %s", self.root, what, err)

    # ---- the KVTier contract ----------------------------------------------
    def contains(self, key: bytes) -> bool:
        name = self._name(key)
        with self._lock:
            if name in self._index:
                return True
        path = self._path(name)
        try:
            size = path.stat().st_size
        except OSError:
            return False
        with self._lock:  # written by another server on this directory
            if name not in self._index:
                self._add_locked(name, size)
                self._evict_over_budget_locked()
            return name in self._index

    def get(self, keys: Sequence[bytes]) -> list[tuple[BlockMeta, torch.Tensor] | None]:
        return [self._read(k) for k in keys]

    def _read(self, key: bytes) -> tuple[BlockMeta, torch.Tensor] | None:
        name = self._name(key)
        path = self._path(name)
        try:
            with path.open("rb") as f:
                raw = f.read(self.file_nbytes + 1)
        except OSError:
            with self._lock:
                e = self._index.get(name)
                if e is not None:
                    self._forget_locked(e)
            return None
        parsed = self._parse(raw, key)
        with self._lock:
            e = self._index.get(name)
            if parsed is None:
                self.counters.corrupt += 1
                if e is not None:
                    self._forget_locked(e)
            elif e is None:
                self._add_locked(name, len(raw))
            else:
                self._lru.remove(e)
                self._lru.add(e)
        if parsed is None:
            logger.info("KV disk tier: %s failed its checks; removed, counted, missed", path)
            self._unlink(path)
            return None
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return parsed

    def _parse(self, raw: bytes, key: bytes) -> tuple[BlockMeta, torch.Tensor] | None:
        """Verify one file's bytes; None when anything is off."""
        n = self.block_size
        if len(raw) != self.file_nbytes:
            return None
        magic, version, hdr, ntok, fp, fkey, payload = _HEAD.unpack_from(raw, 0)
        if (
            magic != MAGIC
            or version != FILE_VERSION
            or hdr != self.header_nbytes
            or ntok != n
            or fp != self.fingerprint
            or fkey != key
            or payload != self.block_nbytes
        ):
            return None
        body = self.header_nbytes - _DIGEST
        digest = xxhash.xxh3_128()
        digest.update(memoryview(raw)[:body])
        digest.update(memoryview(raw)[self.header_nbytes :])
        if digest.digest() != raw[body : self.header_nbytes]:
            return None
        arrays = struct.unpack_from(f"<{2 * n}q", raw, _HEAD.size)
        meta = BlockMeta(key, tuple(arrays[:n]), tuple(arrays[n:]))
        data = torch.frombuffer(bytearray(raw[self.header_nbytes :]), dtype=torch.uint8)
        return meta, data

    def encode(self, meta: BlockMeta, payload: bytes) -> bytes:
        """One block's file bytes (header, tokens, positions, checksum, payload)."""
        n = self.block_size
        if meta.token_ids is None or len(meta.token_ids) != n or len(meta.positions) != n:
            raise ValueError("a disk block needs its block_size token ids and positions")
        if len(payload) != self.block_nbytes:
            raise ValueError(f"payload is {len(payload)} bytes, blocks are {self.block_nbytes}")
        head = _HEAD.pack(
            MAGIC,
            FILE_VERSION,
            self.header_nbytes,
            n,
            self.fingerprint,
            meta.key,
            len(payload),
        ) + struct.pack(f"<{2 * n}q", *meta.token_ids, *meta.positions)
        digest = xxhash.xxh3_128()
        digest.update(head)
        digest.update(payload)
        return head + digest.digest() + payload

    def write_block(self, meta: BlockMeta, payload: bytes) -> bool:
        """Write one block (temp file + rename). False when not written (see faults).

        Any thread: the writer thread writes through, the engine thread flushes.
        """
        name = self._name(meta.key)
        with self._lock:
            if not self.writable:
                self.counters.dropped += 1
                return False
            if name in self._index:
                return True
        path = self._path(name)
        blob = self.encode(meta, payload)
        tmp: str | None = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            with self._lock:
                self.counters.write_errors += 1
                self.writable = False
            self._warn_once("writes failed; running without disk writes", e)
            return False
        finally:
            if tmp is not None:
                self._unlink(Path(tmp))
        with self._lock:
            if name not in self._index:
                self._add_locked(name, len(blob), meta.key)
                if self.events is not None and meta.token_ids is not None:
                    self.events.stored(meta.key, meta.parent, meta.token_ids, MEDIUM_DISK)
            self.counters.stored += 1
            self._evict_over_budget_locked()
        return True

    def put(self, blocks: Sequence[BlockMeta], data: torch.Tensor) -> list[bool]:
        rows = data.contiguous()
        return [self.write_block(m, rows[i].numpy().tobytes()) for i, m in enumerate(blocks)]

    def evict(self, num_blocks: int) -> int:
        with self._lock:
            n = 0
            while n < num_blocks and len(self._lru):
                self._pop_victim_locked()
                n += 1
            return n

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._index), self.capacity_bytes // self.file_nbytes)

    def check_invariants(self) -> None:
        with self._lock:
            total = sum(e.nbytes for e in self._index.values())
            if total != self.used_bytes:
                raise AssertionError(f"disk tier: {total} bytes indexed, {self.used_bytes} counted")
            if len(self._lru) != len(self._index):
                raise AssertionError("disk tier: eviction order and index disagree")
            for name, e in self._index.items():
                if e.block_hash != name or e not in self._lru:
                    raise AssertionError(f"disk tier: entry {name.hex()} indexed wrongly")


T = TypeVar("T")


class DiskWriter(Generic[T]):
    """Write-through off the step's critical path: a thread and a bounded queue.

    ``submit(meta, read, token)`` queues one block (``read()`` returns its
    bytes, called on the writer thread) and returns False at once when the
    queue is full: the caller keeps the block pending and writes it at the
    latest on ``flush``. Tokens of finished jobs (written or not) come back
    through ``completed()`` on the caller's thread, in any order.
    """

    def __init__(self, disk: DiskTier, max_pending: int) -> None:
        self.disk = disk
        self._q: queue.Queue[tuple[BlockMeta, Callable[[], bytes], T] | None] = queue.Queue(
            maxsize=max(1, max_pending)
        )
        self._done: queue.SimpleQueue[tuple[T, bool]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fuel-kv-disk", daemon=True)
        self._thread.start()

    def submit(self, meta: BlockMeta, read: Callable[[], bytes], token: T) -> bool:
        try:
            self._q.put_nowait((meta, read, token))
        except queue.Full:
            return False
        return True

    def completed(self) -> list[tuple[T, bool]]:
        """``(token, written)`` for every job finished since the last call."""
        out: list[tuple[T, bool]] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def drain(self) -> None:
        """Block until every queued job is done."""
        self._q.join()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30.0)

    def _run(self) -> None:
        while True:
            job = self._q.get()
            try:
                if job is None:
                    return
                meta, read, token = job
                try:
                    ok = self.disk.write_block(meta, read())
                except Exception:  # never let the thread die: the engine must carry on
                    logger.exception("KV disk writer: writing a block failed")
                    ok = False
                self._done.put((token, ok))
            finally:
                self._q.task_done()
