"""How a Llama-family model splits across ``N`` tensor-parallel ranks (Megatron style).

Rank ``r`` of ``N`` holds:

* attention heads ``r*H/N .. (r+1)*H/N`` and KV heads ``r*KV/N ..`` (so the
  rows of q_proj / k_proj / v_proj, column-parallel), and its KV heads' cache;
* the matching input columns of ``o_proj`` (row-parallel): each rank's output
  is a partial sum, all-reduced once (the attention half of the block);
* rows ``r*I/N ..`` of gate_proj / up_proj and the matching columns of
  ``down_proj``: one all-reduce for the MLP half;
* vocabulary rows ``r*S .. (r+1)*S`` of the embedding and of the logits
  projection, ``S = ceil(V/N)`` (the last shard zero-padded): a token outside
  the shard embeds to zeros and the all-reduce completes the lookup; each rank
  computes its shard's logits and rank 0 gathers them.

Norm weights (and per-head q/k norms) are replicated. A bias of a row-parallel
linear (``o_proj``) is kept on rank 0 only, so the all-reduce adds it once.
The model implementation itself is unchanged: a rank builds it from
``local_model_config`` (its head counts, widths and vocabulary shard), loads
its slices (``shard_weights``) and gets its all-reduces from
``install_collectives``, which wraps the row-parallel linears and the
embedding. A ``LinearStrategy`` applied afterwards converts the shards'
``nn.Linear``s as usual (the wrappers only add the collective after them).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Collectives(Protocol):
    """What a sharded model needs at run time (engine/parallel/group.py implements it)."""

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place."""
        ...


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``world`` for a model of config ``full``."""

    full: ModelConfig
    rank: int
    world: int

    @property
    def vocab_shard(self) -> int:
        """Rows per vocabulary shard (the last one zero-padded to it)."""
        return -(-self.full.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def local_config(self) -> ModelConfig:
        """The config this rank builds its modules from."""
        return local_model_config(self.full, self.world)


def check_tensor_parallel(mc: ModelConfig, world: int) -> None:
    """Raise ValueError (naming the reason) when ``mc`` cannot split ``world`` ways."""
    flag = f"--tensor-parallel-size {world}"
    if mc.is_moe:
        raise ValueError(f"{flag}: Mixture-of-Experts models are not tensor-parallel here")
    if mc.qk_norm_full:
        raise ValueError(f"{flag}: a q/k norm over the whole projection (OLMoE) cannot split")
    for what, n in (
        ("num_attention_heads", mc.num_attention_heads),
        ("num_key_value_heads", mc.num_key_value_heads),
        ("intermediate_size", mc.intermediate_size),
    ):
        if n % world:
            raise ValueError(f"{flag}: the model's {what} ({n}) is not divisible by {world}")


def local_model_config(mc: ModelConfig, world: int) -> ModelConfig:
    """``mc`` with one rank's heads, MLP width and vocabulary shard (``head_dim`` kept)."""
    check_tensor_parallel(mc, world)
    return replace(
        mc,
        num_attention_heads=mc.num_attention_heads // world,
        num_key_value_heads=mc.num_key_value_heads // world,
        intermediate_size=mc.intermediate_size // world,
        vocab_size=-(-mc.vocab_size // world),
    )


_LAYER_NAME = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.([a-z_]+)\.(weight|bias)$")


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t[start : start + count].contiguous()


def shard_tensor(spec: ShardSpec, name: str, t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of Hugging Face tensor ``name`` (``t`` itself if replicated)."""
    mc, r, n = spec.full, spec.rank, spec.world
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        s = spec.vocab_shard
        part = _rows(t, spec.vocab_start, s)
        if part.shape[0] < s:  # the last shard: zero rows up to the shard size
            pad = part.new_zeros((s - part.shape[0], *part.shape[1:]))
            part = torch.cat([part, pad])
        return part
    m = _LAYER_NAME.match(name)
    if m is None:
        return t  # norms
    _, proj, kind = m.groups()
    hd = mc.head_dim
    q_local = mc.num_attention_heads // n * hd
    kv_local = mc.num_key_value_heads // n * hd
    i_local = mc.intermediate_size // n
    if proj == "q_proj":
        return _rows(t, r * q_local, q_local)
    if proj in ("k_proj", "v_proj"):
        return _rows(t, r * kv_local, kv_local)
    if proj in ("gate_proj", "up_proj"):
        return _rows(t, r * i_local, i_local)
    if proj == "o_proj" and kind == "weight":
        return t[:, r * q_local : (r + 1) * q_local].contiguous()
    if proj == "down_proj" and kind == "weight":
        return t[:, r * i_local : (r + 1) * i_local].contiguous()
    if proj in ("o_proj", "down_proj"):  # a row-parallel bias: added once, by rank 0
        return t if r == 0 else torch.zeros_like(t)
    return t  # per-head q_norm / k_norm: replicated


def shard_weights(
    spec: ShardSpec, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` (Hugging Face names, full tensors) cut to this rank's slices.

    Each full tensor is dropped as soon as its slice is taken, so a rank keeps
    only its shard (the checkpoint is still read whole by every rank)."""
    for name, t in weights:
        yield name, shard_tensor(spec, name, t)


class RowParallel(nn.Module):
    """A row-parallel linear: the rank's partial product, then the all-reduce.

    ``linear`` is a child, so a ``LinearStrategy`` converts it in place."""

    def __init__(self, linear: nn.Module, comm: Collectives) -> None:
        super().__init__()
        self.linear = linear
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x)
        self.comm.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Module):
    """The rank's vocabulary rows ``start .. start + S``; other tokens embed to zeros
    and the all-reduce fills them in. ``weight`` stays the (tied) logits shard."""

    def __init__(self, embedding: nn.Embedding, start: int, comm: Collectives) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.start = start
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        self.comm.all_reduce(out)
        return out


def install_collectives(model: LlamaForCausalLM, spec: ShardSpec, comm: Collectives) -> None:
    """Wrap ``model``'s o_proj / down_proj in ``RowParallel`` and its embedding in
    ``VocabParallelEmbedding``. Call after loading the shards, before a
    ``LinearStrategy`` (which then converts the linears inside the wrappers)."""
    inner = model.model
    embed = inner.embed_tokens
    assert isinstance(embed, nn.Embedding)
    # The attribute keeps its nn.Embedding annotation; the wrapper is a drop-in module.
    inner.embed_tokens = VocabParallelEmbedding(embed, spec.vocab_start, comm)  # type: ignore[assignment]
    for layer in inner.layers:
        assert isinstance(layer, LlamaDecoderLayer) and isinstance(layer.mlp, LlamaMLP)
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallel(attn.o_proj, comm)  # type: ignore[assignment]
        mlp.down_proj = RowParallel(mlp.down_proj, comm)  # type: ignore[assignment]
