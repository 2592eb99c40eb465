"""The model's shape, independent of where the weights come from (GGUF or HF directory).

``ModelConfig`` holds exactly what our model implementations read. It is built
either from a Hugging Face config (``from_hf_config``) or from GGUF metadata
(``engine.models.loader.load_model_config``). Features our implementation cannot
compute exactly (other activations, MLP biases, partial rotary, unknown RoPE
scaling types) are rejected here with a ``ValueError`` rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# RoPE scaling types ``engine.models.llama`` implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Hugging Face ``model_type`` -> architecture, for configs without ``architectures``.
_MODEL_TYPE_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

# Mixture-of-experts architectures (engine/models/moe.py implements them).
MOE_ARCHS = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)


@dataclass
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes:
        architecture: Hugging Face class name, e.g. ``LlamaForCausalLM``.
        head_dim: per-head size; may differ from ``hidden_size // num_attention_heads``
            (Qwen3).
        rope_scaling: ``None`` for plain RoPE, else a dict with ``rope_type``
            (``linear`` or ``llama3``) and that type's parameters (``factor``;
            llama3 also ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``).
        attention_bias: q/k/v projections have biases (Qwen2; Llama/Qwen3 when
            their ``attention_bias`` is set).
        o_proj_bias: the output projection has a bias (Llama/Qwen3 with
            ``attention_bias``; never Qwen2).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        sliding_window: window of a sliding-window model (Mistral), else ``None``.
            Attention backends attend over the full context, so results are exact
            only up to ``max_supported_len()`` tokens.
        qk_norm_full: with ``qk_norm``, the norm spans the whole q (and k)
            projection instead of each head (OLMoE).
        clip_qkv: clamp q, k and v to ``[-clip_qkv, clip_qkv]`` after the
            projections (and q/k norms), as OLMoE's ``clip_qkv`` does.
        num_experts: routed experts per MoE layer; 0 for a dense model.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: each routed expert's MLP width.
        norm_topk_prob: renormalise the top-k router probabilities to sum to 1
            (Mixtral always; Qwen-MoE and OLMoE per their config).
        moe_weights_fp32: scale expert outputs by float32 routing weights
            (Mixtral); otherwise the weights are cast to the model dtype first.
        shared_expert_intermediate_size: width of the always-on shared expert
            with its sigmoid gate (Qwen2-MoE); 0 for none.
        dense_layers: layers of an MoE model that have a dense MLP of
            ``intermediate_size`` instead (Qwen-MoE ``mlp_only_layers`` and
            ``decoder_sparse_step``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    sliding_window: int | None = None
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_weights_fp32: bool = False
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported RoPE scaling type {rope_type!r}; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), "
                    f"got {self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size < 1:
                raise ValueError("an MoE model needs moe_intermediate_size >= 1")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return (
            2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype.itemsize
        )

    def max_supported_len(self) -> int:
        """Longest sequence this implementation computes exactly.

        ``max_position_embeddings``, capped by ``sliding_window`` because the
        attention backends do not implement a window.
        """
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelConfig:
        """Build from a ``transformers.PretrainedConfig`` of a supported family.

        Raises:
            ValueError: the config uses a feature we do not implement.
        """
        archs = getattr(cfg, "architectures", None) or []
        model_type = getattr(cfg, "model_type", None)
        if archs:
            arch = str(archs[0])
        elif model_type in _MODEL_TYPE_ARCHS:
            # Configs built from GGUF metadata carry a model_type but no architectures.
            arch = _MODEL_TYPE_ARCHS[model_type]
        else:
            raise ValueError(
                f"the model config names no architecture ('architectures' is empty, "
                f"model_type {model_type!r})"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("MLP biases (mlp_bias=True) are not implemented")
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)

        theta, scaling = _rope_from_hf(cfg)
        attn_bias_flag = bool(getattr(cfg, "attention_bias", False) or False)
        if arch == "Qwen2ForCausalLM":
            # Qwen2 always has q/k/v biases and never an o_proj bias.
            qkv_bias, o_bias = True, False
        elif arch == "Qwen2MoeForCausalLM":
            # Qwen2-MoE: q/k/v biases per its ``qkv_bias`` (default on), never on o_proj.
            qkv_bias, o_bias = bool(getattr(cfg, "qkv_bias", True)), False
        elif arch in ("MistralForCausalLM", "MixtralForCausalLM"):
            qkv_bias, o_bias = False, False
        else:
            qkv_bias, o_bias = attn_bias_flag, attn_bias_flag

        window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", None) is False:
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(cfg.intermediate_size),
            num_hidden_layers=int(cfg.num_hidden_layers),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.max_position_embeddings),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
            sliding_window=int(window) if window is not None else None,
            **_moe_from_hf(arch, cfg),
        )


def _moe_from_hf(arch: str, cfg: Any) -> dict[str, Any]:
    """The MoE fields of ``ModelConfig`` for the architectures in ``MOE_ARCHS`` (else none).

    Each follows its transformers implementation: Mixtral always renormalises
    the top-k and keeps the weights in float32; Qwen2-MoE, Qwen3-MoE and OLMoE
    renormalise per ``norm_topk_prob`` and cast to the model dtype. Qwen-MoE
    layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid are dense.
    """
    if arch not in MOE_ARCHS:
        return {}
    layers = int(cfg.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        return {
            "num_experts": int(cfg.num_local_experts),
            "num_experts_per_tok": int(cfg.num_experts_per_tok),
            "moe_intermediate_size": int(cfg.intermediate_size),
            "norm_topk_prob": True,
            "moe_weights_fp32": True,
        }
    if arch == "OlmoeForCausalLM":
        clip = getattr(cfg, "clip_qkv", None)
        return {
            "num_experts": int(cfg.num_experts),
            "num_experts_per_tok": int(cfg.num_experts_per_tok),
            "moe_intermediate_size": int(cfg.intermediate_size),
            "norm_topk_prob": bool(cfg.norm_topk_prob),
            "qk_norm_full": True,
            "clip_qkv": float(clip) if clip is not None else None,
        }
    num_experts = int(cfg.num_experts)
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    dense = tuple(i for i in range(layers) if i in only or num_experts == 0 or (i + 1) % step != 0)
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        if shared < 1:
            raise ValueError("Qwen2-MoE needs shared_expert_intermediate_size >= 1")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg.num_experts_per_tok),
        "moe_intermediate_size": int(cfg.moe_intermediate_size),
        "norm_topk_prob": bool(cfg.norm_topk_prob),
        "shared_expert_intermediate_size": shared,
        "dense_layers": dense,
    }


def _rope_from_hf(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """Read (rope_theta, rope_scaling) from old- or new-style (transformers 5) configs."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = float(getattr(cfg, "rope_theta", None) or 10000.0)
        old = getattr(cfg, "rope_scaling", None)
        scaling = dict(old) if old else None
    if scaling is None:
        return theta, None
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
    scaling["rope_type"] = rope_type
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(
            "partial rotary embeddings (partial_rotary_factor != 1) are not implemented"
        )
    scaling.pop("partial_rotary_factor", None)
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = int(cfg.max_position_embeddings)
    return theta, scaling
