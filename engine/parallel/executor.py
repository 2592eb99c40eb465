"""Rank 0 drives ``N - 1`` worker processes through every step (tensor parallelism).

The engine process is rank 0, as in vLLM's uniproc executor: its scheduler and
KV manager decide each step, its ``ModelRunner`` builds the step's inputs and
runs its own shard. ``TensorParallelModel`` wraps rank 0's shard: before its
forward it broadcasts the step plan (``Forward``: token ids, positions and the
``AttentionMetadata`` with the block tables and slot mapping), and before
logits it broadcasts the hidden rows (``Logits``), then gathers every rank's
vocabulary shard of the logits; only rank 0 samples. A worker
(``worker_main``) owns its shard and its KV heads' cache and replays exactly
those commands, so every rank enters the same collectives in the same order.

Plans are pickled (``broadcast_object_list`` on the gloo control group)
rather than packed into a fixed tensor header: their shape varies from step
to step (sequences, block-table width, the host-side lists the attention
backends read), and pickling these few hundred integers costs tens of
microseconds, against milliseconds of compute per step
(docs/benchmarks/tensor-parallel.md measures the whole step).

Failure is loud, never a hang: a monitor thread waits on the workers' process
sentinels and marks the executor failed the moment one exits; the data
collectives have a bounded timeout; a failed step under tensor parallelism
is fatal (the ranks may be out of step), and ``check_alive`` raises
``WorkerDiedError``, which stops the engine loop (health 503, exit non-zero).
A worker exits when its parent does (it polls its parent pid) and when a
collective fails.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.attention.registry import get_attention_backend
from engine.config import EngineConfig
from engine.errors import WorkerDiedError
from engine.kv.format import PlainKVFormat
from engine.models.config import ModelConfig
from engine.models.linear import LinearChoice, make_linear_strategy
from engine.models.llama import LlamaForCausalLM, LlamaModel
from engine.models.loader import iter_weights, linear_weight_type
from engine.models.ops import ModelOps, NativeCpuModelOps
from engine.models.registry import get_model_class
from engine.parallel.group import TPGroup, free_port
from engine.parallel.sharding import ShardSpec, install_collectives, shard_weights
from kernels.cpu_native import CpuKernels

logger = logging.getLogger(__name__)

# How long close() waits for the workers to leave before terminating them.
_JOIN_TIMEOUT_S = 10.0


# ------------------------------------------------------------------ commands


@dataclass
class InitKV:
    """Allocate the rank's KV cache: ``num_blocks`` blocks of its KV heads."""

    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype


@dataclass
class Forward:
    """One step's plan: run the forward on these inputs (CPU tensors)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


@dataclass
class Logits:
    """Take part in one logits computation of ``rows`` hidden rows (broadcast next)."""

    rows: int


@dataclass
class Shutdown:
    """Leave the loop and exit 0."""


Command = InitKV | Forward | Logits | Shutdown


def _meta_to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return dataclasses.replace(
        meta,
        query_start_loc=meta.query_start_loc.to(device),
        seq_lens=meta.seq_lens.to(device),
        block_tables=meta.block_tables.to(device),
        slot_mapping=meta.slot_mapping.to(device),
    )


# ------------------------------------------------------------ building a rank


def build_rank_model(
    config: EngineConfig,
    path: Path,
    mc: ModelConfig,
    spec: ShardSpec,
    group: TPGroup,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[LlamaForCausalLM, LinearChoice, AttentionBackend]:
    """This rank's shard of the model, its linears converted and its ops set.

    Returns ``(model, linear choice, attention backend)``. Rank 0 (the engine)
    and the workers build theirs the same way, so their numerics agree.
    Only dense Llama-family models get here (``check_tensor_parallel``)."""
    backend = get_attention_backend(config.attention_backend, device)
    cls = get_model_class(mc.architecture)
    with torch.device("meta"):
        built = cls(spec.local_config(), backend)
    if not isinstance(built, LlamaForCausalLM):
        raise ValueError(f"{mc.architecture} is not a Llama-family model: not tensor-parallel")
    model = built.to(dtype=dtype).to_empty(device=device)
    model.initialize_buffers()
    model.load_weights(shard_weights(spec, iter_weights(path)))
    model.eval()
    install_collectives(model, spec, group)

    def kernels() -> CpuKernels:
        if isinstance(backend, CpuNativeAttentionBackend):
            return backend.kernels
        return CpuKernels.load()

    choice = make_linear_strategy(
        config.cpu_linear,
        device=device,
        dtype=dtype,
        weight_type=linear_weight_type(path),
        kernels=kernels,
    )
    choice.strategy.apply(model)
    if isinstance(backend, CpuNativeAttentionBackend) and dtype == torch.float32:
        model.set_ops(NativeCpuModelOps(backend.kernels))
    return model, choice, backend


def threads_per_rank(config: EngineConfig, world: int) -> int:
    """``--num-threads`` per rank, or this process's cores shared out evenly."""
    if config.num_threads:
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // world)


