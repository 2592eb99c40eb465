"""The synchronous engine: add requests, ``step()``, collect outputs.

``step()`` = schedule -> one forward pass for the whole batch -> sample ->
update the requests -> text deltas and stops -> free the blocks of whatever
ended. ``AsyncEngine`` drives it from a thread; ``LLM`` from a plain loop.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.attention.registry import get_attention_backend
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv.block_pool import KVBlock
from engine.kv.builder import build_hierarchy
from engine.kv.event_publisher import KVEventPublisher, make_publisher
from engine.kv.events import KVEventBatch, KVEventCollector
from engine.kv.fingerprint import model_fingerprint
from engine.kv.format import GroupedKVFormat, KVFormat, PlainKVFormat
from engine.kv.hierarchy import KVHierarchy
from engine.kv.kivi_format import KiviKVFormat
from engine.kv.low_rank import KeyBasis, resolve_key_basis
from engine.kv.manager import KVCacheManager
from engine.kv.policies.resolve import KVPolicySpec, policy_unavailable, resolve_policy
from engine.kv.policies.runtime import KVPolicyRuntime
from engine.kv.transfer import KVTransferExecutor
from engine.models.linear import LinearChoice, LinearStrategy, make_linear_strategy
from engine.models.loader import (
    linear_weight_type,
    load_model,
    load_model_config,
    resolve_model_path,
)
from engine.models.moe import MoeForCausalLM
from engine.models.native_step import NativeDecodeStep
from engine.models.ops import NativeCpuModelOps
from engine.output_processor import (
    GroupState,
    build_output,
    final_delta,
    finish_text,
    make_choice,
    merge_deltas,
    process_token,
)
from engine.outputs import CompletionDelta, RequestOutput
from engine.parallel.executor import TensorParallelModel, TPExecutor, build_rank_model
from engine.parallel.sharding import ShardSpec, check_tensor_parallel
from engine.request import Request, RequestOptions, RequestStatus
from engine.sampling.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from engine.sampling.sampler import GrammarMaskFn, SampleRow
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.spec_decode.calibrate import measure_step_cost
from engine.spec_decode.controller import AdaptiveDraftPolicy, DraftPolicy, FixedDraftPolicy
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.speculator import Speculator
from engine.stats import EngineStats
from engine.text.tokenizer import Tokenizer
from engine.trace import NullTraceRecorder, RequestTrace, TraceRecorder, TraceStore
from engine.worker.cuda_graphs import batch_size_ladder, cuda_graph_factory
from engine.worker.model_runner import ModelRunner, StepResult, attention_backend_of
from kernels.cpu_native import CpuKernels

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r}; choose auto, float32, float16 or bfloat16"
        ) from None


def resolve_kv_cache_dtype(
    name: str, device: torch.device, dtype: torch.dtype, backend: object
) -> torch.dtype:
    """The KV cache element type for ``--kv-cache-dtype name``.

    ``auto``: float16 on the CPU when the native attention backend reads the
    cache (half the bytes per decode step; its quality is measured against
    float32 in docs/benchmarks/cpu.md), the model's dtype otherwise (CUDA,
    the torch backend). An explicit choice other than the model's dtype is
    CPU-only: the Triton kernels are written for a cache in the model's dtype.

    Raises:
        ValueError: a non-model dtype asked for on CUDA.
    """
    if name.startswith("kivi"):
        # KIVI's residual group and scales are float16 (the element type reported
        # beside the format's name).
        return torch.float16
    if name == "auto":
        native = isinstance(backend, CpuNativeAttentionBackend)
        return torch.float16 if device.type == "cpu" and native else dtype
    kv = resolve_dtype(name, device)
    if kv != dtype and device.type != "cpu":
        raise ValueError("--kv-cache-dtype other than the model's dtype is CPU-only")
    return kv


def _return_freed_memory() -> None:
    """Hand the heap memory that loading freed (the float weights a strategy
    replaced by blocks, the dequantized tensors) back to the OS. glibc keeps
    freed chunks below its mmap threshold in the heap: ~130 MB of the default
    model's start-up RSS. A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _native_kernels(backend: object) -> CpuKernels:
    """The native CPU kernels: the attention backend's, or built now (NativeBuildError)."""
    if isinstance(backend, CpuNativeAttentionBackend):
        return backend.kernels
    return CpuKernels.load()


@dataclass
class EngineInfo:
    """What runs: the model, its sizes, and the execution path chosen at start-up."""

    model_path: Path
    model_name: str
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    block_size: int
    max_model_len: int
    cpu_linear: str = "torch"
    kv_cache_dtype: torch.dtype = torch.float32
    attention: str = "?"
    decode_step: str = "per_layer"
    kv_cache_format: str | None = None  # a quantized format's name (kivi4/kivi2)
    kv_bytes_per_token: float = 0.0
    kv_policy: str = "full"
    kv_key_rank: int | None = None  # --kv-low-rank-keys (None: keys at the head size)

    def execution(self) -> dict[str, str]:
        """The execution path, as served in ``/v1/models`` (``fuel`` field) and logged."""
        return {
            "device": self.device.type,
            "dtype": str(self.dtype).removeprefix("torch."),
            "cpu_linear": self.cpu_linear,
            "kv_cache_dtype": self.kv_cache_format
            or str(self.kv_cache_dtype).removeprefix("torch."),
            "attention": self.attention,
            "decode_step": self.decode_step,
            "kv_policy": self.kv_policy,
            "kv_key_rank": "full" if self.kv_key_rank is None else str(self.kv_key_rank),
        }

    num_host_blocks: int = 0
    disk_tier_path: str | None = None
    enable_prefix_caching: bool = True

    def cache_config(self) -> dict[str, str]:
        """vLLM's ``vllm:cache_config_info`` labels (num_gpu_blocks, block_size,
        cache_dtype, ...), as strings; ``num_gpu_blocks`` is the device pool's
        block count on the CPU too (vLLM's name)."""
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.execution()["kv_cache_dtype"],
            "num_gpu_blocks": str(self.num_blocks),
            "num_cpu_blocks": str(self.num_host_blocks),
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "kv_tokens": str(self.num_blocks * self.block_size),
            "kv_bytes_per_token": f"{self.kv_bytes_per_token:.1f}",
        }


