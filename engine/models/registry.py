"""Architecture name -> model implementation.

Keys are Hugging Face ``config.architectures[0]`` names plus GGUF
``general.architecture`` names (``llama``, ``qwen2``, ``qwen3``, ``qwen2moe``,
``qwen3moe``, ``olmoe``; a ``llama`` GGUF with experts is Mixtral, which the
loader names ``MixtralForCausalLM``).
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeForCausalLM

# Dense families are LlamaForCausalLM; the MoE ones its subclass MoeForCausalLM
# (same forward/compute_logits/load_weights contract).
ModelClass = type[LlamaForCausalLM]

_MODELS: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "OlmoeForCausalLM": MoeForCausalLM,
    "qwen2moe": MoeForCausalLM,
    "qwen3moe": MoeForCausalLM,
    "olmoe": MoeForCausalLM,
}


def supported_architectures() -> list[str]:
    """Every architecture name ``get_model_class`` accepts, sorted."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> ModelClass:
    """The implementation class for ``architecture``.

    Raises:
        ValueError: the architecture is not supported (the message lists those that are).
    """
    cls = _MODELS.get(architecture)
    if cls is None:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; supported: "
            f"{', '.join(supported_architectures())}"
        )
    return cls
