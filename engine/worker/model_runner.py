"""Runs one step's batch through the model in a single forward pass, then samples.

The runner owns the KV cache tensors. It flattens the scheduled chunks into
one batch (decodes first, as the attention contract asks), builds the
AttentionMetadata, runs the model once, and computes logits only for rows
that sample (the last token of a chunk that reaches the end of its sequence)
or that need prompt logprobs.

With ``moe_capacity_factor`` (Mixture-of-Experts models) it also hands the
model a ``RoutingContext``: the capacity factor and each token's request key
(a stable hash of its request id), so capacity ties never depend on the order
of the batch, and reads back how many of each request's token slots the
capacity rerouted or dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kv.format import KVFormat, PlainKVFormat
from engine.models.moe_routing import RoutingContext, request_key
from engine.models.native_step import NativeDecodeStep
from engine.outputs import PositionLogprobs, TokenLogprob
from engine.request import Request
from engine.sampling.sampler import GrammarMaskFn, Sampler, SamplerOutput
from engine.scheduler import ScheduledRequest
from engine.worker.cuda_graphs import DecodeGraphs, GraphFactory

# Builds the grammar mask for the rows about to be sampled (None: no constraint).
GrammarMaskFactory = Callable[[Sequence[Request]], GrammarMaskFn | None]


@dataclass
class StepResult:
    """Sampled tokens of the requests whose chunk reached their last token."""

    sampled: dict[str, tuple[int, PositionLogprobs | None]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    # MoE capacity: (token slots rerouted, dropped) this step, summed over layers,
    # for the requests that had any.
    moe_capacity: dict[str, tuple[int, int]] = field(default_factory=dict)
    # KV policies: per request, float32 [cache length] attention mass its keys got
    # this step (summed over layers, heads, queries); only when a policy asked.
    attn_mass: dict[str, torch.Tensor] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        moe_capacity_factor: float | None = None,
        kv_format: KVFormat | None = None,
    ) -> None:
        """The KV caches are allocated by ``kv_format`` (engine/kv/format.py;
        default: plain ``kv_dtype`` blocks), which also moves blocks in and out
        of them for the KV tiers."""
        self.model = model
        self.moe_capacity_factor = moe_capacity_factor
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_format = kv_format or PlainKVFormat(
            num_layers, block_size, num_kv_heads, head_dim, kv_dtype
        )
        self.kv_caches = self.kv_format.allocate(num_blocks, device)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        # The fused native decode step (CPU), set by the engine where the model qualifies.
        self.native_step: NativeDecodeStep | None = None

    def enable_decode_graphs(
        self, sizes: list[int], max_model_len: int, graph_factory: GraphFactory
    ) -> None:
        """Capture decode-only forwards at ``sizes`` (see engine/worker/cuda_graphs.py).

        Raises:
            ValueError: the model's attention backend is not graph-safe.
        """
        if not getattr(self.model, "supports_cuda_graphs", True):
            raise ValueError(f"{type(self.model).__name__} does not support CUDA graphs")
        backend = attention_backend_of(self.model)
        if backend is None or not backend.graph_safe:
            name = backend.name if backend is not None else "?"
            raise ValueError(f"attention backend {name!r} cannot be captured in a graph")
        self.graphs = DecodeGraphs(
            lambda ids, pos, meta: self.model(ids, pos, self.kv_caches, meta),
            sizes,
            max_model_len,
            self.block_size,
            self.device,
            graph_factory,
        )

    def prepare(
        self, batch: Sequence[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten ``batch`` (already ordered decodes first) into model inputs."""
        bs = self.block_size
        ids: list[int] = []
        seq_idx: list[int] = []
        starts: list[int] = []
        qlens: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        max_blocks = 1
        for i, s in enumerate(batch):
            toks = s.req.all_token_ids[s.start : s.start + s.num_new_tokens]
            ids.extend(toks)
            seq_idx.extend([i] * s.num_new_tokens)
            # Cache positions: a KV policy's evictions shift them below the token
            # index (kept tokens are packed and re-rotated, engine/kv/policies/).
            cstart = s.start - s.req.num_evicted_tokens
            starts.append(cstart)
            qlens.append(s.num_new_tokens)
            seq_lens.append(cstart + s.num_new_tokens)
            qsl.append(qsl[-1] + s.num_new_tokens)
            max_blocks = max(max_blocks, len(s.req.block_ids))
        table = torch.zeros((len(batch), max_blocks), dtype=torch.int32)
        for i, s in enumerate(batch):
            table[i, : len(s.req.block_ids)] = torch.tensor(s.req.block_ids, dtype=torch.int32)
        seq_idx_t = torch.tensor(seq_idx, dtype=torch.long)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        # position of each flattened token = its sequence's start + offset within the chunk
        offs = torch.arange(len(ids), dtype=torch.long) - qsl_t[:-1].long()[seq_idx_t]
        positions = torch.tensor(starts, dtype=torch.long)[seq_idx_t] + offs
        slots = table[seq_idx_t, positions // bs].long() * bs + positions % bs
        num_decodes = 0
        while num_decodes < len(qlens) and qlens[num_decodes] == 1:
            num_decodes += 1
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=qsl_t.to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=table.to(dev, non_blocking=True),
            slot_mapping=slots.to(dev, non_blocking=True),
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_lens_cpu=qlens,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=qsl,
        )
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        return input_ids, positions.to(dev, non_blocking=True), meta

    @torch.inference_mode()
    def execute(
        self,
        scheduled: Sequence[ScheduledRequest],
        grammar_mask_for: GrammarMaskFactory | None = None,
    ) -> StepResult:
        # Decodes (query length 1) first: the attention contract groups them.
        batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta = self.prepare(batch)
        hidden = None
        routing = self._routing_context(batch, positions, meta)
        if any(s.req.kv_state is not None and s.req.kv_state.policy.needs_mass for s in batch):
            # The per-layer mass pass runs in the model's forward: no graph, no fused step.
            meta.attn_mass = torch.zeros(
                (len(batch), meta.max_seq_len), dtype=torch.float32, device=self.device
            )
        elif self.graphs is not None:
            hidden = self.graphs.run(input_ids, positions, meta)
        elif self.native_step is not None:
            hidden = self.native_step.run(input_ids, positions, meta)
        if hidden is None:
            if routing is None:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta, routing)

        result = StepResult()
        if meta.attn_mass is not None:
            mass = meta.attn_mass.cpu()
            for i, s in enumerate(batch):
                result.attn_mass[s.req.request_id] = mass[i, : meta.seq_lens_cpu[i]]
        if routing is not None:
            result.moe_capacity = _capacity_counts(batch, routing, meta)
        sample_rows: list[int] = []
        sample_reqs: list[Request] = []
        for i, s in enumerate(batch):
            end = meta.query_start_loc_cpu[i + 1]
            if s.completes_sequence:
                sample_rows.append(end - 1)
                sample_reqs.append(s.req)
            plp = s.req.params.prompt_logprobs
            if plp is not None and s.req.wants_prompt_logprobs:
                result.prompt_logprobs[s.req.request_id] = self._prompt_logprobs(
                    hidden, meta.query_start_loc_cpu[i], s, plp
                )
        if sample_rows:
            logits = self.model.compute_logits(
                hidden[torch.tensor(sample_rows, device=hidden.device)]
            )
            mask = grammar_mask_for(sample_reqs) if grammar_mask_for is not None else None
            out: SamplerOutput = self.sampler(logits, sample_reqs, mask)
            for req, tok, lp in zip(sample_reqs, out.token_ids, out.logprobs):
                result.sampled[req.request_id] = (tok, lp)
        return result

    def _routing_context(
        self, batch: Sequence[ScheduledRequest], positions: torch.Tensor, meta: AttentionMetadata
    ) -> RoutingContext | None:
        """The MoE capacity context of this step (None without a capacity factor)."""
        if self.moe_capacity_factor is None:
            return None
        keys = torch.tensor([request_key(s.req.request_id) for s in batch], dtype=torch.int64)
        qlens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
        token_keys = torch.repeat_interleave(keys, qlens).to(positions.device)
        return RoutingContext(positions, token_keys, self.moe_capacity_factor)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, row0: int, s: ScheduledRequest, k: int
    ) -> list[PositionLogprobs]:
        """Logprobs of the prompt tokens this chunk's rows predict that the request lacks.

        Row ``j`` of the chunk (position ``start + j``) predicts prompt token
        ``start + j + 1``; positions below ``req.num_prompt_logprobs`` are
        already reported (a recompute after preemption) and are skipped.
        """
        req = s.req
        first = max(s.start + 1, req.num_prompt_logprobs)  # first prompt position to report
        end = min(s.start + s.num_new_tokens, req.num_prompt_tokens - 1) + 1
        n = end - first
        if n <= 0:
            return []
        r0 = row0 + (first - 1 - s.start)
        logp = torch.log_softmax(self.model.compute_logits(hidden[r0 : r0 + n]).float(), dim=-1)
        targets = torch.tensor(req.prompt_token_ids[first : first + n], device=logp.device)
        chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
        tops_v: list[list[float]] = [[] for _ in range(n)]
        tops_i: list[list[int]] = [[] for _ in range(n)]
        if k:
            v, ix = logp.topk(k, dim=-1)
            tops_v, tops_i = v.tolist(), ix.tolist()
        tl = targets.tolist()
        return [
            PositionLogprobs(
                TokenLogprob(tl[j], chosen[j]),
                [TokenLogprob(a, b) for a, b in zip(tops_i[j], tops_v[j])],
            )
            for j in range(n)
        ]


def _capacity_counts(
    batch: Sequence[ScheduledRequest], routing: RoutingContext, meta: AttentionMetadata
) -> dict[str, tuple[int, int]]:
    """Per request: token slots the capacity rerouted / dropped this step (nonzero only)."""
    if routing.token_rerouted is None or routing.token_dropped is None:
        return {}
    per_token = torch.stack([routing.token_rerouted, routing.token_dropped], dim=1)
    bounds = torch.tensor(meta.query_start_loc_cpu, dtype=torch.int64)
    sums = torch.cumsum(torch.cat([per_token.new_zeros(1, 2), per_token.cpu()]), dim=0)
    per_seq = (sums[bounds[1:]] - sums[bounds[:-1]]).tolist()
    return {s.req.request_id: (int(r), int(d)) for s, (r, d) in zip(batch, per_seq) if r or d}


def attention_backend_of(model: Any) -> AttentionBackend | None:
    """The backend the model's attention layers share (None: none found)."""
    for m in model.modules():
        backend = getattr(m, "attn_backend", None)
        if isinstance(backend, AttentionBackend):
            return backend
    return None