class LLMEngine:
    """Owns tokenizer, model, KV cache, scheduler and per-request output state."""

    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        path = resolve_model_path(config.model)
        self.model_config = load_model_config(path)
        self.tokenizer = Tokenizer.load(path, config.tokenizer)
        if config.chat_template is not None:
            try:
                self.tokenizer.override_chat_template(Path(config.chat_template).read_text())
            except OSError as e:
                raise ValueError(f"cannot read --chat-template {config.chat_template}: {e}") from e
        mc = self.model_config
        supported = mc.max_supported_len()
        max_len = config.max_model_len or supported
        if max_len > supported:
            raise ValueError(
                f"--max-model-len {max_len} exceeds what the model supports ({supported} tokens: "
                "max_position_embeddings, capped by a sliding window the backends do not implement)"
            )
        if config.moe_capacity_factor is not None and not mc.is_moe:
            raise ValueError(
                f"--moe-capacity-factor needs a Mixture-of-Experts model; {mc.architecture} is dense"
            )
        backend = get_attention_backend(config.attention_backend, device)
        # Tensor parallelism (engine/parallel/): the worker ranks, rank 0's shard.
        self.tp: TPExecutor | None = None
        # Any: the model class comes from the registry (LlamaForCausalLM-like).
        model: Any
        if config.tensor_parallel_size > 1:
            model, choice, backend = self._start_tensor_parallel(path, device, dtype)
        else:
            model = load_model(path, mc, backend, dtype, device)
            choice = make_linear_strategy(
                config.cpu_linear,
                device=device,
                dtype=dtype,
                weight_type=linear_weight_type(path),
                kernels=lambda: _native_kernels(backend),
            )
            choice.strategy.apply(model)
        self.linear_strategy: LinearStrategy = choice.strategy
        _return_freed_memory()
        if isinstance(backend, CpuNativeAttentionBackend) and dtype == torch.float32:
            # The native CPU backend also brings fused norm/RoPE/SiLU ops (same library).
            model.set_ops(NativeCpuModelOps(backend.kernels))
        if self.tp is not None:
            model = TensorParallelModel(model, self.tp, mc.vocab_size)
        self.model = model
        self.key_basis = self._key_basis(path, backend, device, dtype, max_len)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, device, dtype, backend)
        kv_format = self._kv_format(kv_dtype)
        proposer = self._proposer(path, backend, dtype, device, kv_dtype, max_len)
        # A draft model's own cache shares the block ids: its bytes per token count too.
        draft_bytes = proposer.kv_bytes_per_token() * config.block_size if proposer else 0
        num_blocks = self._num_blocks(device, kv_format.block_nbytes + draft_bytes, dtype, max_len)
        hierarchy = self._build_kv(
            num_blocks, max_len, device, dtype, kv_format, path, backend.name, proposer
        )
        if device.type == "cuda" and not config.enforce_eager:
            self._capture_decode_graphs(max_len)
        decode_step = self._enable_native_decode(device)
        self.speculator = self._speculator(proposer, num_blocks, max_len)
        # The served name: what the user passed (as vLLM does), or the default model's name.
        name = config.model if config.model is not None else DEFAULT_MODEL_NAME
        self.info = EngineInfo(
            path,
            name,
            device,
            dtype,
            num_blocks,
            config.block_size,
            max_len,
            cpu_linear=self.linear_strategy.name,
            kv_cache_dtype=kv_dtype,
            attention=self.model_backend_name(),
            decode_step=decode_step,
            kv_policy=config.kv_policy,
            num_host_blocks=hierarchy.host.capacity_blocks if hierarchy is not None else 0,
            disk_tier_path=(
                str(hierarchy.disk.root) if hierarchy is not None and hierarchy.disk else None
            ),
            kv_cache_format=(
                config.kv_cache_dtype if isinstance(kv_format, KiviKVFormat) else None
            ),
            kv_bytes_per_token=kv_format.bytes_per_token,
            kv_key_rank=self.key_basis.rank if self.key_basis is not None else None,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%s, %.1f bytes/token)",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            self.info.execution()["kv_cache_dtype"],
            kv_format.bytes_per_token,
        )
        logger.info(
            "execution: linears %s (%s), kv cache %s, attention %s, decode steps %s",
            self.linear_strategy.name,
            choice.reason,
            self.info.execution()["kv_cache_dtype"],
            self.info.attention,
            decode_step,
        )
        self.groups: dict[str, GroupState] = {}
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self._grammar: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._bitmask: torch.Tensor | None = None
        self.traces: TraceStore | None = None
        self.tracer: TraceRecorder = NullTraceRecorder()
        if config.enable_request_traces:
            self.traces = TraceStore(config.max_traces)
            self.tracer = TraceRecorder(self.traces, log_prompts=config.log_prompts)
        # KV events (--kv-events-config): collected by the KV tiers during the
        # step, published by the publisher's thread after it. Last in __init__:
        # nothing after it can fail and leave its thread behind.
        self.kv_events: KVEventCollector | None = None
        self.kv_event_publisher: KVEventPublisher | None = None
        if config.kv_events is not None:
            self.kv_events = KVEventCollector(config.block_size)
            self.kv.attach_events(self.kv_events)
            self.kv_event_publisher = make_publisher(config.kv_events, config.data_parallel_rank)

    def _kv_format(self, kv_dtype: torch.dtype) -> KVFormat:
        """The KV block format of ``--kv-cache-dtype`` (plain, or KIVI; every
        attention backend reads both).

        Raises:
            ValueError: a head size the KIVI layout does not divide.
        """
        cfg = self.config
        mc = self.model_config
        name = cfg.kv_cache_dtype
        # Under tensor parallelism each rank holds the cache of its KV heads only.
        kv_heads = mc.num_key_value_heads // cfg.tensor_parallel_size
        if not name.startswith("kivi"):
            basis = self.key_basis
            return PlainKVFormat(
                mc.num_hidden_layers,
                cfg.block_size,
                kv_heads,
                mc.head_dim,
                kv_dtype,
                key_dim=basis.rank if basis is not None else None,
                key_basis=basis.digest[:16] if basis is not None else None,
            )
        group, ring, sink = cfg.kivi_window
        try:
            return KiviKVFormat(
                mc.num_hidden_layers,
                cfg.block_size,
                mc.num_key_value_heads,
                mc.head_dim,
                bits=4 if name == "kivi4" else 2,
                group_size=group,
                ring_groups=ring,
                sink=sink,
            )
        except ValueError as e:
            raise ValueError(f"--kv-cache-dtype {name}: {e}") from e

    def _key_basis(
        self,
        path: Path,
        backend: AttentionBackend,
        device: torch.device,
        dtype: torch.dtype,
        max_len: int,
    ) -> KeyBasis | None:
        """``--kv-low-rank-keys``: the key basis (engine/kv/low_rank.py), found
        before the cache is sized and set on the model's layers; None when off.

        The basis is computed from keys the loaded model produces with the
        linears it runs (so a Q4_1 model's basis is its own), and cached under a
        fingerprint of the weights and those numerics."""
        cfg = self.config
        if cfg.kv_low_rank_keys is None:
            return None
        if backend.name == "triton":
            raise ValueError(
                "--kv-low-rank-keys is not in the Triton attention kernels (one head size for "
                "keys and values); use --attention-backend torch"
            )
        if not hasattr(self.model, "set_key_basis"):
            raise ValueError(
                f"--kv-low-rank-keys needs a Llama-family model, not {type(self.model)}"
            )
        numerics = {
            "dtype": str(dtype),
            "device": device.type,
            "cpu_linear": self.linear_strategy.name,
        }
        basis = resolve_key_basis(
            cfg.kv_low_rank_keys,
            model=self.model,
            model_path=path,
            fingerprint=model_fingerprint(path, numerics),
            encode=self.tokenizer.encode,
            device=device,
            basis_file=cfg.kv_low_rank_keys_file,
            calibration_file=cfg.kv_low_rank_calibration,
            max_tokens=max_len,
        )
        self.model.set_key_basis([basis.projection(i) for i in range(basis.num_layers)])
        logger.info(
            "low-rank keys: rank %d of %d keeps %.1f%% of the calibration scores' variance",
            basis.rank,
            basis.head_dim,
            100 * basis.kept_energy(),
        )
        return basis

    def _start_tensor_parallel(
        self, path: Path, device: torch.device, dtype: torch.dtype
    ) -> tuple[Any, LinearChoice, AttentionBackend]:
        """Spawn the worker ranks and build rank 0's shard (engine/parallel/executor.py)."""
        cfg = self.config
        check_tensor_parallel(self.model_config, cfg.tensor_parallel_size)
        if device.type == "cuda" and cfg.num_gpu_blocks_override is None:
            raise ValueError(
                "--tensor-parallel-size > 1 on CUDA needs --num-gpu-blocks-override (the "
                "memory profile does not run across the ranks yet)"
            )
        self.tp = TPExecutor.start(cfg, path, device, dtype)
        try:
            spec = ShardSpec(self.model_config, 0, cfg.tensor_parallel_size)
            return build_rank_model(
                cfg, path, self.model_config, spec, self.tp.group, device, dtype
            )
        except BaseException:
            self.tp.close()
            raise

    def _build_kv(
        self,
        num_blocks: int,
        max_len: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_format: KVFormat,
        model_path: Path,
        backend_name: str,
        proposer: Proposer | None,
    ) -> KVHierarchy | None:
        """The tiers below the device pool, the KV manager, the scheduler, the
        runner (which owns the caches of ``kv_format``), the draft's cache and the
        tier copier.

        A draft model's cache is its own layer group in the same block ids: the
        tiers see one grouped format (target layers, then draft layers), so a
        block demoted, swapped or read back from disk carries both."""
        cfg = self.config
        mc = self.model_config
        kv_dtype = kv_format.dtype if isinstance(kv_format, PlainKVFormat) else dtype
        kv_heads = kv_format.num_kv_heads  # this rank's (tensor parallelism)
        draft_format = proposer.kv_format(cfg.block_size) if proposer is not None else None
        tier_format: KVFormat = (
            kv_format if draft_format is None else GroupedKVFormat([kv_format, draft_format])
        )
        # What else makes a block's bytes what they are (the disk fingerprint).
        numerics = {
            "dtype": str(dtype),
            "device": device.type,
            "cpu_linear": self.linear_strategy.name,
            "attention": backend_name,
        }
        if cfg.speculative is not None and draft_format is not None:
            sp = cfg.speculative
            numerics["draft"] = f"{sp.model or 'self'}:{sp.quantization}"
        hierarchy = build_hierarchy(cfg, tier_format, device, model_path, numerics)
        self.kv = KVCacheManager(
            num_blocks, cfg.block_size, cfg.enable_prefix_caching, hierarchy=hierarchy
        )
        self.scheduler = Scheduler(cfg, self.kv, max_len, clock=self.clock)
        self.runner = ModelRunner(
            self.model,
            mc.num_hidden_layers,
            kv_heads,
            mc.head_dim,
            num_blocks,
            cfg.block_size,
            device,
            kv_dtype,
            cfg.moe_capacity_factor,
            kv_format,
        )
        has_rope = hasattr(self.model.model, "rotary_emb")
        if cfg.kv_policy != "full" and not has_rope:
            raise ValueError(f"--kv-policy {cfg.kv_policy} needs a RoPE model (it re-rotates keys)")
        self._policy_unavailable = policy_unavailable(cfg, has_rope)
        self.kv_policies = KVPolicyRuntime(
            cfg,
            self.kv,
            kv_format,
            self.runner.kv_caches,
            lambda: self.model.model.rotary_emb.cos_sin_cache,
        )
        caches = list(self.runner.kv_caches)
        if proposer is not None:
            proposer.allocate_cache(num_blocks, cfg.block_size)
            caches += proposer.cache_tensors()
        if self.tp is not None:
            self.tp.init_kv(num_blocks, cfg.block_size, kv_dtype)
        self.transfers: KVTransferExecutor | None = None
        if hierarchy is not None:
            self.transfers = KVTransferExecutor(tier_format, caches, hierarchy, device)
        self._tier_format = tier_format
        self._all_caches = caches
        if cfg.enable_prefix_caching and self.tp is None:
            # Partial prefix hits copy blocks on this process's caches; tensor-
            # parallel ranks hold theirs in other processes (not built). A KIVI
            # block's tokens come in groups: a copied group must be whole; and a
            # float16 window of more than one group would read the copied
            # block's slots, which hold the other sequence's last groups, so
            # such layouts take whole-block hits only (kernels/kivi.py).
            lay = kv_format.attention_layout()
            if lay is None:
                self.kv.enable_partial_hits(1)
            elif lay.ring_groups == 1:
                self.kv.enable_partial_hits(lay.group_size)
        return hierarchy

    def _copy_blocks(self, sources: list[int], destinations: list[int]) -> None:
        """Whole-block device copies, every layer of every layer group (the
        draft's too): partial prefix hits (KVCacheManager.run_block_copies)."""
        device = self._all_caches[0][0].device
        self._tier_format.copy_blocks(
            self._all_caches,
            torch.tensor(sources, dtype=torch.int64, device=device),
            torch.tensor(destinations, dtype=torch.int64, device=device),
        )

    def _enable_native_decode(self, device: torch.device) -> str:
        """Attach the fused native decode step where the model can use it; returns
        the decode path's name (``fused``, ``cuda_graphs`` or ``per_layer``)."""
        if self.runner.graphs is not None:
            return "cuda_graphs"
        choice = self.config.cpu_decode_step
        if device.type != "cpu" or choice == "per_layer" or self.tp is not None:
            return "per_layer"
        try:
            self.runner.native_step = NativeDecodeStep.build(
                self.model, self.runner.kv_caches, self.runner.kv_format.attention_layout()
            )
        except ValueError as e:
            if choice == "fused":
                raise ValueError(f"--cpu-decode-step fused: {e}") from e
            logger.info("decode steps per layer: %s", e)
            return "per_layer"
        return "fused"

    # ---- sizing -------------------------------------------------------
    def _profile_step(self, device: torch.device, dtype: torch.dtype, max_len: int) -> None:
        """Run one forward of the largest step (``max_num_batched_tokens`` tokens over
        up to ``max_num_seqs`` sequences, logits for each) on a temporary cache."""
        cfg = self.config
        mc = self.model_config
        tokens = max(1, min(cfg.max_num_batched_tokens, max_len * cfg.max_num_seqs))
        nseq = max(1, min(cfg.max_num_seqs, tokens))
        per = [tokens // nseq + (1 if i < tokens % nseq else 0) for i in range(nseq)]
        blocks_each = [-(-n // cfg.block_size) for n in per]
        nblocks = sum(blocks_each)
        key_dim = self.key_basis.rank if self.key_basis is not None else None
        kvh = mc.num_key_value_heads
        fmt = PlainKVFormat(mc.num_hidden_layers, cfg.block_size, kvh, mc.head_dim, dtype, key_dim)
        runner = ModelRunner(
            self.model,
            mc.num_hidden_layers,
            kvh,
            mc.head_dim,
            nblocks,
            cfg.block_size,
            device,
            dtype,
            cfg.moe_capacity_factor,
            fmt,
        )
        batch = []
        next_block = 0
        for i, n in enumerate(per):
            r = Request(f"profile-{i}", "profile", 0, [0] * n, SamplingParams(temperature=0.0))
            r.block_ids = list(range(next_block, next_block + blocks_each[i]))
            next_block += blocks_each[i]
            batch.append(ScheduledRequest(r, n, 0))
        runner.execute(batch)
        del runner

    def _num_blocks(
        self, device: torch.device, per_block: int, dtype: torch.dtype, max_len: int
    ) -> int:
        """Blocks of ``per_block`` bytes (the KV format's, every layer, plus a draft
        model's cache, whose layer group shares the block ids) the budget holds."""
        cfg = self.config
        if cfg.num_gpu_blocks_override:
            return cfg.num_gpu_blocks_override
        if device.type == "cuda":
            # Profile the largest step first, so the cache gets what activations leave.
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            self._profile_step(device, dtype, max_len)
            activations = torch.cuda.max_memory_allocated(device) - base
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            budget = int(total * cfg.gpu_memory_utilization) - (total - free) - activations
        else:
            budget = cfg.kv_cache_memory
        n = budget // per_block
        if n < 2:
            raise ValueError(
                f"KV cache budget of {budget} bytes holds fewer than 2 blocks of {per_block} bytes; "
                "raise --kv-cache-memory or --gpu-memory-utilization"
            )
        return int(n)

    # ---- speculative decoding ---------------------------------------------
    def _proposer(
        self,
        path: Path,
        backend: object,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype,
        max_len: int,
    ) -> Proposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.is_self_draft and spec.quantization == self.linear_strategy.name:
            # The draft would be the target itself: every draft token costs a
            # target forward, and the draft's KV is computed for every token on
            # top of the target's, so it can only slow the target down (measured
            # 0.23-0.58x in docs/benchmarks/spec-decode-loaded.md before this refusal).
            raise ValueError(
                f"--speculative-config: the self-draft would run the target's own "
                f"{spec.quantization} linears (--cpu-linear resolved to "
                f"{self.linear_strategy.name}), so it cannot be cheaper than the target; "
                "serve the float weights (--cpu-linear onednn) for a q4_1 self-draft, pick "
                'another "quantization", give a smaller draft "model", or use "method": "ngram"'
            )
        # The draft gets its own backend instance: backends memoise per-step plans.
        draft_backend = get_attention_backend(self.config.attention_backend, device)
        return DraftModelProposer.load(
            spec, path, self.model_config, draft_backend, dtype, device, kv_dtype, max_len
        )

    def _speculator(
        self, proposer: Proposer | None, num_blocks: int, max_len: int
    ) -> Speculator | None:
        if proposer is None:
            return None
        assert self.config.speculative is not None
        policy = self._draft_policy(proposer, max_len)
        return Speculator(self.config.speculative, proposer, policy)

    def _draft_policy(self, proposer: Proposer, max_len: int) -> DraftPolicy:
        """The adaptive rule over cost tables measured now (engine/spec_decode/controller.py)."""
        spec = self.config.speculative
        assert spec is not None
        if not spec.adaptive:
            return FixedDraftPolicy()
        cfg = self.config
        limit = min(
            cfg.max_num_batched_tokens, max(cfg.max_num_seqs, 1) * (1 + spec.num_speculative_tokens)
        )
        # Dense where one stream's verification chunks fall, sparse above (the
        # table is extended with its last slope); a few seconds at start-up.
        grid = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
        sizes = [n for n in grid if n <= limit] or [1]
        t0 = time.perf_counter()
        target = measure_step_cost(self.runner, sizes, self.kv.num_blocks, cfg.block_size)
        plain = None
        fast_decode = self.runner.native_step is not None or self.runner.graphs is not None
        if fast_decode and not self.runner.split_verification:
            # Plain decode steps take the fused step / graphs; verification chunks,
            # not split into decode rows by this backend, run the per-layer forward.
            seqs = [b for b in grid if b <= cfg.max_num_seqs] or [1]
            plain = measure_step_cost(
                self.runner, seqs, self.kv.num_blocks, cfg.block_size, plain=True
            )
            logger.info(
                "plain decode step table (sequences: ms): %s",
                ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in plain.points),
            )
        draft_cost = None
        if isinstance(proposer, DraftModelProposer):
            rows = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= cfg.max_num_seqs] or [1]
            draft_cost = proposer.drafting_cost_model(sizes, rows, self.kv.num_blocks)
        logger.info(
            "speculation cost table (tokens: ms): %s (measured in %.1f s)",
            ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in target.points),
            time.perf_counter() - t0,
        )
        if draft_cost is None:
            return AdaptiveDraftPolicy(target, plain_cost=plain)
        return AdaptiveDraftPolicy(target, draft_cost, plain)

    def describe(self) -> str:
        i = self.info
        return (
            f"model={i.model_path} dtype={str(i.dtype).removeprefix('torch.')} device={i.device} "
            f"kv_blocks={i.num_blocks} block_size={i.block_size} "
            f"kv_tokens={i.num_blocks * i.block_size} max_model_len={i.max_model_len} "
            + " ".join(f"{k}={v}" for k, v in i.execution().items() if k not in ("device", "dtype"))
            + f" host_kv_blocks={i.num_host_blocks} disk_kv_tier={i.disk_tier_path or 'off'}"
            + f" tensor_parallel_size={self.config.tensor_parallel_size}"
            + (f" speculation={self._describe_speculation()}" if self.speculator else "")
        )

    def _describe_speculation(self) -> str:
        spec = self.config.speculative
        assert spec is not None
        what = spec.method if spec.method == "ngram" else (spec.model or "self-draft")
        quant = f",{spec.quantization}" if spec.quantization else ""
        return f"{what}(k={spec.num_speculative_tokens}{quant},adaptive={spec.adaptive})"

    def _capture_decode_graphs(self, max_len: int) -> None:
        """CUDA graphs for decode-only steps (engine/worker/cuda_graphs.py), when the backend allows."""
        sizes = batch_size_ladder(self.config.max_num_seqs)
        try:
            t0 = time.perf_counter()
            self.runner.enable_decode_graphs(sizes, max_len, cuda_graph_factory())
        except ValueError as e:  # a backend that cannot be captured (torch): run eager
            logger.warning("CUDA graphs off: %s", e)
            return
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            sizes,
            time.perf_counter() - t0,
        )

    def model_backend_name(self) -> str:
        backend = attention_backend_of(self.model)
        return backend.name if backend is not None else "?"

    # ---- structured output ----------------------------------------------
    @property
    def grammar(self) -> GrammarCompiler:
        """The grammar compiler (built on first use: it indexes the vocabulary)."""
        with self._grammar_lock:
            if self._grammar is None:
                self._grammar = GrammarCompiler(
                    self.tokenizer.hf_tokenizer, self.model_config.vocab_size
                )
            return self._grammar

    def compile_structured(self, spec: StructuredOutputSpec) -> None:
        """Compile (and cache) ``spec``; raises InvalidRequestError. Safe off the engine thread."""
        self.grammar.compile(spec)

    def _grammar_mask(self, rows: Sequence[SampleRow]) -> GrammarMaskFn | None:
        """The grammar mask for ``rows``: each constrained row's allowed next tokens after
        its request's tokens and the row's prior drafts (accepted, then rolled back)."""
        constrained = [
            i
            for i, row in enumerate(rows)
            if row.req.grammar is not None and not row.req.grammar.is_terminated()
        ]
        if not constrained:
            return None
        vocab = self.model_config.vocab_size
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_bitmask(max(len(rows), 8), vocab)
        bitmask = self._bitmask

        def mask(logits: torch.Tensor) -> None:
            masked: list[int] = []
            owner: Request | None = None
            depth = 0  # prior tokens of ``owner`` accepted into its matcher
            for i in constrained:
                row = rows[i]
                if row.req is not owner or len(row.prior) < depth:
                    if owner is not None and depth:
                        owner.grammar.rollback(depth)
                    owner, depth = row.req, 0
                g = row.req.grammar
                # Rows of one request come in order of growing prior (drafts were
                # checked against the grammar before the forward).
                while depth < len(row.prior) and g.accept_token(row.prior[depth]):
                    depth += 1
                if depth == len(row.prior) and not g.is_terminated():
                    g.fill_bitmask(bitmask, i)
                    masked.append(i)
            if owner is not None and depth:
                owner.grammar.rollback(depth)
            apply_bitmask(logits, bitmask[: len(rows)], masked)

        return mask

    # ---- requests -----------------------------------------------------
    def validate_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, options: RequestOptions
    ) -> KVPolicySpec | None:
        """``validate`` under the request's KV policy (resolved here: the server's
        ``--kv-policy`` narrowed by ``options.kv_policy``; None is ``full``).
        Safe from any thread."""
        spec = resolve_policy(
            self.config, options.kv_policy, self.info.max_model_len, self._policy_unavailable
        )
        self.validate(prompt_token_ids, params, windowed=spec is not None)
        return spec

    def validate(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, windowed: bool = False
    ) -> None:
        """Checks that need no engine state (safe from any thread). ``windowed``:
        the request runs under a KV policy, which keeps its cache within the
        context whatever the prompt and output lengths (no context check)."""
        try:
            params.validate(vocab_size=self.model_config.vocab_size)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is out of vocabulary (size {vocab})", param="prompt"
            )
        max_len = self.info.max_model_len
        n = len(prompt_token_ids)
        want = params.max_tokens or 0
        if not windowed and (n + want > max_len or n >= max_len):
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you requested "
                f"{n + want} tokens ({n} in the prompt, {want} in the completion). "
                "Please reduce the length of the prompt or completion.",
                param="max_tokens" if n < max_len else "prompt",
                code="context_length_exceeded",
            )

    def add_request(
        self,
        group_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: object = None,
        options: RequestOptions = RequestOptions(),
        *,
        arrival_time: float | None = None,
    ) -> None:
        """Queue the n choices of one request. Raises InvalidRequestError / RequestRejectedError."""
        if group_id in self.groups:
            raise InvalidRequestError(f"request id {group_id!r} is already in use")
        spec = self.validate_request(prompt_token_ids, params, options)
        if spec is not None:
            self.kv_policies.new_state(spec, options.segments)  # refuses what cannot fit
        now = self.clock() if arrival_time is None else arrival_time
        reqs: list[Request] = []
        for i in range(params.n):
            reqs.append(
                Request(
                    request_id=f"{group_id}-{i}" if params.n > 1 else group_id,
                    group_id=group_id,
                    index=i,
                    prompt_token_ids=list(prompt_token_ids),
                    params=params,
                    eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
                    priority=options.priority,
                    arrival_time=now,
                    deadline=(
                        now + options.latency_budget_ms / 1000
                        if options.latency_budget_ms
                        else None
                    ),
                    ttft_deadline=(
                        now + options.ttft_budget_ms / 1000 if options.ttft_budget_ms else None
                    ),
                    cache_salt=options.cache_salt,
                    max_model_len=self.info.max_model_len,
                    prefix_source=None,
                )
            )
        for r in reqs[1:]:
            r.prefix_source = reqs[0]
        if spec is not None:
            for r in reqs:
                r.kv_state = self.kv_policies.new_state(spec, options.segments)
                r.kv_cap = r.kv_state.cap
                r.max_model_len = 1 << 62  # positions stay in the cache: no context limit
        if params.structured is not None:
            for r in reqs:
                r.grammar = self.grammar.new_state(params.structured)
        # Admission is decided once for the group, by its first choice.
        try:
            self.scheduler.add_request(reqs[0])
        except Exception:
            self.stats.rejections = dict(self.scheduler.rejections)
            raise
        for r in reqs[1:]:
            self.scheduler.add_request(r, admit_check=False)
        for r in reqs:
            self.tracer.on_arrival(r.request_id, now)
        group = GroupState(
            group_id, list(prompt_token_ids), [make_choice(self.tokenizer, r) for r in reqs], sink
        )
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]
        self.groups[group_id] = group

    def abort(
        self, group_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> RequestOutput | None:
        """End every unfinished choice of the group and free its blocks."""
        group = self.groups.pop(group_id, None)
        if group is None:
            return None
        deltas = []
        for c in group.choices:
            if not c.finished:
                self.scheduler.finish(c.req, status)
                if self.speculator is not None:
                    self.speculator.forget(c.req.request_id)
                self.tracer.on_finished(c.req.request_id, self.clock(), status.value)
                deltas.append(final_delta(c, status))
        self._refresh_stats()
        return build_output(group, deltas)

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    # ---- the step -----------------------------------------------------
    def step(self) -> list[tuple[GroupState, RequestOutput]]:
        outputs = self._step()
        if self.kv_events is not None:
            self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        """Hand this step's KV events to the publisher thread (never blocks)."""
        assert self.kv_events is not None and self.kv_event_publisher is not None
        events = self.kv_events.take()
        if events:
            self.kv_events.counters.batches += 1
            # Rank 0 in the batch: each replica is its own engine instance behind
            # the router (a static event source of one rank), and vllm-router drops
            # a batch whose rank its subscriber does not serve. --data-parallel-rank
            # only offsets the replica's event ports.
            batch = KVEventBatch(time.time(), events, 0)
            self.kv_event_publisher.publish(batch)

    def _step(self) -> list[tuple[GroupState, RequestOutput]]:
        self.kv.poll_transfers()
        spec = self.speculator
        if spec is not None:
            spec.plan(self.scheduler.running, self.config.max_num_batched_tokens)
        sched = self.scheduler.schedule()
        if self.tracer.enabled:
            self._trace_schedule(sched, self.clock())
        self._run_kv_transfers()
        if not sched.scheduled:
            self._refresh_stats()
            return []
        t0 = time.perf_counter()
        try:
            draft_probs = spec.propose(sched.scheduled, self._grammar_mask) if spec else None
            t_target = time.perf_counter()
            result = self.runner.execute(sched.scheduled, self._grammar_mask, draft_probs)
            t_target = time.perf_counter() - t_target
        except Exception as e:
            if self.tp is not None:
                # The ranks may be out of step now: tensor-parallel steps cannot fail alone.
                self.tp.fail(f"tensor-parallel step failed: {type(e).__name__}: {e}")
                self.tp.check_alive()
            logger.exception("model step failed; ending the requests in it")
            return self._fail(sched.scheduled)
        dt = time.perf_counter() - t0
        self.scheduler.predictor.observe(sched.num_prefill_tokens, sched.num_decodes, dt)
        accepted = {rid: t.num_accepted for rid, t in result.sampled.items() if t.num_drafts}
        rolled_back = spec.rolled_back(sched.scheduled, accepted) if spec else None
        self.scheduler.update_after_step(sched, rolled_back)
        if spec is not None:
            spec.observe(sched.scheduled, accepted, t_target)
        try:
            self.kv_policies.after_step([s.req for s in sched.scheduled], result.attn_mass)
        except Exception:
            # A compaction that fails ends this step's requests, not the engine loop.
            logger.exception("KV policy step failed; ending the requests in it")
            return self._fail(sched.scheduled)
        now = self.clock()
        if self.tracer.enabled:
            self._trace_step(sched, dt, result)
        self.stats.num_steps += 1
        self.stats.prompt_tokens += sum(
            min(s.num_new_tokens, max(s.req.num_prompt_tokens - s.start, 0))
            for s in sched.scheduled
        )

        outputs = self._process(sched, result, now)
        if self.config.debug_invariants:
            self.scheduler.check_invariants()
        self._refresh_stats()
        return outputs

    def _run_kv_transfers(self) -> None:
        """This step's block copies, batched, before its forward: the tiers'
        demotions, then partial prefix hits' device copies, then promotions."""
        plan = self.kv.take_transfers()

        def copies() -> None:
            self.kv.run_block_copies(self._copy_blocks)

        if plan is None:
            copies()
            return
        assert self.transfers is not None
        self.transfers.run(plan, between=copies)

    # ---- KV tiers -------------------------------------------------------
    def flush_kv_tiers(self) -> int:
        """Write every cached KV block not yet on the disk tier (host tier and
        device prefix cache) and wait for the disk writer; returns the number
        of blocks written now. The server calls it while draining (shutdown),
        so a graceful restart finds every cached prefix. A no-op without a
        disk tier. Engine thread only, between steps."""
        hierarchy = self.kv.hierarchy
        if hierarchy is None or hierarchy.disk is None or self.transfers is None:
            return 0
        t0 = time.perf_counter()
        n = hierarchy.flush(self.kv.cached_device_blocks(), self.transfers.read_device_blocks)
        logger.info("flushed %d KV blocks to the disk tier in %.2f s", n, time.perf_counter() - t0)
        self._refresh_stats()
        return n

    def check_health(self) -> None:
        """Raise ``WorkerDiedError`` when the engine cannot step any more (a tensor-parallel
        worker died). Cheap; the async engine calls it on every loop turn."""
        if self.tp is not None:
            self.tp.check_alive()

    def close(self) -> None:
        """Flush the KV tiers and stop their disk writer thread. Call it when done
        with an engine that has a disk tier (``AsyncEngine.shutdown`` does): the
        writer is a daemon thread, and what it has not written yet is lost at
        exit otherwise. Idempotent; the engine stays usable (without
        write-through), except under tensor parallelism, where it also stops the
        worker ranks (call it when done with such an engine)."""
        self.flush_kv_tiers()
        if self.kv.hierarchy is not None:
            self.kv.hierarchy.close()
        if self.kv_event_publisher is not None:
            self._publish_kv_events()  # what the flush wrote to disk
            self.kv_event_publisher.close()
        if self.tp is not None:
            self.tp.close()

    def rerotate_blocks(
        self, block_ids: Sequence[int], new_positions: Sequence[Sequence[int]]
    ) -> None:
        """Move the keys of ``block_ids`` to ``new_positions`` (``block_size`` each).

        Re-rotates every layer's keys by the position delta from the positions
        each block records (``KVBlock.positions``), then records the new ones.
        For KV policies that keep a sequence's tokens at other positions (sinks,
        segment reuse). Only a block one request owns may move: a block in the
        prefix cache is shared at its own positions (raises ValueError).
        """
        if self.tp is not None:
            raise ValueError("re-rotating KV blocks is not tensor-parallel (rank 0's cache only)")
        bs = self.config.block_size
        blocks: list[KVBlock] = [self.kv.pool.blocks[b] for b in block_ids]
        for b, pos in zip(blocks, new_positions):
            if b.block_hash is not None or b.ref_count != 1:
                raise ValueError(f"KV block {b.block_id} is shared or cached: its positions stay")
            if b.positions is None or len(pos) != bs:
                raise ValueError(f"KV block {b.block_id}: {bs} positions needed, recorded and new")
        if not blocks:
            return
        old = torch.tensor([list(b.positions or ()) for b in blocks], dtype=torch.long)
        new = torch.tensor([list(p) for p in new_positions], dtype=torch.long)
        cos_sin = self.model.model.rotary_emb.cos_sin_cache
        self.runner.kv_format.rerotate_keys(
            self.runner.kv_caches,
            torch.tensor(list(block_ids), dtype=torch.long),
            old,
            new,
            cos_sin,
        )
        for b, pos in zip(blocks, new_positions):
            b.positions = tuple(pos)

    def _process(
        self, sched: SchedulerOutput, result: StepResult, now: float
    ) -> list[tuple[GroupState, RequestOutput]]:
        """Turn one step's sampled tokens into deltas; end the requests that stop."""
        per_group: dict[str, list[CompletionDelta]] = {}
        for s in sched.scheduled:
            req = s.req
            group = self.groups.get(req.group_id)
            if group is None:
                continue
            plp = result.prompt_logprobs.get(req.request_id)
            if plp:
                group.prompt_logprobs.extend(plp)
                req.num_prompt_logprobs += len(plp)
            sampled = result.sampled.get(req.request_id)
            if sampled is None:
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            choice = group.choices[req.index]
            deltas: list[CompletionDelta] = []
            # Accepted drafts, then the sampled token: a stop inside the run ends
            # the request there, and the tokens after it are not emitted.
            for token, lp in zip(sampled.token_ids, sampled.logprobs):
                self.stats.generation_tokens += 1
                delta, status = process_token(choice, token, lp)
                if req.grammar is not None and status is None:
                    status = self._advance_grammar(req, token)
                    if status is not None:
                        tail, _ = finish_text(choice)
                        delta.delta_text += tail
                        delta.finish_reason = status.value
                deltas.append(delta)
                if status is not None:
                    self._finish(req, status, now)
                    break
            per_group.setdefault(req.group_id, []).append(merge_deltas(deltas))

        outputs = []
        for gid, deltas in per_group.items():
            group = self.groups[gid]
            out = build_output(group, deltas)
            if group.finished:
                del self.groups[gid]
            outputs.append((group, out))
        return outputs

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> RequestStatus | None:
        """Feed ``token`` to the request's grammar; a status when that ends the request."""
        assert req.grammar is not None
        if not req.grammar.accept_token(token):
            # Cannot happen when the mask was applied; end rather than emit garbage.
            logger.error("grammar rejected sampled token %d for %s", token, req.request_id)
            return RequestStatus.FINISHED_ERROR
        if req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        return None

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        self.scheduler.finish(req, status)
        if self.speculator is not None:
            self.speculator.forget(req.request_id)
        self.tracer.on_finished(req.request_id, now, status.value)
        self.tracer.on_content(
            req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
        )

    def _trace_schedule(self, sched: SchedulerOutput, now: float) -> None:
        for r in sched.preempted:
            self.tracer.on_preempted(r.request_id, now, "swap" if r.swapped_blocks else "recompute")
        for s in sched.scheduled:
            self.tracer.on_scheduled(s.req.request_id, now)

    def _trace_step(self, sched: SchedulerOutput, dt: float, result: StepResult) -> None:
        ms = dt * 1000.0
        scheduled = sched.scheduled
        for s in scheduled:
            rid = s.req.request_id
            if s.is_decode:
                sampled = result.sampled.get(rid)
                accepted = sampled.num_accepted if sampled is not None else 0
                self.tracer.on_decode_step(rid, ms, len(scheduled), s.num_draft_tokens, accepted)
            else:
                if s.start == s.req.num_cached_tokens and s.req.num_cached_tokens:
                    self.tracer.on_prefix_hit(
                        rid, s.req.num_cached_tokens, s.req.cached_tokens_by_tier
                    )
                self.tracer.on_prefill_chunk(rid, s.num_new_tokens, s.start, ms)
            self.tracer.on_blocks(rid, len(s.req.block_ids))
            capacity = result.moe_capacity.get(rid)
            if capacity is not None:
                self.tracer.on_moe_capacity(rid, *capacity)

    def get_trace(self, request_ids: Sequence[str]) -> RequestTrace | None:
        """A copy of the first stored trace among ``request_ids`` (None if tracing is off).

        The copy has its own event list, so the caller may read it after the
        engine moves on. Call it on the engine thread (``AsyncEngine.get_trace``).
        """
        if isinstance(request_ids, str):
            # A str is a Sequence[str] of its characters: never what the caller meant.
            raise TypeError("get_trace takes a sequence of request ids, not one str")
        if self.traces is None:
            return None
        for rid in request_ids:
            trace = self.traces.get(rid)
            if trace is not None:
                return dataclasses.replace(trace, events=list(trace.events))
        return None

    def _fail(
        self, scheduled: Sequence[ScheduledRequest]
    ) -> list[tuple[GroupState, RequestOutput]]:
        outs = []
        gids = {s.req.group_id for s in scheduled}
        for gid in gids:
            group = self.groups.get(gid)
            out = self.abort(gid, RequestStatus.FINISHED_ERROR)
            if group is not None and out is not None:
                outs.append((group, out))
        self._refresh_stats()
        return outs

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting)
        preempted = swapped = 0
        for r in self.scheduler.waiting:
            if r.status is RequestStatus.PREEMPTED:
                preempted += 1
                swapped += bool(r.swapped_blocks)
        s.num_preempted_waiting = preempted
        s.kv_tiers = self.kv.tier_snapshot(swapped)
        s.kv_cache_usage = self.kv.usage
        s.num_free_blocks = self.kv.num_free_blocks
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_cache_queries = self.kv.prefix_queries
        s.prefix_cache_hits = self.kv.prefix_hits
        s.rejections = dict(self.scheduler.rejections)
        s.latency_budget_misses = self.scheduler.latency_budget_misses
        errors = self.scheduler.prediction_errors
        s.predictor_samples = errors.samples
        s.predictor_mean_abs_rel_error = errors.mean_abs_rel_error
        s.predictor_mean_rel_error = errors.mean_rel_error
        if isinstance(self.model, MoeForCausalLM):
            s.moe_layers = self.model.routing_stats()
        if self.speculator is not None:
            sp = self.speculator.stats
            s.spec_decode_num_drafts = sp.num_drafts
            s.spec_decode_draft_tokens = sp.num_draft_tokens
            s.spec_decode_accepted_tokens = sp.num_accepted_tokens
            s.spec_decode_accepted_per_pos = list(sp.accepted_per_pos)


__all__ = ["EngineInfo", "LLMEngine", "StepResult"]