# --------------------------------------------------------------------- rank 0


class TensorParallelModel(nn.Module):
    """Rank 0's shard behind the model interface the runner and engine use.

    ``forward`` and ``compute_logits`` first tell the workers to do the same
    (see the module doc); everything else is the shard's."""

    def __init__(self, shard: LlamaForCausalLM, executor: TPExecutor, vocab_size: int) -> None:
        super().__init__()
        self.shard = shard
        self.executor = executor
        self.vocab_size = vocab_size
        self.config = shard.config
        # The workers have no graphs to replay: decode steps stay eager.
        self.supports_cuda_graphs = False

    @property
    def model(self) -> LlamaModel:
        return self.shard.model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        routing: object = None,
    ) -> torch.Tensor:
        if routing is not None:
            raise ValueError("MoE routing contexts are not tensor-parallel")
        cpu = torch.device("cpu")
        self.executor.send(Forward(input_ids.to(cpu), positions.to(cpu), _meta_to(meta, cpu)))
        out: torch.Tensor = self.shard(input_ids, positions, kv_caches, meta)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` (float32): every rank's shard, gathered here."""
        self.executor.send(Logits(hidden.shape[0]))
        group = self.executor.group
        h = hidden.contiguous()
        group.broadcast(h)
        full = group.gather_columns(self.shard.compute_logits(h))
        assert full is not None
        return full[:, : self.vocab_size]

    def set_ops(self, ops: ModelOps) -> None:
        self.shard.set_ops(ops)


class TPExecutor:
    """The worker processes and rank 0's end of the group.

    ``start`` spawns ranks ``1..N-1`` and joins the group; the engine then
    builds its own shard (``build_rank_model``), sizes the KV cache and calls
    ``init_kv``, which returns once every worker has loaded and allocated."""

    def __init__(self, group: TPGroup, procs: list[Any]) -> None:
        self.group = group
        self.procs = procs  # multiprocessing Process objects, rank 1.. in order
        self.failure: str | None = None
        self._closing = False
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)
        self._monitor = threading.Thread(target=self._watch, name="fuel-tp-monitor", daemon=True)
        self._monitor.start()

    @classmethod
    def start(
        cls, config: EngineConfig, path: Path, device: torch.device, dtype: torch.dtype
    ) -> TPExecutor:
        world = config.tensor_parallel_size
        port = free_port()
        threads = threads_per_rank(config, world)
        if device.type == "cpu":
            torch.set_num_threads(threads)
        ctx = mp.get_context("spawn")
        procs = []
        for rank in range(1, world):
            spec = WorkerSpec(config, str(path), rank, world, port, device, dtype, threads)
            p = ctx.Process(
                target=worker_main, args=(spec, os.getpid()), name=f"fuel-tp{rank}", daemon=True
            )
            p.start()
            procs.append(p)
        try:
            group = TPGroup.init(0, world, port, device, config.tp_timeout_s)
        except BaseException:
            for p in procs:
                p.terminate()
            raise
        logger.info("tensor parallel: %d ranks (%s), %d threads each", world, device, threads)
        return cls(group, procs)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._closing:
            return
        for s in ready:
            if s in sentinels:
                rank, p = sentinels[s]
                p.join(1.0)
                self.fail(
                    f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                )
                return

    def fail(self, reason: str) -> None:
        """Mark the group failed (the first reason is kept) and say so in the log."""
        if self.failure is None:
            self.failure = reason
            logger.error("%s; the engine stops", reason)

    def check_alive(self) -> None:
        """Raise ``WorkerDiedError`` once a worker has died or a step has failed."""
        if self.failure is not None:
            raise WorkerDiedError(self.failure)

    def send(self, command: Command) -> None:
        self.check_alive()
        self.group.send_command(command)

    def init_kv(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> None:
        """Have every worker allocate its cache; returns when all are ready.

        Raises:
            WorkerDiedError: a worker failed to load (its log says why).
        """
        try:
            self.check_alive()
            self.group.send_command(InitKV(num_blocks, block_size, kv_dtype), startup=True)
            ready = self.group.count_ready()  # every worker's "loaded and allocated"
        except WorkerDiedError:
            raise
        except Exception as e:
            self._await_failure()
            raise WorkerDiedError(
                self.failure or f"tensor-parallel start-up failed: {type(e).__name__}: {e}"
            ) from e
        if ready != self.group.world_size:
            raise WorkerDiedError("tensor-parallel start-up: not every rank is ready")

    def _await_failure(self, timeout_s: float = 2.0) -> None:
        """Give the monitor a moment to name the worker that died."""
        end = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < end:
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._closing:
            return
        self._closing = True
        self._wake_w.send(b"")
        if self.failure is None:
            try:
                self.group.send_command(Shutdown())
            except Exception:  # a worker already gone: kill below
                logger.debug("tensor-parallel shutdown broadcast failed", exc_info=True)
            for p in self.procs:
                p.join(_JOIN_TIMEOUT_S)
        # A failed group's ranks may hang in a collective (or be stopped): kill them.
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(_JOIN_TIMEOUT_S)
        self.group.close()


# --------------------------------------------------------------------- workers


@dataclass
class WorkerSpec:
    """What a worker process needs to build its rank (picklable, sent at spawn)."""

    config: EngineConfig
    model_path: str
    rank: int
    world: int
    port: int
    device: torch.device
    dtype: torch.dtype
    num_threads: int


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the engine process is gone (no orphaned ranks)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def worker_main(spec: WorkerSpec, parent_pid: int) -> None:
    """Rank ``spec.rank``'s process: build the shard, then replay rank 0's commands."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s"
    )
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    torch.manual_seed(spec.config.seed)
    device = spec.device
    if device.type == "cuda":
        device = torch.device("cuda", spec.rank)
    try:
        group = TPGroup.init(spec.rank, spec.world, spec.port, device, spec.config.tp_timeout_s)
        _serve(spec, group, device)
    except Exception:
        logger.exception("tensor-parallel worker failed")
        os._exit(1)
    group.close()


@torch.inference_mode()
def _serve(spec: WorkerSpec, group: TPGroup, device: torch.device) -> None:
    from engine.models.loader import load_model_config

    path = Path(spec.model_path)
    mc = load_model_config(path)
    shard = ShardSpec(mc, spec.rank, spec.world)
    model, _, _ = build_rank_model(spec.config, path, mc, shard, group, device, spec.dtype)
    init = group.recv_command(startup=True)
    assert isinstance(init, InitKV), init
    local = shard.local_config()
    kv_caches = PlainKVFormat(
        local.num_hidden_layers,
        init.block_size,
        local.num_key_value_heads,
        local.head_dim,
        init.kv_dtype,
    ).allocate(init.num_blocks, device)
    group.count_ready()
    while True:
        cmd = group.recv_command()
        if isinstance(cmd, Forward):
            model(
                cmd.input_ids.to(device),
                cmd.positions.to(device),
                kv_caches,
                _meta_to(cmd.meta, device),
            )
        elif isinstance(cmd, Logits):
            hidden = torch.empty(cmd.rows, mc.hidden_size, dtype=spec.dtype, device=device)
            group.broadcast(hidden)
            group.gather_columns(model.compute_logits(hidden))
        elif isinstance(cmd, Shutdown):
            return
        else:
            raise RuntimeError(f"unexpected tensor-parallel command {cmd!r}")
