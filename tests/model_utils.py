"""Helpers shared by tests: tiny random checkpoints and hand-built attention metadata.

``make_tiny_checkpoint`` writes a Hugging Face directory (config.json +
model.safetensors) for a small random model of a supported family. Weights are
re-drawn with unit-scale statistics (not transformers' 0.02 init) so that
logits are O(1) and a numerical mismatch cannot hide under tiny values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionMetadata

# Base kwargs per test architecture name. ``llama3`` is Llama with llama3 RoPE
# scaling whose original context (32) is short enough that all three frequency
# bands (kept, interpolated, slowed) occur with head_dim 16.
_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
TINY_ARCHS = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# Mixture-of-experts families (engine/models/moe.py): 4-8 experts of width 32, top-2.
TINY_MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A transformers config for a tiny model of ``arch`` (one of ``TINY_ARCHS``)."""
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    kw: dict[str, Any] = dict(_TINY_COMMON)
    if arch == "llama":
        cls: Any = LlamaConfig
        kw["rope_theta"] = 10000.0
    elif arch == "llama3":
        cls = LlamaConfig
        kw["rope_parameters"] = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    elif arch == "mistral":
        cls = MistralConfig
        kw["sliding_window"] = None
    elif arch == "qwen2":
        cls = Qwen2Config
    elif arch == "qwen3":
        cls = Qwen3Config
        # head_dim deliberately differs from hidden_size // num_attention_heads.
        kw["head_dim"] = 32
    elif arch == "mixtral":
        cls = MixtralConfig
        kw.update(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)
        kw["sliding_window"] = None
    elif arch == "qwen2_moe":
        cls = Qwen2MoeConfig
        kw.update(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
    elif arch == "qwen3_moe":
        cls = Qwen3MoeConfig
        kw.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            head_dim=32,
        )
    elif arch == "olmoe":
        cls = OlmoeConfig
        kw.update(num_experts=8, num_experts_per_tok=2, intermediate_size=32)
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS + TINY_MOE_ARCHS}")
    kw.update(overrides)
    return cls(**kw)


def make_tiny_checkpoint(tmp_path: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny random HF checkpoint of ``arch`` under ``tmp_path``; return its directory.

    ``overrides`` are passed to the transformers config (e.g.
    ``tie_word_embeddings=True``, ``num_hidden_layers=3``).
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_hf_config(arch, **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2 and "embed_tokens" not in name:
                # Matrices (and stacked [E, out, in] expert matrices) scaled by fan-in.
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen))
    suffix = "-".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    out = tmp_path / (f"{arch}-{suffix}" if suffix else arch)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def prefill_metadata(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one step plus the ``positions`` of its new tokens.

    Sequence ``i`` has ``seq_lens[i]`` tokens after the step, the last
    ``query_lens[i]`` of them new; ``block_tables[i]`` lists its blocks. Callers
    put decode sequences (query length 1) first.
    """
    num_decodes = 0
    for q in query_lens:
        if q != 1:
            break
        num_decodes += 1
    starts = [0]
    positions: list[int] = []
    slots: list[int] = []
    for seq_len, q, blocks in zip(seq_lens, query_lens, block_tables):
        starts.append(starts[-1] + q)
        for pos in range(seq_len - q, seq_len):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    width = max(len(b) for b in block_tables)
    table = torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts,
    )
    return meta, torch.tensor(positions, dtype=torch.long)


def make_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed per-layer ``(k_cache, v_cache)`` in the layout of ``engine/attention/base.py``."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(num_layers)
    ]


_HF_TO_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def hf_to_gguf_name(name: str) -> str:
    """Hugging Face tensor name -> llama.cpp name (Llama layout)."""
    if name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's q/k row reordering (half-split -> interleaved pairs)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(
    hf_dir: Path,
    out: Path,
    qtypes: dict[str, Any] | None = None,
    raw: dict[str, tuple[np.ndarray, Any]] | None = None,
) -> Path:
    """Convert a tiny Llama HF checkpoint to a ``llama``-arch GGUF, like llama.cpp does.

    ``qtypes`` maps GGUF tensor names to a ``gguf.GGMLQuantizationType``; the
    rest are stored as F32. Quantized tensors go through ``gguf.quants.quantize``.
    ``raw`` maps GGUF names to ``(uint8 blocks, type)`` stored verbatim instead of
    the checkpoint's tensor (for types ``gguf`` cannot quantize, e.g. K-quants).
    """
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for name, arr in tensors.items():
        gname = hf_to_gguf_name(name)
        arr = arr.astype(np.float32)
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        qtype = (qtypes or {}).get(gname)
        if raw and gname in raw:
            blocks, raw_type = raw[gname]
            w.add_tensor(gname, blocks, raw_dtype=raw_type)
        elif qtype is None:
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def random_kquant_blocks(qtype: Any, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid Q4_K / Q6_K data ``[rows, bytes_per_row]`` (finite f16 scales)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin lead the block
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    elif qtype == gguf.GGMLQuantizationType.Q6_K:  # d ends the block
        data[..., size - 2 : size] = scale
    else:
        raise ValueError(f"not a K-quant this helper knows: {qtype}")
    return data.reshape(rows, -1)


# HF architecture (tiny test name) -> llama.cpp GGUF architecture.
_MOE_GGUF_ARCH = {
    "mixtral": "llama",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
}
_HF_TO_GGUF_MOE = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def write_moe_gguf(hf_dir: Path, arch: str, out: Path, expert_qtype: Any = None) -> Path:
    """Convert a tiny MoE HF checkpoint (``arch`` in ``TINY_MOE_ARCHS``) to GGUF as
    llama.cpp's converter does: experts stacked into ``ffn_{gate,up,down}_exps``
    (``[E, out, in]``), Mixtral as a ``llama`` file (q/k rows permuted), the
    shared-expert gate as a vector. ``expert_qtype`` quantizes the stacked experts."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    garch = _MOE_GGUF_ARCH[arch]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    num_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w = gguf.GGUFWriter(str(out), garch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    stacked: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    expert_re = re.compile(
        r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
    )
    parts = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up"}
    parts["down_proj"] = "down"
    for name, arr in tensors.items():
        arr = arr.astype(np.float32)
        m = expert_re.match(name)
        if m is not None:
            layer, e, part = int(m[1]), int(m[2]), parts[m[3]]
            stacked.setdefault((layer, part), {})[e] = arr
            continue
        if name in _HF_TO_GGUF_GLOBAL:
            gname = _HF_TO_GGUF_GLOBAL[name]
        else:
            _, _, layer_s, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            module = module.replace("block_sparse_moe.", "mlp.")
            gpart = _HF_TO_GGUF_MOE.get(module) or _HF_TO_GGUF_BLOCK[module]
            gname = f"blk.{layer_s}.{gpart}.{kind}"
        if garch == "llama" and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, heads)
        elif garch == "llama" and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, kv_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            arr = arr.reshape(-1)
        w.add_tensor(gname, arr)
    for (layer, part), per_expert in sorted(stacked.items()):
        arr = np.stack([per_expert[e] for e in range(num_experts)])
        gname = f"blk.{layer}.ffn_{part}_exps.weight"
        if expert_qtype is None:
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, expert_qtype), raw_dtype=expert_qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
