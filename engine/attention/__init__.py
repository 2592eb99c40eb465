"""Attention backends: one signature for "attend over the paged KV cache"."""

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.registry import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
