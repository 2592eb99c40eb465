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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kv.format import KVFormat, PlainKVFormat
from engine.models.moe_routing import RoutingContext, request_key
from engine.models.native_step import NativeDecodeStep
from engine.outputs import PositionLogprobs, TokenLogprob
from engine.sampling.rejection import VerifyRequest, verify
from engine.sampling.sampler import GrammarMaskFn, Sampler, SamplerOutput, SampleRow
from engine.scheduler import ScheduledRequest
from engine.worker.cuda_graphs import DecodeGraphs, GraphFactory

# Builds the grammar mask for the rows about to be sampled (None: no constraint).
GrammarMaskFactory = Callable[[Sequence[SampleRow]], GrammarMaskFn | None]


@dataclass
class SampledTokens:
    """What one request's chunk produced: ``num_accepted`` of its ``num_drafts``
    drafts, then one sampled token (without drafts: just the sampled token)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    num_drafts: int = 0
    num_accepted: int = 0


@dataclass
class StepResult:
    """Sampled tokens of the requests whose chunk reached their last token."""

    sampled: dict[str, SampledTokens] = field(default_factory=dict)
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
        backend = attention_backend_of(model)
        self.split_verification = backend is not None and backend.decode_rows_for_verification

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

    def prepare(self, batch: Sequence[ScheduledRequest]) -> StepInputs:
        """Flatten ``batch`` (already ordered decode rows first) into model inputs."""
        return build_inputs(batch, self.block_size, self.device, self.split_verification)

    @torch.inference_mode()
    def execute(
        self,
        scheduled: Sequence[ScheduledRequest],
        grammar_mask_for: GrammarMaskFactory | None = None,
        draft_probs: Mapping[str, torch.Tensor | None] | None = None,
    ) -> StepResult:
        """Run the step; sample (or verify drafts) for every chunk that reaches its end.

        ``draft_probs[request_id]``: the distribution each of the request's
        drafts was drawn from (``[k, vocab]``), or None for deterministic drafts.
        """
        # Decodes (query length 1) first: the attention contract groups them.
        # Verification chunks (1 + k tokens) join them as rows where the backend
        # prefers it (``as_decode_rows``), else go with the prefill/extend chunks.
        split = self.split_verification
        batch = sorted(scheduled, key=lambda s: not as_decode_rows(s, split))
        inputs = self.prepare(batch)
        input_ids, positions, meta = inputs.input_ids, inputs.positions, inputs.meta
        hidden = None
        routing = self._routing_context(batch, positions, inputs.chunk_starts)
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
            result.moe_capacity = _capacity_counts(batch, routing, inputs.chunk_starts)
        sample_rows: list[int] = []
        items: list[VerifyRequest] = []
        for i, s in enumerate(batch):
            end = inputs.chunk_starts[i + 1]
            if s.completes_sequence:
                n_rows = 1 + s.num_draft_tokens
                sample_rows.extend(range(end - n_rows, end))
                probs = draft_probs.get(s.req.request_id) if draft_probs else None
                items.append(VerifyRequest(s.req, list(s.draft_token_ids), probs))
            plp = s.req.params.prompt_logprobs
            if plp is not None and s.req.wants_prompt_logprobs:
                result.prompt_logprobs[s.req.request_id] = self._prompt_logprobs(
                    hidden, inputs.chunk_starts[i], s, plp
                )
        if not sample_rows:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
        if all(not it.draft_token_ids for it in items):
            reqs = [it.req for it in items]
            mask = (
                grammar_mask_for([SampleRow(r) for r in reqs])
                if grammar_mask_for is not None
                else None
            )
            out: SamplerOutput = self.sampler(logits, reqs, mask)
            for req, tok, lp in zip(reqs, out.token_ids, out.logprobs):
                result.sampled[req.request_id] = SampledTokens([tok], [lp])
            return result
        for it, v in zip(items, verify(logits, items, grammar_mask_for)):
            result.sampled[it.req.request_id] = SampledTokens(
                v.token_ids, v.logprobs, len(it.draft_token_ids), v.num_accepted
            )
        return result

    def _routing_context(
        self, batch: Sequence[ScheduledRequest], positions: torch.Tensor, chunk_starts: list[int]
    ) -> RoutingContext | None:
        """The MoE capacity context of this step (None without a capacity factor).
        Keyed per batch entry (``chunk_starts``), not per attention sequence: a
        verification chunk given as rows is still one request."""
        if self.moe_capacity_factor is None:
            return None
        keys = torch.tensor([request_key(s.req.request_id) for s in batch], dtype=torch.int64)
        qlens = torch.diff(torch.tensor(chunk_starts, dtype=torch.int64))
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
    batch: Sequence[ScheduledRequest], routing: RoutingContext, chunk_starts: list[int]
) -> dict[str, tuple[int, int]]:
    """Per request: token slots the capacity rerouted / dropped this step (nonzero only)."""
    if routing.token_rerouted is None or routing.token_dropped is None:
        return {}
    per_token = torch.stack([routing.token_rerouted, routing.token_dropped], dim=1)
    bounds = torch.tensor(chunk_starts, dtype=torch.int64)
    sums = torch.cumsum(torch.cat([per_token.new_zeros(1, 2), per_token.cpu()]), dim=0)
    per_seq = (sums[bounds[1:]] - sums[bounds[:-1]]).tolist()
    return {s.req.request_id: (int(r), int(d)) for s, (r, d) in zip(batch, per_seq) if r or d}


@dataclass
class StepInputs:
    """One step's flattened model inputs.

    ``chunk_starts[i]`` is the first flattened token of batch entry ``i``
    (``chunk_starts[-1]``: the token count): with verification chunks given
    as rows, an entry may span several attention sequences.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    chunk_starts: list[int]


