"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

They are Llama-family decoders (engine/models/llama.py: same attention over the
paged KV cache, norms, RoPE, residual stream, loader and CPU linears) whose MLP
is a sparse block: a router picks ``k`` of ``E`` SwiGLU experts per token
(engine/models/moe_routing.py, with the optional per-step capacity) and the
token's output is the routing-weighted sum of those experts' outputs.

Where the four differ, following transformers 5 (``models/{mixtral,
qwen2_moe, qwen3_moe, olmoe}/modeling_*.py``):

* Router: all compute ``softmax(logits in float32)`` over every expert, then
  ``topk`` (softmax before top-k). Mixtral always divides the top-k by their
  sum and keeps the weights in float32 when scaling the experts' outputs;
  Qwen2-MoE, Qwen3-MoE and OLMoE divide only with ``norm_topk_prob`` (Qwen3-MoE
  checkpoints set it, Qwen2-MoE and OLMoE do not) and cast the weights to the
  model dtype first. The router itself is a bias-free linear in the model dtype.
* Shared expert: only Qwen2-MoE, an always-on SwiGLU MLP of
  ``shared_expert_intermediate_size`` scaled by ``sigmoid(x @ w_gate)`` (one
  output) and added to the routed sum. It has no capacity: a token whose
  routed slots were all dropped still gets it.
* Dense layers: Qwen-MoE layers in ``mlp_only_layers`` (or off the
  ``decoder_sparse_step`` grid) keep a dense MLP of ``intermediate_size``.
* Attention: Mixtral is Mistral's (no biases); Qwen2-MoE has q/k/v biases;
  Qwen3-MoE per-head q/k RMSNorm (as Qwen3); OLMoE RMSNorm over the whole q
  and k projections and an optional ``clip_qkv``.

Checkpoint names: Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2`` (gate,
up, down) and the others' ``mlp.experts.N.{gate,up,down}_proj`` are stacked
into ``[E, 2I, H]`` (gate rows, then up rows) and ``[E, H, I]`` parameters
at load; stacked forms (transformers 5's ``experts.gate_up_proj`` /
``experts.down_proj``, GGUF's ``ffn_*_exps`` mapped by the loader to
``experts.{gate,up,down}_proj.weight``) are split per expert first.

Experts run, on CUDA, as the Triton fused-MoE kernels (kernels/fused_moe.py);
elsewhere as the grouped path: token slots sorted by expert once, then one
matmul pair per expert that has tokens (a loop over experts, never over
tokens), accumulated in ascending expert order as transformers does. The
expert matmuls go through ``MoeExperts.expert_linear``, which the CPU linear
strategies (``--cpu-linear``: oneDNN-packed, int8, q4_1) replace per expert
with the same modules dense layers use (``use_expert_linears``, which
``LinearStrategy.apply`` calls). Routers stay unquantized float
linears (llama.cpp also keeps ``ffn_gate_inp`` unquantized: top-k choices
are sensitive to it).

Each sparse block counts its routed, rerouted and dropped token slots in
device buffers (no host sync per step); ``routing_stats`` snapshots them.
MoE models do not take CUDA graphs (``supports_cuda_graphs``): the grouped
path syncs on the per-expert counts and capacity routing iterates.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend
from engine.models.config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine.models.moe_routing import RouterSpec, Routing, RoutingContext, route
from engine.models.ops import ModelOps, TorchModelOps
from engine.stats import MoeLayerStats

# Builds the module that computes ``x @ weight.T`` (no bias) for one expert
# matrix: the hook through which a CPU linear strategy takes the experts.
ExpertLinearFactory = Callable[[torch.Tensor], nn.Module]


