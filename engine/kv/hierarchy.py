"""The tiers below the device pool and the block copies between them.

``KVHierarchy`` is the KV manager's view of the host tier (and, below it,
the disk tier). The manager asks it to

* *locate* a block the device pool misses (host, else disk),
* *stage* disk hits into the host tier (read and verified before any hit is
  granted: a block that fails its checks ends the hit there),
* *demote* a cached block the device pool evicts (a copy into the host tier;
  none when the host already holds the key),
* *promote* a host block into a fresh device block (a prefix hit, a swap-in),
* *swap out* a preempted request's blocks (pinned in the host until it
  resumes or ends).

Nothing is copied while the scheduler decides: each call adds to the step's
:class:`TransferPlan`, which the engine runs once, batched, before the
step's forward (``KVTransferExecutor``, engine/kv/transfer.py): first every
device->host copy (so an evicted block is read before anyone may write its
id again), then every host->device copy (so a block demoted and promoted in
one step reads the bytes just written). Host entries a plan reads or writes
are pinned until the copy ran, so no eviction in the same (or, with async
copies, a later) step can hand their slot to another block: that is what
makes a promotion racing an eviction safe.

Persistence: after a block lands in the host tier it is written through to
disk by the ``DiskWriter`` thread (pinned while queued); a block the queue
had no room for stays marked not-on-disk and ``flush`` writes it (with every
cached device block) at the latest when the server drains.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv.disk_tier import DiskTier, DiskWriter
from engine.kv.host_tier import HostEntry, HostTier
from engine.kv.tier import BlockMeta, KVTier

logger = logging.getLogger(__name__)

# Transfer directions, named as vLLM's kv_offload metrics label them.
GPU_TO_CPU = "GPU_to_CPU"
CPU_TO_GPU = "CPU_to_GPU"
DISK_TO_CPU = "DISK_to_CPU"
CPU_TO_DISK = "CPU_to_DISK"


class TransferTicket:
    """Completion of one plan's host->device copies.

    Synchronous executors finish before ``run`` returns; asynchronous ones
    (a CUDA copy stream) bind ``poll``/``wait`` to an event.
    """

    def __init__(self) -> None:
        self.ran = False
        self._poll: Callable[[], bool] | None = None
        self._wait: Callable[[], None] | None = None
        self._keep: object = None

    def bind(self, poll: Callable[[], bool], wait: Callable[[], None], keep: object) -> None:
        """Asynchronous completion; ``keep`` holds buffers alive until then."""
        self._poll, self._wait, self._keep = poll, wait, keep

    def done(self) -> bool:
        if not self.ran:
            return False
        if self._poll is not None and not self._poll():
            return False
        self._poll = self._wait = self._keep = None
        return True

    def wait(self) -> None:
        if not self.ran:
            raise RuntimeError("waiting on a transfer plan that never ran")
        if self._wait is not None:
            self._wait()
        self._poll = self._wait = self._keep = None


@dataclass
class TransferPlan:
    """One step's block copies (see the module doc for their order)."""

    device_to_host: list[tuple[int, HostEntry]] = field(default_factory=list)
    host_to_device: list[tuple[HostEntry, int]] = field(default_factory=list)
    ticket: TransferTicket = field(default_factory=TransferTicket)

    def __bool__(self) -> bool:
        return bool(self.device_to_host or self.host_to_device)

    @property
    def num_pins(self) -> int:
        return len(self.device_to_host) + len(self.host_to_device)


@dataclass
class HierarchyCounters:
    """Monotonic counters (blocks unless named tokens)."""

    hit_tokens: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    query_tokens: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    evicted_cached: int = 0  # cached device blocks the pool reclaimed
    demoted: int = 0  # ... of which copied into the host tier
    already_below: int = 0  # ... already held by the host tier (no copy needed)
    demotions_dropped: int = 0  # ... the host had no unpinned slot for
    promoted: int = 0  # host -> device copies for prefix hits
    staged_from_disk: int = 0  # disk -> host copies (verified)
    swap_outs: int = 0  # requests swapped out
    swap_ins: int = 0  # requests swapped back in
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    write_through_full: int = 0  # blocks the writer queue had no room for (flushed later)
    flushed_blocks: int = 0