def as_decode_rows(s: ScheduledRequest, split_verification: bool) -> bool:
    """Whether ``s`` attends as query-length-1 rows: a decode, or (when the backend
    prefers it) a verification chunk, whose ``1 + k`` tokens then attend as ``1 + k``
    sequences over the same block table, of lengths ``start + 1 ... start + 1 + k``.
    That is exactly the chunk's causal attention, computed by the decode kernel
    (the one plain decoding uses), which reads the cache in place."""
    return s.num_new_tokens == 1 or (split_verification and s.num_draft_tokens > 0)


def build_inputs(
    batch: Sequence[ScheduledRequest],
    block_size: int,
    device: torch.device,
    split_verification: bool = False,
) -> StepInputs:
    """Flatten ``batch`` into token ids, positions and metadata.

    Entries that ``as_decode_rows`` must come first (the attention contract
    groups query-length-1 sequences). Shared by the target runner and draft
    models, which address the same block ids (each model has its own cache
    tensors).
    """
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    qlens: list[int] = []
    seq_lens: list[int] = []
    seq_blocks: list[list[int]] = []
    chunk_starts = [0]
    for s in batch:
        toks = s.token_ids()
        ids.extend(toks)
        # Cache positions: a KV policy's evictions put them below the token index
        # (kept tokens are packed and re-rotated, engine/kv/policies/runtime.py).
        start = s.start - s.req.num_evicted_tokens
        pos.extend(range(start, start + s.num_new_tokens))
        if s.num_new_tokens > 1 and split_verification and s.num_draft_tokens > 0:
            for j in range(s.num_new_tokens):
                qlens.append(1)
                seq_lens.append(start + j + 1)
                seq_blocks.append(s.req.block_ids)
        else:
            qlens.append(s.num_new_tokens)
            seq_lens.append(start + s.num_new_tokens)
            seq_blocks.append(s.req.block_ids)
        chunk_starts.append(len(ids))
    max_blocks = max(1, *(len(b) for b in seq_blocks)) if seq_blocks else 1
    table = torch.zeros((len(seq_blocks), max_blocks), dtype=torch.int32)
    for i, blocks in enumerate(seq_blocks):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(qlens)), torch.tensor(qlens, dtype=torch.long)
    )
    positions = torch.tensor(pos, dtype=torch.long)
    slots = table[seq_of_token, positions // bs].long() * bs + positions % bs
    num_decodes = 0
    while num_decodes < len(qlens) and qlens[num_decodes] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        block_tables=table.to(device, non_blocking=True),
        slot_mapping=slots.to(device, non_blocking=True),
        max_query_len=max(qlens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=qsl,
    )
    input_ids = torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
    return StepInputs(input_ids, positions.to(device, non_blocking=True), meta, chunk_starts)


def attention_backend_of(model: Any) -> AttentionBackend | None:
    """The backend the model's attention layers share (None: none found)."""
    for m in model.modules():
        backend = getattr(m, "attn_backend", None)
        if isinstance(backend, AttentionBackend):
            return backend
    return None
