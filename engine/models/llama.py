"""Llama-family decoder over the paged KV cache.

One implementation covers Llama 2/3 (with llama3 RoPE scaling), SmolLM/SmolLM2,
Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm before RoPE).
The Mixture-of-Experts models (engine/models/moe.py) reuse its attention,
norms, RoPE and decoder layer, swapping the MLP for a sparse block through
``LlamaForCausalLM.make_layer`` (OLMoE's whole-projection q/k norm and
``clip_qkv`` live in ``LlamaAttention``, off for every dense family).

The input is a flattened batch (``[T]`` token ids with their positions, see
``engine/attention/base.py``); there is no batch dimension and no padding.
q/k/v and gate/up are fused into single linears: on CPU one larger matmul per
step is markedly cheaper than several small ones. Weights are loaded from
Hugging Face names (``load_weights``), which are mapped onto the fused
parameters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.models.config import ModelConfig
from engine.models.moe_routing import RoutingContext
from engine.models.ops import ModelOps, RopeInputs, TorchModelOps


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back, then scaled (Hugging Face's order).

    ``forward(x)`` is the plain torch version (per-head q/k norms); decoder
    layers call ``norm(x, residual)``, which goes through the model's
    ``ModelOps`` (fused residual add, native on CPU).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.dim = dim
        self.ops: ModelOps = TorchModelOps()  # shared strategy, set by set_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (self.dim,), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def norm(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``; see engine/models/ops.py."""
        return self.ops.add_rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32) with the config's scaling."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by ``factor``, short ones kept, the band in
        # between interpolated smoothly (Llama 3.1's recipe).
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}")


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin for every position up to ``max_position_embeddings``.

    ``cos_sin_cache`` is ``[max_positions, head_dim]`` float32: cos in the first
    half, sin in the second. It is a non-persistent buffer, so after building on
    the meta device and ``to_empty`` it must be refilled with
    ``initialize_cache``.
    """

    cos_sin_cache: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.initialize_cache()

    def initialize_cache(self) -> None:
        """(Re)compute the cache on the device of the buffer currently held."""
        device = self.cos_sin_cache.device
        if device.type == "meta":
            self.cos_sin_cache = torch.empty(
                self.config.max_position_embeddings, self.config.head_dim, device=device
            )
            return
        inv_freq = rope_inv_freq(self.config)
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32, device="cpu")
        # float32 outer product, as transformers does, so positions agree bit for bit.
        freqs = torch.outer(t, inv_freq)
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.cos_sin_cache = cache.to(device=device, dtype=torch.float32)

    def inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """One forward's rotary inputs (shared by every layer)."""
        return RopeInputs(positions, self.cos_sin_cache, dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        # OLMoE normalises the whole q / k projection, the Qwen3 family each head.
        self.qk_norm_full = config.qk_norm_full
        self.clip_qkv = config.clip_qkv
        if config.qk_norm:
            q_dim, k_dim = (
                (self.q_size, self.kv_size) if self.qk_norm_full else (self.head_dim, self.head_dim)
            )
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps)
        # Shared by every layer; not submodules (they hold no parameters).
        self.attn_backend = attn_backend
        self.ops: ModelOps = TorchModelOps()
        # Low-rank keys (engine/kv/low_rank.py): the query and key projections,
        # each [num_kv_heads, head_dim, rank], and the key mean [num_kv_heads,
        # head_dim], in the activation dtype; q and k are projected after RoPE,
        # so the backend attends over rank-wide keys and head_dim-wide values.
        self.key_basis: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Views, no copies: q and k stay adjacent in each row, which lets the
        # native ops rotate both in place in one call.
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
            t, self.num_kv_heads, self.head_dim
        )
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            if self.qk_norm_full:
                q = self.q_norm(q.reshape(t, self.q_size)).view(t, self.num_heads, self.head_dim)
                k = self.k_norm(k.reshape(t, self.kv_size)).view(
                    t, self.num_kv_heads, self.head_dim
                )
            else:
                q = self.q_norm(q)
                k = self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q, k = self.ops.rope(q, k, rope)
        if self.key_basis is not None:
            q, k = self.project_keys(q, k, self.key_basis)
        o = self.attn_backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        if meta.attn_mass is not None:  # a KV policy ranks keys by attention (issue 17)
            self.attn_backend.accumulate_attention_mass(q, kv_cache[0], meta, self.scale)
        out: torch.Tensor = self.o_proj(o.reshape(t, self.q_size))
        return out

    def project_keys(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        basis: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, H, D]`` and ``k`` ``[T, Hkv, D]`` through the query and key
        projections ``[Hkv, D, r]``: ``[T, H, r]`` and ``[T, Hkv, r]`` (each query
        head through its KV head's query projection; the key mean is taken off
        first, which moves all of a query's scores alike)."""
        q_proj, k_proj, k_mean = basis
        t, r = q.shape[0], k_proj.shape[2]
        g = self.num_heads // self.num_kv_heads
        qg = q.reshape(t, self.num_kv_heads, g, self.head_dim).transpose(0, 1)
        qr = torch.matmul(qg.reshape(self.num_kv_heads, t * g, self.head_dim), q_proj)
        kr = torch.matmul((k - k_mean).transpose(0, 1), k_proj)  # [Hkv, T, r]
        q_out = qr.view(self.num_kv_heads, t, g, r).transpose(0, 1).reshape(t, self.num_heads, r)
        return q_out, kr.transpose(0, 1).contiguous()


class LlamaMLP(nn.Module):
    """SwiGLU MLP of ``intermediate_size`` (default: the config's; a Qwen2-MoE shared expert's)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.ops: ModelOps = TorchModelOps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, pre-norm. ``mlp`` replaces the dense MLP (an MoE block)."""

    def __init__(
        self, config: ModelConfig, attn_backend: AttentionBackend, mlp: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        routing: RoutingContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual-stream form: returns ``(mlp_out, residual)``; the layer's output
        is their sum, which the next norm computes (fused with the add).
        ``routing`` reaches MoE blocks only (see ``feed_forward``)."""
        h, residual = self.input_layernorm.norm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm.norm(h, residual)
        return self.feed_forward(h, routing), residual

    def feed_forward(self, h: torch.Tensor, routing: RoutingContext | None) -> torch.Tensor:
        """The MLP on the normed hidden states (dense layers ignore ``routing``)."""
        out: torch.Tensor = self.mlp(h)
        return out


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        make_layer: Callable[[int], LlamaDecoderLayer] | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if make_layer is None:
            make_layer = lambda _i: LlamaDecoderLayer(config, attn_backend)  # noqa: E731
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


# HF per-projection names -> (our fused parameter, shard index within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_NAME = re.compile(r"^(.*\.)(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class LlamaForCausalLM(nn.Module):
    """Causal LM head over ``LlamaModel``.

    With tied embeddings there is no ``lm_head`` module: logits use
    ``model.embed_tokens.weight`` directly, so the tie survives any
    device/dtype move.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attn_backend, lambda i: self.make_layer(i, attn_backend))
        self.lm_head: nn.Linear | None = None
        # The module computing logits, set by a LinearStrategy (None: F.linear).
        self.logits_linear: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def make_layer(self, index: int, attn_backend: AttentionBackend) -> LlamaDecoderLayer:
        """Decoder layer ``index`` (subclasses give some layers another MLP)."""
        return LlamaDecoderLayer(self.config, attn_backend)

    def initialize_buffers(self) -> None:
        """Recompute non-persistent buffers (RoPE cache); call after ``to_empty``."""
        self.model.rotary_emb.initialize_cache()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        routing: RoutingContext | None = None,
    ) -> torch.Tensor:
        """Run the flattened batch; returns final-normed hidden states ``[T, hidden]``.

        ``kv_caches[i]`` is layer ``i``'s ``(k_cache, v_cache)``; the new tokens'
        keys/values are written into the slots ``meta.slot_mapping`` names.
        ``routing`` (MoE models: expert capacity and tie-break keys; see
        engine/models/moe_routing.py) is passed to every layer.
        """
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.model.layers)} layers")
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb.inputs(positions, x.dtype)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta, routing)
        return self.model.norm.norm(x, residual)[0]

    def set_key_basis(
        self, projections: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Project queries and keys through ``projections[i]`` (query and key
        projections, each ``[Hkv, D, r]``, and the key mean ``[Hkv, D]``) in layer
        ``i`` from now on; None: full-rank keys (engine/kv/low_rank.py)."""
        layers = self.model.layers
        if projections is not None and len(projections) != len(layers):
            raise ValueError(f"got {len(projections)} key bases for {len(layers)} layers")
        dtype = self.model.embed_tokens.weight.dtype
        device = self.model.embed_tokens.weight.device
        for i, layer in enumerate(layers):
            assert isinstance(layer, LlamaDecoderLayer)
            layer.self_attn.key_basis = (
                None
                if projections is None
                else (
                    projections[i][0].to(device=device, dtype=dtype),
                    projections[i][1].to(device=device, dtype=dtype),
                    projections[i][2].to(device=device, dtype=dtype),
                )
            )

    def set_ops(self, ops: ModelOps) -> None:
        """Use ``ops`` (engine/models/ops.py) in every layer; the default is TorchModelOps."""
        for m in self.modules():
            if hasattr(m, "ops"):
                setattr(m, "ops", ops)  # noqa: B010 (plain attribute, not a submodule)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` in float32 for hidden states ``[N, hidden]``."""
        if self.logits_linear is not None:
            logits: torch.Tensor = self.logits_linear(hidden).float()
            return logits
        return F.linear(hidden, self.logits_weight()).float()

    def linear_root(self) -> nn.Module:
        r"""The modules whose ``nn.Linear``\ s a LinearStrategy converts (engine/models/linear.py)."""
        return self.model

    def use_expert_linears(
        self, make: Callable[[torch.Tensor], nn.Module], keep_stacked: bool
    ) -> int:
        """Hand every expert matrix to ``make`` (a LinearStrategy); dense models have none."""
        return 0

    def logits_weight(self) -> torch.Tensor:
        """The logits projection's weight ``[vocab, hidden]``: ``lm_head`` or the tied embedding."""
        return self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face tensor names ``load_weights`` requires."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            m = re.match(r"^(.*\.)(qkv_proj|gate_up_proj)\.(weight|bias)$", name)
            if m is None:
                names.add(name)
                continue
            prefix, fused, kind = m.groups()
            parts = (
                ("q_proj", "k_proj", "v_proj") if fused == "qkv_proj" else ("gate_proj", "up_proj")
            )
            names.update(f"{prefix}{p}.{kind}" for p in parts)
        return names

    def _shard_rows(self, fused: torch.Tensor, fused_name: str, shard: int) -> tuple[int, int]:
        """(start row, row count) of shard ``shard`` inside fused parameter ``fused``."""
        cfg = self.config
        if fused_name == "qkv_proj":
            q = cfg.num_attention_heads * cfg.head_dim
            kv = cfg.num_key_value_heads * cfg.head_dim
            return ((0, q), (q, kv), (q + kv, kv))[shard]
        i = fused.shape[0] // 2  # gate_up: a dense MLP's or a shared expert's width
        return ((0, i), (i, i))[shard]

    def weight_target(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
        """The (view of the) parameter that Hugging Face tensor ``name`` is copied into."""
        m = _FUSED_NAME.match(name)
        if m is None:
            return params[name]
        prefix, part, kind = m.groups()
        fused_name, shard = _FUSED[part]
        fused = params[f"{prefix}{fused_name}.{kind}"]
        start, rows = self._shard_rows(fused, fused_name, shard)
        return fused[start : start + rows]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (fused) parameters.

        Tensors are cast to each parameter's dtype and device. Names that are
        not ours are an error, except ``*.rotary_emb.inv_freq`` (recomputed
        from the config) and ``lm_head.weight`` when embeddings are tied (it
        is, by definition, the embedding matrix).

        Raises:
            ValueError: an unexpected name, a shape mismatch, a tensor given
                twice, or tensors missing once ``weights`` is exhausted.
        """
        params = dict(self.named_parameters())
        expected = self.expected_weight_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name not in expected:
                raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
            if name in loaded:
                raise ValueError(f"weight {name!r} given twice")
            target = self.weight_target(name, params)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(name)
        missing = expected - loaded
        if missing:
            shown = ", ".join(sorted(missing)[:8])
            more = f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""
            raise ValueError(f"missing {len(missing)} weights: {shown}{more}")
