"""Model implementations (our own PyTorch code for the paged KV cache)."""

from engine.models.llama import LlamaForCausalLM
from engine.models.registry import get_model_class, supported_architectures

__all__ = ["LlamaForCausalLM", "get_model_class", "supported_architectures"]