class KVHierarchy:
    """Host tier (+ optional disk tier) bookkeeping; see the module doc."""

    def __init__(
        self,
        host: HostTier,
        disk: DiskTier | None = None,
        *,
        async_copies: bool = False,
        write_queue_blocks: int = 256,
    ) -> None:
        self.host = host
        self.disk = disk
        # True when host->device copies complete after the step that issued them
        # (a CUDA copy stream): requests then wait for their own blocks.
        self.async_copies = async_copies
        self.writer: DiskWriter[HostEntry] | None = (
            DiskWriter(disk, write_queue_blocks) if disk is not None else None
        )
        self.counters = HierarchyCounters()
        self.bytes_moved: dict[str, int] = {GPU_TO_CPU: 0, CPU_TO_GPU: 0, DISK_TO_CPU: 0}
        self.seconds: dict[str, float] = {GPU_TO_CPU: 0.0, CPU_TO_GPU: 0.0, DISK_TO_CPU: 0.0}
        self._plan = TransferPlan()
        self._in_flight: list[TransferPlan] = []  # ran, host->device copies not yet complete
        self._writer_pins = 0

    @property
    def tiers(self) -> list[KVTier]:
        return [self.host] if self.disk is None else [self.host, self.disk]

    # ---- lookups ------------------------------------------------------------
    def locate(self, key: bytes, token_ids: Sequence[int]) -> HostEntry | bool:
        """A host entry holding this block, True when only the disk tier has it,
        False when no tier below the device does."""
        e = self.host.lookup(key, token_ids)
        if e is not None:
            return e
        return self.disk is not None and self.disk.contains(key)

    def stage_from_disk(self, wanted: Sequence[BlockMeta]) -> list[HostEntry]:
        """Read ``wanted`` (a run of a chain) from disk into host entries, in
        order, stopping at the first block that is missing, fails its checks or
        finds no host slot. Batched: the reads, then one copy into host rows."""
        if self.disk is None or not wanted:
            return []
        start = time.perf_counter()
        got = self.disk.get([m.key for m in wanted])
        entries: list[HostEntry] = []
        rows: list[torch.Tensor] = []
        for meta, item in zip(wanted, got):
            if item is None or self.host.entry(meta.key) is not None:
                break
            stored, data = item
            if stored.token_ids != meta.token_ids:  # a key collision: treat as foreign
                self.disk.counters.corrupt += 1
                break
            e = self.host.reserve(dataclasses.replace(stored, parent=meta.parent))
            if e is None:
                break
            e.on_disk = e.from_disk = True
            entries.append(e)
            rows.append(data)
        if entries:
            self.host.write_rows(
                torch.tensor([e.slot for e in entries], dtype=torch.int64), torch.stack(rows)
            )
            for e in entries:
                self.host.unpin(e)  # the copy is done: no longer pending
            self.counters.staged_from_disk += len(entries)
            self.disk.counters.read += len(entries)
            self.bytes_moved[DISK_TO_CPU] += len(entries) * self.host.block_nbytes
        self.seconds[DISK_TO_CPU] += time.perf_counter() - start
        return entries

    def record_query(self, host_queried: int, host_hits: int, disk_hits: int) -> None:
        """Tokens looked up below the device (and found in each tier) at admission."""
        c = self.counters
        c.query_tokens["host"] += host_queried
        c.hit_tokens["host"] += host_hits
        if self.disk is not None:
            c.query_tokens["disk"] += host_queried - host_hits
            c.hit_tokens["disk"] += disk_hits

    # ---- copies -------------------------------------------------------------
    def demote(self, block_id: int, meta: BlockMeta) -> None:
        """A cached device block is being reclaimed: keep a copy in the host tier."""
        c = self.counters
        c.evicted_cached += 1
        old = self.host.entry(meta.key)
        if old is not None:
            self.host.touch(old)
            c.already_below += 1
            return
        e = self.host.reserve(meta)
        if e is None:
            c.demotions_dropped += 1
            return
        self._plan.device_to_host.append((block_id, e))
        c.demoted += 1

    def promote(self, e: HostEntry, block_id: int) -> None:
        """Copy host entry ``e`` into device block ``block_id`` this step."""
        self.host.pin(e)
        self._plan.host_to_device.append((e, block_id))
        e.from_disk = False
        self.counters.promoted += 1
        self.host.counters.read += 1

    def swap_out(self, blocks: Sequence[tuple[int, BlockMeta, bool]]) -> list[HostEntry] | None:
        """Park ``(device block id, meta, private)`` blocks in the host tier,
        pinned for their request; None (nothing changed) when the host cannot
        take them all."""
        host = self.host
        held: list[HostEntry | None] = []
        for _, meta, private in blocks:
            e = None if private else host.lookup(meta.key, meta.token_ids or ())
            if e is not None:
                host.pin(e)
            held.append(e)
        need = sum(1 for e in held if e is None)
        if host.num_free_slots < need:
            for e in held:
                if e is not None:
                    host.unpin(e)
            return None
        out: list[HostEntry] = []
        for (block_id, meta, private), e in zip(blocks, held):
            if e is None:
                e = host.reserve(meta, private=private)
                assert e is not None  # room was checked above and nothing runs between
                self._plan.device_to_host.append((block_id, e))
                host.pin(e)  # the request's pin (the reservation's pin is the copy's)
            out.append(e)
        self.counters.swap_outs += 1
        self.counters.swapped_out_blocks += len(blocks)
        return out

    def release(self, entries: Sequence[HostEntry]) -> None:
        """Drop a request's swap pins (it resumed, or ended however it ended)."""
        for e in entries:
            self.host.unpin(e)

    @property
    def current_ticket(self) -> TransferTicket:
        """The completion ticket of the plan being built (this step's copies)."""
        return self._plan.ticket

    def take_plan(self) -> TransferPlan | None:
        """This step's copies (None when there are none); a new plan starts."""
        plan, self._plan = self._plan, TransferPlan()
        return plan if plan else None

    def plan_ran(self, plan: TransferPlan) -> None:
        """The executor ran ``plan``: release what it pinned, write through."""
        plan.ticket.ran = True
        for _, e in plan.device_to_host:
            self._write_through(e)
            self.host.unpin(e)
        if plan.ticket.done():
            self._release_reads(plan)
        else:
            self._in_flight.append(plan)

    def _release_reads(self, plan: TransferPlan) -> None:
        for e, _ in plan.host_to_device:
            self.host.unpin(e)

    def _write_through(self, e: HostEntry) -> None:
        if self.writer is None or e.private or e.on_disk or not self.disk_writable:
            return
        self.host.pin(e)
        if self.writer.submit(e.meta(), functools.partial(self.host.row_bytes, e), e):
            self._writer_pins += 1
        else:
            self.host.unpin(e)
            self.counters.write_through_full += 1

    @property
    def disk_writable(self) -> bool:
        return self.disk is not None and self.disk.writable

    def poll(self) -> list[TransferPlan]:
        """Collect finished async copies and disk writes; returns the plans that completed."""
        done: list[TransferPlan] = []
        if self._in_flight:
            still: list[TransferPlan] = []
            for plan in self._in_flight:
                if plan.ticket.done():
                    self._release_reads(plan)
                    done.append(plan)
                else:
                    still.append(plan)
            self._in_flight = still
        if self.writer is not None:
            for e, ok in self.writer.completed():
                self._writer_pins -= 1
                e.on_disk = e.on_disk or ok
                self.host.unpin(e)
        return done

    def wait_all(self) -> None:
        """Block until every issued copy completed (before freeing their blocks)."""
        for plan in self._in_flight:
            plan.ticket.wait()
        self.poll()

    # ---- persistence ------------------------------------------------------------
    def flush(
        self,
        device_blocks: Sequence[tuple[int, BlockMeta]],
        read_device: Callable[[list[int]], torch.Tensor],
    ) -> int:
        """Write every cached block not yet on disk: first the host tier's, then
        the device prefix cache's ``(block id, meta)`` (their bytes from
        ``read_device(ids)``, one batched read). Waits for the writer queue
        first. Returns the number of blocks written now."""
        if self.disk is None:
            return 0
        if self.writer is not None:
            self.writer.drain()
        self.wait_all()
        disk = self.disk
        pending = [
            e
            for e in self.host.entries()
            if not e.private and not e.on_disk and not disk.contains(e.key)
        ]
        written = 0
        if pending and disk.writable:
            data = self.host.read_rows(torch.tensor([e.slot for e in pending], dtype=torch.int64))
            for e, ok in zip(pending, disk.put([e.meta() for e in pending], data)):
                e.on_disk = e.on_disk or ok
                written += int(ok)
        todo = [
            (bid, m)
            for bid, m in device_blocks
            if not self._on_disk_via_host(m.key) and not disk.contains(m.key)
        ]
        if todo and disk.writable:
            rows = read_device([bid for bid, _ in todo])
            written += sum(disk.put([m for _, m in todo], rows))
        self.counters.flushed_blocks += written
        return written

    def _on_disk_via_host(self, key: bytes) -> bool:
        e = self.host.entry(key)
        return e is not None and e.on_disk

    def close(self) -> None:
        """Stop the disk writer (after ``flush``). Idempotent; the tiers stay
        usable, without write-through (a later ``flush`` still writes)."""
        if self.writer is not None:
            self.writer.drain()
            self.poll()
            self.writer.close()
            self.writer = None

    # ---- invariants ---------------------------------------------------------
    def check_invariants(self, swap_pins: int) -> None:
        """Tier accounting, plus: every host pin is held by someone we know of
        (a live request's swapped blocks, this step's plan, an in-flight copy,
        the disk writer), so no ended request keeps a reference in any tier."""
        for tier in self.tiers:
            tier.check_invariants()
        pins = sum(e.ref_count for e in self.host.entries())
        known = (
            swap_pins
            + self._plan.num_pins
            + sum(len(p.host_to_device) for p in self._in_flight)
            + self._writer_pins
        )
        if pins != known:
            raise AssertionError(
                f"host tier: {pins} pins but {known} known holders (swap {swap_pins}, "
                f"plan {self._plan.num_pins}, in flight, writer {self._writer_pins})"
            )
        c = self.counters
        if c.evicted_cached != c.demoted + c.already_below + c.demotions_dropped:
            raise AssertionError(
                f"a block was lost between tiers: {c.evicted_cached} evicted from the device, "
                f"{c.demoted} demoted + {c.already_below} already below + "
                f"{c.demotions_dropped} dropped"
            )
        dests = [bid for _, bid in self._plan.host_to_device]
        if len(set(dests)) != len(dests):
            raise AssertionError("two host blocks are promoted into one device block")
