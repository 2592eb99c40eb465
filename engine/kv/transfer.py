"""Runs a step's block copies between the device caches and the host tier.

The executor is the only code that touches bytes on both sides; the plan
(engine/kv/hierarchy.py) says what to copy, the ``KVFormat`` how a block's
bytes are laid out. Each direction is one batched copy per step: one gather
per layer on the device side (``read_blocks``/``write_blocks``) and one row
gather/scatter on the host side, whatever the number of blocks.

Order and synchrony:

1. device -> host (demotions, swap-outs): read on the compute stream and
   waited for, so the blocks' ids can be reused by this step's forward.
   (On CUDA a D2H copy of the step's demotions, at ~25 GB/s well under a
   millisecond for tens of blocks; making it async too would need the
   compute stream to wait on it anyway before the ids are rewritten.)
2. host -> device (promotions, swap-ins):
   * on the CPU, a synchronous batched copy (there is nothing to overlap
     with: the "device" is the same memory system and the same cores);
   * on CUDA, asynchronous on a copy stream from a pinned staging buffer,
     after the compute stream's earlier work; the plan's ticket completes
     when the copy's event does, and the scheduler holds back only the
     requests whose blocks are in it (``KVCacheManager.is_ready``), so the
     step that does not need them overlaps the copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.kv.format import KVFormat, LayerCaches
from engine.kv.hierarchy import CPU_TO_GPU, GPU_TO_CPU, KVHierarchy, TransferPlan

# Blocks per copy through the staging buffer: the copies of one step go in
# chunks of this many (one gather per layer per chunk), which bounds the
# buffer (64 blocks of the default model in float32: 47 MiB).
_CHUNK_BLOCKS = 64


class KVTransferExecutor:
    """Executes ``TransferPlan``s for one engine (its caches, its host tier)."""

    def __init__(
        self,
        fmt: KVFormat,
        caches: LayerCaches,
        hierarchy: KVHierarchy,
        device: torch.device,
    ) -> None:
        self.fmt = fmt
        self.caches = caches
        self.hierarchy = hierarchy
        self.host = hierarchy.host
        self.device = device
        self._staging: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and hierarchy.async_copies:
            self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    def run(self, plan: TransferPlan, between: Callable[[], None] | None = None) -> None:
        """Run ``plan`` (device->host first, then ``between``, then host->device),
        then tell the hierarchy. ``between`` is the step's device-side block
        copies (partial prefix hits): their destinations may be blocks this
        plan demotes, and promotions never write their sources."""
        if plan.device_to_host:
            self._device_to_host(plan)
        if between is not None:
            between()
        if plan.host_to_device:
            self._host_to_device(plan)
        self.hierarchy.plan_ran(plan)

    def _stage(self, n: int) -> torch.Tensor:
        """A reusable ``[n, block_nbytes]`` CPU buffer (fresh large allocations
        cost a page fault per 4 KiB on every step; this one is touched once)."""
        if self._staging is None or self._staging.shape[0] < n:
            self._staging = torch.empty((n, self.fmt.block_nbytes), dtype=torch.uint8)
        return self._staging[:n]

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        return [(i, min(n, i + _CHUNK_BLOCKS)) for i in range(0, n, _CHUNK_BLOCKS)]

    def _device_to_host(self, plan: TransferPlan) -> None:
        t0 = time.perf_counter()
        ids = torch.tensor([bid for bid, _ in plan.device_to_host], dtype=torch.int64)
        slots = torch.tensor([e.slot for _, e in plan.device_to_host], dtype=torch.int64)
        for a, b in self._chunks(len(ids)):
            if self.device.type == "cpu":
                data = self.fmt.read_blocks(self.caches, ids[a:b], out=self._stage(b - a))
            else:  # synchronous (see the module doc)
                data = self.fmt.read_blocks(self.caches, ids[a:b].to(self.device)).to("cpu")
            self.host.write_rows(slots[a:b], data)
        self.hierarchy.seconds[GPU_TO_CPU] += time.perf_counter() - t0
        self.hierarchy.bytes_moved[GPU_TO_CPU] += len(ids) * self.fmt.block_nbytes

    def _host_to_device(self, plan: TransferPlan) -> None:
        t0 = time.perf_counter()
        slots = torch.tensor([e.slot for e, _ in plan.host_to_device], dtype=torch.int64)
        ids = torch.tensor([bid for _, bid in plan.host_to_device], dtype=torch.int64)
        nbytes = len(plan.host_to_device) * self.fmt.block_nbytes
        if self._stream is None:
            for a, b in self._chunks(len(ids)):
                data = self.host.read_rows(slots[a:b], out=self._stage(b - a))
                self.fmt.write_blocks(self.caches, ids[a:b].to(self.device), data.to(self.device))
        else:
            staged = torch.empty(
                (len(plan.host_to_device), self.fmt.block_nbytes),
                dtype=torch.uint8,
                pin_memory=True,
            )
            self.host.read_rows(slots, out=staged)
            ids_pinned = ids.pin_memory()
            stream = self._stream
            # Earlier work on the compute stream may still read these block ids
            # (their previous owners): the copy starts after it.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                on_device = staged.to(self.device, non_blocking=True)
                ids_device = ids_pinned.to(self.device, non_blocking=True)
                self.fmt.write_blocks(self.caches, ids_device, on_device)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            plan.ticket.bind(event.query, event.synchronize, (staged, ids_pinned, on_device))
        self.hierarchy.seconds[CPU_TO_GPU] += time.perf_counter() - t0
        self.hierarchy.bytes_moved[CPU_TO_GPU] += nbytes

    def read_device_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, block_nbytes]`` uint8 on the CPU: the bytes of device blocks (a flush)."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.fmt.read_blocks(self.caches, ids).to("cpu")
