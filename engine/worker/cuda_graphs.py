"""Captured decode steps (CUDA graphs) at a ladder of batch sizes.

A decode-only step (every scheduled sequence computes exactly one token) is
replayed from a graph captured for the smallest ladder size >= its sequence
count, instead of launching the model's few hundred kernels one by one. The
inputs live in persistent buffers sized for the largest rung; a step copies
its rows in, pads the rest, replays, and reads the hidden states of its own
rows back. Nothing is allocated per step.

Padding rows are inert by construction: slot ``-1`` (the cache-write kernel
skips it), sequence length 1 over block 0 (a read of one valid slot whose
result is discarded), position 0, token 0.

Captured: the model forward up to the final norm (``[b, hidden]``). Logits,
the grammar mask and sampling stay eager: they depend on per-request host
state and cost one launch each.

Requirements on the attention backend: no host syncs and a launch grid that
depends only on host ints fixed at capture (the Triton backend; the capture
fixes ``max_seq_len`` at the model's maximum, so the decode split count covers
any length). ``--enforce-eager`` turns graphs off.

The graph object is behind ``GraphFactory`` so the buffer and padding logic
can be tested on the CPU with an emulated graph (replay = call again on the
same buffers), which is what a real replay does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from engine.attention.base import AttentionMetadata


class StaticGraph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record ``fn`` (which reads and writes fixed buffers); return its output buffer."""
        ...

    def replay(self) -> None:
        """Run the recorded work again; the output buffer then holds the new result."""
        ...


GraphFactory = Callable[[], StaticGraph]


class CudaStaticGraph:
    """``torch.cuda.CUDAGraph`` behind :class:`StaticGraph`; one memory pool for every rung."""

    def __init__(self, pool: Any) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Warm up on a side stream first (lazy init, Triton autotune/compile),
        # as capture must not see first-call work.
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(self._graph, pool=self._pool):
            out = fn()
        return out

    def replay(self) -> None:
        self._graph.replay()


def cuda_graph_factory() -> GraphFactory:
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaStaticGraph(pool)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    sizes = []
    b = 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Persistent decode buffers and one captured forward per ladder size.

    ``forward(input_ids, positions, meta)`` is the model's forward (returns
    ``[T, hidden]``). Valid while the model's weights and KV cache tensors keep
    their storage (they are captured by address).
    """

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        graph_factory: GraphFactory,
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"graph sizes must be increasing positive ints, got {sizes}")
        self.sizes = sizes
        self.max_batch = sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_batch
        max_blocks = -(-max_model_len // block_size)
        dev = device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._graphs: dict[int, tuple[StaticGraph, torch.Tensor]] = {}
        # Largest first: later (smaller) captures reuse the pool's memory.
        for b in reversed(sizes):
            meta = self._meta(b)
            graph = graph_factory()

            def run(b: int = b, meta: AttentionMetadata = meta) -> torch.Tensor:
                return forward(self.input_ids[:b], self.positions[:b], meta)

            self._graphs[b] = (graph, graph.capture(run))

    def _meta(self, b: int) -> AttentionMetadata:
        """Capture-time metadata: views of the buffers; host ints at their maximum."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            num_decodes=b,
            query_lens_cpu=[1] * b,
            seq_lens_cpu=[self.max_model_len] * b,
            query_start_loc_cpu=list(range(b + 1)),
        )

    def padded_size(self, num_seqs: int) -> int | None:
        """The rung a decode-only step of ``num_seqs`` sequences replays, or None."""
        for b in self.sizes:
            if b >= num_seqs:
                return b
        return None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """Replay for a decode-only step; returns hidden ``[n, hidden]`` or None (run eager).

        Only when every sequence has query length 1 and they fit a rung.
        The returned tensor is a view of the graph's output buffer: valid until
        the next replay.
        """
        n = meta.num_seqs
        if meta.num_decodes != n or meta.num_tokens != n or n == 0:
            return None
        b = self.padded_size(n)
        if b is None or meta.max_seq_len > self.max_model_len:
            return None
        w = meta.block_tables.shape[1]
        if w > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :w].copy_(meta.block_tables, non_blocking=True)
        if b > n:  # inert padding rows (module doc)
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
            self.block_tables[n:b].zero_()
        graph, out = self._graphs[b]
        graph.replay()
        return out[:n]
