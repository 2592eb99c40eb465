"""Draft-model proposer: a smaller model (or the target's own weights, quantized) drafts tokens.

KV cache: the draft model's own layer group. It addresses the same block ids
as the target (the request's ``block_ids``) in its own cache tensors, and
computes its KV for every token the target computes, in the same step: the
first draft forward of a step runs the step's whole batch (prefill chunks,
plain decodes and the known tokens of verification chunks), so the draft's
KV is valid exactly where the target's is, and prefix caching, preemption,
aborts and the block invariants cover it unchanged.

Drafting: forward 1 (above) yields draft 1 from each speculating request's
last known token; forward ``i`` runs draft ``i - 1`` (one row per request
still drafting) and yields draft ``i``, writing into the slots the scheduler
reserved. The last draft is drafted but never run by the draft model, so
when every draft is accepted the request's computed tokens stop one short
(``num_computed_drafts``) and that position is recomputed by both models in
the next step: the target verifies one more known token, nearly free.

Drafts are sampled from the draft's distribution processed with the
request's own sampling parameters (penalties, bias, min_tokens, grammar
mask, temperature, top-k/p, min-p): greedy requests draft its argmax
(deterministic drafts), others draw from it with their own generator and
hand the distribution to the verifier.

The self-draft (``"method": "draft_model"`` without ``model``) loads the
target a second time and converts its linears (``convert_linears``): for the
default model's Q4_1 GGUF, Q4_1 blocks draft for the float32 weights.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.kv.format import KVFormat, LayerCaches, PlainKVFormat
from engine.models.config import ModelConfig
from engine.models.loader import load_model, load_model_config, resolve_model_path
from engine.models.ops import NativeCpuModelOps
from engine.request import Request
from engine.sampling.rejection import RowMaskFactory
from engine.sampling.sampler import SampleRow, process_logits, sampling_probs
from engine.scheduler import ScheduledRequest
from engine.spec_decode.calibrate import fake_chunks
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.controller import DraftCost, StepCostModel
from engine.spec_decode.proposer import Proposal, Proposer
from engine.worker.model_runner import build_inputs
from kernels.cpu_native import CpuKernels

logger = logging.getLogger(__name__)


def convert_linears(model: Any, quantization: str | None, kernels: CpuKernels | None) -> None:
    """The draft model's linears as ``quantization`` asks (engine/models/linear.py).

    The one place the draft converts its weights: ``q4_1`` (llama.cpp's Q4_1
    blocks, native kernels), ``int8`` (dynamic int8) or, for None, oneDNN
    prepacking when available (float32 as loaded).
    """
    from engine.models.linear import (
        BlockQuantLinears,
        Int8Linears,
        LinearStrategy,
        OneDnnLinears,
        onednn_packing_available,
    )
    from kernels.quant_linear import Q4_1

    strategy: LinearStrategy | None = None
    if quantization == "q4_1":
        if kernels is None:
            raise ValueError("the q4_1 draft needs the native CPU kernels")
        strategy = BlockQuantLinears(kernels, Q4_1)
    elif quantization == "int8":
        strategy = Int8Linears()
    elif onednn_packing_available() and next(model.parameters()).device.type == "cpu":
        strategy = OneDnnLinears()
    if strategy is not None:
        strategy.apply(model)


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(
        self,
        model: Any,
        model_config: ModelConfig,
        device: torch.device,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.device = device
        self.kv_dtype = kv_dtype
        self.block_size = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Seeded requests draw their drafts from a generator of their own (seeded
        # from theirs), so a seeded request's drafts do not depend on the batch.
        self._generators: dict[str, torch.Generator] = {}

    # ---- set-up ---------------------------------------------------------
    @classmethod
    def load(
        cls,
        spec: SpeculativeConfig,
        target_path: Path,
        target_config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype,
        max_model_len: int,
    ) -> DraftModelProposer:
        """Load the draft (or the self-draft) and check it can draft for the target.

        Raises:
            ValueError: vocabulary or context length mismatch, or a quantization
                the device cannot run.
        """
        if spec.model is None:
            path, mc = target_path, target_config
        else:
            path = resolve_model_path(spec.model)
            mc = load_model_config(path)
            if mc.vocab_size != target_config.vocab_size:
                raise ValueError(
                    f"--speculative-config: the draft model's vocabulary ({mc.vocab_size} tokens) "
                    f"differs from the target's ({target_config.vocab_size}); a draft model "
                    "must share the target's tokenizer"
                )
            if mc.max_supported_len() < max_model_len:
                raise ValueError(
                    f"--speculative-config: the draft model supports {mc.max_supported_len()} "
                    f"positions, fewer than --max-model-len {max_model_len}"
                )
        if spec.quantization is not None and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError(
                f"--speculative-config: a {spec.quantization} draft runs on the CPU in float32 "
                '(set "quantization": null, or give a smaller draft "model")'
            )
        # Any: the registry's model class (LlamaForCausalLM-like), as in the engine.
        model: Any = load_model(path, mc, backend, dtype, device)
        kernels = backend.kernels if isinstance(backend, CpuNativeAttentionBackend) else None
        if spec.quantization == "q4_1" and kernels is None:
            try:
                kernels = CpuKernels.load()
            except Exception as e:  # the build error names the compiler problem
                raise ValueError(
                    f"--speculative-config: the q4_1 draft needs native kernels: {e}"
                ) from e
        convert_linears(model, spec.quantization, kernels)
        if isinstance(backend, CpuNativeAttentionBackend) and dtype == torch.float32:
            model.set_ops(NativeCpuModelOps(backend.kernels))
        logger.info(
            "draft model: %s (%d layers, %s)",
            "the target itself" if spec.model is None else path,
            mc.num_hidden_layers,
            spec.quantization or "as loaded",
        )
        return cls(model, mc, device, kv_dtype)

    def kv_bytes_per_token(self) -> int:
        return self.model_config.kv_bytes_per_token(self.kv_dtype)

    def kv_format(self, block_size: int) -> KVFormat:
        mc = self.model_config
        return PlainKVFormat(
            mc.num_hidden_layers, block_size, mc.num_key_value_heads, mc.head_dim, self.kv_dtype
        )

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv_caches = self.kv_format(block_size).allocate(num_blocks, self.device)

    def cache_tensors(self) -> LayerCaches:
        return self.kv_caches

    def drafting_cost_model(
        self, sizes: Sequence[int], rows: Sequence[int], num_blocks: int
    ) -> DraftCost:
        """Measure the drafting forwards now (on unheld blocks, at start-up): the first
        forward over a step's ``n`` known tokens, then one-row-per-request forwards."""
        sync_sizes = [n for n in sizes if fake_chunks(1, n, num_blocks, self.block_size)]
        row_sizes = [m for m in rows if fake_chunks(m, 1, num_blocks, self.block_size)]

        def run_sync(n: int) -> None:
            batch = fake_chunks(1, n, num_blocks, self.block_size)
            assert batch is not None
            with torch.inference_mode():
                self._forward(batch)

        def run_rows(m: int) -> None:
            batch = fake_chunks(m, 1, num_blocks, self.block_size)
            assert batch is not None
            with torch.inference_mode():
                hidden, _ = self._forward(batch)
                self.model.compute_logits(hidden)

        sync = StepCostModel.measure(run_sync, sync_sizes or [1], rounds=3)
        per_row = StepCostModel.measure(run_rows, row_sizes or [1], rounds=3)

        def cost(num_base_tokens: int, depth_rows: list[int]) -> float:
            # Forward 1 runs every step; each deeper depth with drafts is one forward.
            return sync(num_base_tokens) + sum(per_row(m) for m in depth_rows[1:] if m)

        return cost

    # ---- drafting -------------------------------------------------------
    def num_computed_drafts(self, num_drafts: int, num_accepted: int) -> int:
        return min(num_accepted, max(num_drafts - 1, 0))

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator | None:
        if req.params.seed is None:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator()
            gen.manual_seed((req.params.seed + req.index) * 2654435761 % (1 << 63) + 1)
            self._generators[req.request_id] = gen
        return gen

    def _forward(self, batch: Sequence[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """Run ``batch`` (decodes first) through the draft; hidden states and chunk ends."""
        inputs = build_inputs(batch, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        return hidden, inputs.chunk_starts[1:]

    def _sample(
        self,
        hidden: torch.Tensor,
        rows: list[SampleRow],
        mask_for: RowMaskFactory | None,
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft per row, and the distribution it came from (None: greedy)."""
        logits = self.model.compute_logits(hidden).float()
        process_logits(logits, rows, mask_for(rows) if mask_for else None)
        tokens = logits.argmax(dim=-1).tolist()
        dists: list[torch.Tensor | None] = [None] * len(rows)
        sampled = [i for i, r in enumerate(rows) if r.req.params.temperature != 0.0]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            probs = sampling_probs(logits[idx], [rows[i].req for i in sampled])
            probs = probs / probs.sum(dim=-1, keepdim=True)
            vocab = probs.shape[1]
            for n, i in enumerate(sampled):
                gen = self._generator(rows[i].req)
                noise = torch.empty(vocab).exponential_(generator=gen).to(probs.device)
                tokens[i] = int((probs[n] / noise).argmax())
                dists[i] = probs[n]
        return tokens, dists

    @torch.inference_mode()
    def propose(
        self, batch: Sequence[ScheduledRequest], mask_for: RowMaskFactory | None
    ) -> dict[str, Proposal]:
        # Forward 1: every scheduled token the target computes this step, drafts aside.
        sync = sorted(
            (ScheduledRequest(s.req, s.num_base_tokens, s.start) for s in batch),
            key=lambda s: s.num_new_tokens != 1,
        )
        hidden, ends = self._forward(sync)
        slots = {s.req.request_id: s.num_lookahead_slots for s in batch}
        drafting = [(i, s) for i, s in enumerate(sync) if slots[s.req.request_id] > 0]
        if not drafting:
            return {}
        rows_idx = torch.tensor([ends[i] - 1 for i, _ in drafting], device=hidden.device)
        toks, dists = self._sample(
            hidden[rows_idx], [SampleRow(s.req) for _, s in drafting], mask_for
        )
        drafts = {s.req.request_id: [t] for (_, s), t in zip(drafting, toks)}
        probs: dict[str, list[torch.Tensor | None]] = {
            s.req.request_id: [d] for (_, s), d in zip(drafting, dists)
        }
        chunk = {s.req.request_id: s for _, s in drafting}
        depth = 1
        while True:
            active = [rid for rid, d in drafts.items() if slots[rid] > depth]
            if not active:
                break
            # Forward depth + 1: run draft ``depth`` of each request still drafting.
            step = []
            for rid in active:
                s = chunk[rid]
                step.append(
                    ScheduledRequest(
                        s.req,
                        1,
                        s.start + s.num_base_tokens + depth - 1,
                        draft_token_ids=drafts[rid],
                    )
                )
            hidden, _ = self._forward(step)
            rows = [SampleRow(s.req, tuple(drafts[s.req.request_id])) for s in step]
            toks, dists = self._sample(hidden, rows, mask_for)
            for rid, t, d in zip(active, toks, dists):
                drafts[rid].append(t)
                probs[rid].append(d)
            depth += 1
        out: dict[str, Proposal] = {}
        for rid, toks_of in drafts.items():
            q = probs[rid]
            stacked = None if q[0] is None else torch.stack([x for x in q if x is not None])
            out[rid] = Proposal(toks_of, stacked)
        return out