class PlainLinear(nn.Module):
    """A bias-free linear that the CPU linear strategies leave alone (routers, gates)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoeExperts(nn.Module):
    """``E`` SwiGLU experts: ``gate_up`` ``[E, 2I, H]`` and ``down`` ``[E, H, I]``.

    ``forward(x, routing)`` returns ``sum_s weight[t, s] * expert_{id[t, s]}(x[t])``
    (dropped slots, id ``-1``, add nothing). After ``use_linears`` each expert
    matrix is a module built by the factory; the stacked parameters stay only
    when those modules share their storage (``keep_stacked``).

    CPU: with the stacked weights at hand and the slots spread over the experts
    (``E * max_rows <= 2 * slots``: decode of many streams, long prefills) one
    padded ``bmm`` per matrix runs every expert at once: the same GEMM per
    expert as ``F.linear`` (equal up to the BLAS kernel chosen for the row
    count) in two calls instead of ``2E``, each of which would pay an OpenMP
    wake-up; otherwise (a few streams, a quantized strategy) a loop over the
    experts that have tokens.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate = intermediate
        self.gate_up: nn.Parameter | None = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate, hidden)
        )
        self.down: nn.Parameter | None = nn.Parameter(
            torch.empty(num_experts, hidden, intermediate)
        )
        # [gate_up_0, down_0, gate_up_1, down_1, ...] once a strategy took over.
        self.linears: nn.ModuleList | None = None
        self.ops: ModelOps = TorchModelOps()  # shared strategy, set by set_ops

    def use_linears(self, make: ExpertLinearFactory, keep_stacked: bool = False) -> int:
        """Hand every expert matrix to ``make`` (a CPU linear strategy); returns the count.

        ``keep_stacked``: the modules keep views of the stacked weights (oneDNN
        packing does), so the padded-``bmm`` path stays available at no memory cost.
        """
        if self.linears is not None or self.gate_up is None or self.down is None:
            raise RuntimeError("the experts' linears were already replaced")
        mods: list[nn.Module] = []
        for e in range(self.num_experts):
            mods.append(make(self.gate_up.data[e]))
            mods.append(make(self.down.data[e]))
        self.linears = nn.ModuleList(mods)
        if not keep_stacked:
            self.gate_up = None
            self.down = None
        return len(mods)

    def expert_linear(self, expert: int, which: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for expert ``expert``'s gate_up (``which`` 0) or down (1) matrix."""
        if self.linears is not None:
            out: torch.Tensor = self.linears[2 * expert + which](x)
            return out
        w = self.gate_up if which == 0 else self.down
        assert w is not None
        return F.linear(x, w[expert])

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if x.device.type == "cuda" and self.linears is None:
            from kernels.fused_moe import fused_moe

            assert self.gate_up is not None and self.down is not None
            return fused_moe(x, self.gate_up, self.down, routing.expert_ids, routing.weights)
        return self._grouped(x, routing)

    def _grouped(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Slots sorted by expert once; one matmul pair per expert with tokens."""
        ids = routing.expert_ids
        k = ids.shape[1]
        e = self.num_experts
        flat = ids.reshape(-1)
        mapped = torch.where(flat >= 0, flat, e)  # dropped slots sort last
        order = torch.argsort(mapped, stable=True)
        counts = torch.bincount(mapped, minlength=e + 1).tolist()
        tokens = order // k
        weights = routing.weights.reshape(-1)[order]
        out = torch.zeros_like(x)
        slots = sum(counts[:e])
        if slots == 0:
            return out
        if self.gate_up is not None and self.down is not None and e * max(counts[:e]) <= 2 * slots:
            return self._padded_bmm(x, tokens, weights, counts[:e], out)
        start = 0
        for expert in range(e):
            n = counts[expert]
            if n == 0:
                continue
            rows = tokens[start : start + n]
            h = self.ops.silu_mul(self.expert_linear(expert, 0, x[rows]))
            h = self.expert_linear(expert, 1, h) * weights[start : start + n, None]
            # A token meets each expert at most once, so ``rows`` are distinct and this
            # is ``out[rows] += h`` (index_add_'s arithmetic); index_put_ stays serial
            # where index_add_ opens an OpenMP region (a wake-up per expert per layer).
            out.index_put_((rows,), h.to(out.dtype), accumulate=True)
            start += n
        return out

    def _padded_bmm(
        self,
        x: torch.Tensor,
        tokens: torch.Tensor,
        weights: torch.Tensor,
        counts: list[int],
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Every expert in one ``bmm`` per matrix over ``[E, max_rows]`` padded row blocks.

        ``tokens``/``weights`` are the slots sorted by expert; padding rows repeat
        sorted row 0 and are computed but never scattered. Each token's
        contributions are summed in ascending expert order, ``((0 + c_1) + c_2) +
        ...`` as the loop does: one accumulating scatter would add duplicates in
        an unspecified order (torch's CPU ``index_put_`` uses atomic adds on
        large float inputs), which a token with ``k > 2`` experts would see.
        """
        assert self.gate_up is not None and self.down is not None
        e = self.num_experts
        m = max(counts)
        n = torch.tensor(counts, dtype=torch.int64, device=x.device)
        starts = torch.cumsum(n, 0) - n
        j = torch.arange(m, device=x.device)
        valid = j[None, :] < n[:, None]  # [E, m]
        pos = torch.where(valid, starts[:, None] + j[None, :], 0)
        rows = tokens[pos]
        h = torch.bmm(x[rows], self.gate_up.transpose(1, 2))  # [E, m, 2I]
        h = self.ops.silu_mul(h.view(e * m, -1)).view(e, m, -1)
        y = torch.bmm(h, self.down.transpose(1, 2)) * weights[pos][..., None]
        # Row-major over [E, m]: the slots in ascending expert order. Give each its
        # rank among its token's slots (stable sort by token), place it in a
        # [T, k, H] buffer at (token, rank), and fold the ranks left to right.
        tok = rows[valid]
        by_tok = torch.argsort(tok, stable=True)
        tok_sorted = tok[by_tok]
        per_tok = torch.bincount(tok_sorted, minlength=x.shape[0])
        rank = (
            torch.arange(tok.numel(), device=x.device)
            - (torch.cumsum(per_tok, 0) - per_tok)[tok_sorted]
        )
        k = int(rank.max()) + 1
        buf = x.new_zeros((x.shape[0], k, x.shape[1]))
        buf[tok_sorted, rank] = y[valid][by_tok].to(out.dtype)
        for r in range(k):  # a loop over slot ranks (at most top-k), not over tokens
            out = out + buf[:, r]
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's gated shared expert) of one layer.

    Buffers ``expert_tokens`` ``[E]``, ``rerouted_tokens`` and ``dropped_tokens``
    (``[1]``, int64) count token slots since ``reset_counters``.
    """

    expert_tokens: torch.Tensor
    rerouted_tokens: torch.Tensor
    dropped_tokens: torch.Tensor

    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.spec = RouterSpec(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
            weights_fp32=config.moe_weights_fp32,
        )
        self.gate = PlainLinear(config.hidden_size, config.num_experts)
        self.experts = MoeExperts(
            config.num_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: PlainLinear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = PlainLinear(config.hidden_size, 1)
        self.register_buffer(
            "expert_tokens", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False
        )
        self.register_buffer("rerouted_tokens", torch.zeros(1, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped_tokens", torch.zeros(1, dtype=torch.int64), persistent=False)

    def reset_counters(self) -> None:
        self.expert_tokens.zero_()
        self.rerouted_tokens.zero_()
        self.dropped_tokens.zero_()

    def forward(self, x: torch.Tensor, context: RoutingContext | None) -> torch.Tensor:
        routing = route(self.gate(x), self.spec, context)
        out: torch.Tensor = self.experts(x, routing)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        self._count(routing, context)
        return out

    def _count(self, routing: Routing, context: RoutingContext | None) -> None:
        ids = routing.expert_ids.reshape(-1)
        self.expert_tokens.index_add_(0, ids.clamp(min=0), (ids >= 0).to(torch.int64))
        if routing.rerouted is not None and routing.dropped is not None:
            self.rerouted_tokens += routing.rerouted.sum()
            self.dropped_tokens += routing.dropped.sum()
            if context is not None:
                context.add_token_counts(routing.rerouted, routing.dropped)


class MoeDecoderLayer(LlamaDecoderLayer):
    """A decoder layer whose MLP is a ``SparseMoeBlock`` (it receives the routing context)."""

    def feed_forward(self, h: torch.Tensor, routing: RoutingContext | None) -> torch.Tensor:
        out: torch.Tensor = self.mlp(h, routing)
        return out


# HF expert names (after ``_normalize_name``) and the stacked forms we split.
_EXPERT_NAME = re.compile(r"^(.*\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_NAME = re.compile(
    r"^(.*\.experts\.)(gate_proj\.weight|up_proj\.weight|down_proj\.weight|gate_up_proj|down_proj)$"
)
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")
_MIXTRAL_PARTS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


def _normalize_name(name: str) -> str:
    """Mixtral's ``block_sparse_moe`` / ``w1 w2 w3`` names to the ``mlp`` / ``*_proj`` ones."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m[1]}.{_MIXTRAL_PARTS[m[2]]}.weight", name)


def _split_stacked(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors of a stacked one (``[E, ...]``); other tensors pass unchanged."""
    m = _STACKED_NAME.match(name)
    if m is None:
        yield name, tensor
        return
    prefix, part = m.groups()
    if part == "gate_up_proj":  # transformers 5: [E, 2I, H], gate rows first
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{prefix}{e}.gate_proj.weight", tensor[e, :half]
            yield f"{prefix}{e}.up_proj.weight", tensor[e, half:]
        return
    proj = part.removesuffix(".weight")
    for e in range(tensor.shape[0]):
        yield f"{prefix}{e}.{proj}.weight", tensor[e]


class MoeForCausalLM(LlamaForCausalLM):
    """Causal LM over MoE decoder layers (the module docstring lists the architectures)."""

    supports_cuda_graphs: ClassVar[bool] = False

    def make_layer(self, index: int, attn_backend: AttentionBackend) -> LlamaDecoderLayer:
        cfg = self.config
        if not cfg.is_moe or index in cfg.dense_layers:
            return LlamaDecoderLayer(cfg, attn_backend)
        return MoeDecoderLayer(cfg, attn_backend, SparseMoeBlock(cfg, index))

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The sparse blocks, in layer order. Found once: the engine reads the
        routing counters every step, and a walk over every module (thousands once
        expert linears are swapped in) is not free; the blocks themselves are
        never replaced after construction."""
        blocks: list[SparseMoeBlock] | None = getattr(self, "_moe_blocks", None)
        if not blocks:  # (empty only while the layers are being built)
            blocks = [m for m in self.modules() if isinstance(m, SparseMoeBlock)]
            self._moe_blocks = blocks  # a plain list: not registered as submodules
        return blocks

    def initialize_buffers(self) -> None:
        super().initialize_buffers()
        for block in self.moe_blocks():
            block.reset_counters()

    def routing_stats(self) -> tuple[MoeLayerStats, ...]:
        """Per-layer routing counters since start (one host copy of all of them)."""
        blocks = self.moe_blocks()
        if not blocks:
            return ()
        experts = torch.stack([b.expert_tokens for b in blocks]).tolist()
        rerouted = torch.cat([b.rerouted_tokens for b in blocks]).tolist()
        dropped = torch.cat([b.dropped_tokens for b in blocks]).tolist()
        return tuple(
            MoeLayerStats(b.layer_index, tuple(ex), r, d)
            for b, ex, r, d in zip(blocks, experts, rerouted, dropped)
        )

    # ---- CPU linear strategies (engine/models/linear.py) also take every expert matrix.
    def use_expert_linears(
        self, make: Callable[[torch.Tensor], nn.Module], keep_stacked: bool
    ) -> int:
        return sum(b.experts.use_linears(make, keep_stacked) for b in self.moe_blocks())

    # ---- weights
    def expected_weight_names(self) -> set[str]:
        names = {
            n
            for n in super().expected_weight_names()
            if not n.endswith((".experts.gate_up", ".experts.down"))
        }
        for block in self.moe_blocks():
            prefix = f"model.layers.{block.layer_index}.mlp.experts."
            for e in range(block.experts.num_experts):
                names.update(
                    f"{prefix}{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
                )
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """As ``LlamaForCausalLM.load_weights``, after normalising Mixtral's names and
        splitting stacked expert tensors (see the module docstring)."""

        def expanded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = _normalize_name(name)
                if name.endswith(".shared_expert_gate.weight") and tensor.dim() == 1:
                    tensor = tensor[None, :]  # GGUF stores the gate as a vector
                yield from _split_stacked(name, tensor)

        super().load_weights(expanded())

    def weight_target(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
        m = _EXPERT_NAME.match(name)
        if m is None:
            return super().weight_target(name, params)
        prefix, index, part = m.groups()
        e = int(index)
        if part == "down_proj":
            return params[f"{prefix}down"][e]
        gate_up = params[f"{prefix}gate_up"][e]
        half = gate_up.shape[0] // 2
        return gate_up[:half] if part == "gate_proj" else gate_up[half:]
