"""Mixture-of-Experts models, capacity routing and the fused-MoE kernel.

* Parity: tiny random Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE checkpoints
  (``save_pretrained`` with a fixed seed) against transformers: logits within
  the dense models' tolerance (atol/rtol 1e-4) for a prefill, chunked prefill
  and decode; a flattened batch equals each sequence alone; greedy decoding in
  the engine is token-identical alone and batched. GGUF files of the same
  weights (written like llama.cpp's converter: stacked ``ffn_*_exps``) load to
  the same config and bit-identical logits.
* Capacity routing: hand-computed assignments with overflow, ties, rerouting
  and pass-through; invariance to the order of the batch; ample capacity
  equals no capacity bit for bit.
* Experts: the CPU grouped path against the per-slot torch reference (the
  Triton fused-MoE kernels are tested in tests/test_kernels.py).
* Observability: per-layer counters in EngineStats, the Prometheus family and
  request-trace events, checked against exact totals.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.attention.torch_backend import TorchAttentionBackend
from engine.llm import LLM
from engine.models.config import ModelConfig
from engine.models.linear import BlockQuantLinear, Int8DynamicLinear, PackedLinear
from engine.models.loader import load_model, load_model_config
from engine.models.moe import MoeExperts, MoeForCausalLM
from engine.models.moe_routing import (
    RouterSpec,
    Routing,
    RoutingContext,
    assign_with_capacity,
    expert_capacity,
    request_key,
    route,
)
from engine.stats import EngineStats, MoeLayerStats
from engine.trace import MoeCapacity
from kernels.fused_moe import fused_moe_ref
from server.metrics import Metrics
from tests.model_utils import (
    TINY_MOE_ARCHS,
    make_kv_caches,
    make_tiny_checkpoint,
    prefill_metadata,
    write_moe_gguf,
)
from tests.test_engine import GEN, greedy, hf_greedy, run_batched, tiny_engine

ATOL = 1e-4
RTOL = 1e-4
BLOCK = 4

# (tiny arch, config overrides): every family, plus Qwen2-MoE with a dense layer
# and OLMoE with clip_qkv.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("mixtral", {}),
    ("qwen2_moe", {}),
    ("qwen2_moe", {"mlp_only_layers": [1]}),
    ("qwen3_moe", {}),
    ("olmoe", {}),
    ("olmoe", {"clip_qkv": 0.5}),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny_moe")


def _ours(path: Path) -> tuple[MoeForCausalLM, ModelConfig]:
    cfg = load_model_config(path)
    model = load_model(path, cfg, TorchAttentionBackend(), torch.float32, "cpu")
    assert isinstance(model, MoeForCausalLM)
    return model, cfg


def _caches(cfg: ModelConfig, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_kv_caches(
        cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim
    )


def _prefill_logits(model: MoeForCausalLM, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    nblk = (len(ids) + BLOCK - 1) // BLOCK
    blocks = [2 * i + 1 for i in range(nblk)][::-1]
    meta, pos = prefill_metadata([len(ids)], [len(ids)], [blocks], BLOCK)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), pos, _caches(cfg, 2 * nblk + 2), meta))


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_logits_match_transformers(tiny_dir: Path, arch: str, overrides: dict[str, Any]) -> None:
    path = make_tiny_checkpoint(tiny_dir, arch, **overrides)
    model, cfg = _ours(path)
    assert cfg.is_moe
    if overrides.get("mlp_only_layers"):
        assert cfg.dense_layers == (1,) and len(model.moe_blocks()) == 1
    ids = torch.randint(3, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(path, ids.tolist())
    torch.testing.assert_close(_prefill_logits(model, cfg, ids.tolist()), ref, atol=ATOL, rtol=RTOL)
    # Prefill 6, extend by 3, then decode one at a time over a paged cache.
    blocks = [5, 0, 3, 7]
    caches = _caches(cfg, 8)
    got, done = [], 0
    with torch.inference_mode():
        for q in [6, 3, 1, 1, 1, 1]:
            meta, pos = prefill_metadata([done + q], [q], [blocks], BLOCK)
            got.append(model.compute_logits(model(ids[done : done + q], pos, caches, meta)))
            done += q
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_flattened_batch_equals_each_sequence_alone(tiny_dir: Path, arch: str) -> None:
    path = make_tiny_checkpoint(tiny_dir, arch)
    model, cfg = _ours(path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 9, 5)]
    alone = torch.cat([_prefill_logits(model, cfg, p) for p in prompts])
    meta, pos = prefill_metadata(
        [len(p) for p in prompts], [len(p) for p in prompts], [[0], [1, 2, 3], [4, 5]], BLOCK
    )
    with torch.inference_mode():
        ids = torch.tensor([t for p in prompts for t in p])
        batched = model.compute_logits(model(ids, pos, _caches(cfg, 6), meta))
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", TINY_MOE_ARCHS)
def test_engine_greedy_matches_transformers_alone_and_batched(tiny_dir: Path, arch: str) -> None:
    model_dir = make_tiny_checkpoint(tiny_dir, arch)
    prompt = [random.Random(arch).randrange(3, 250) for _ in range(23)]
    want = hf_greedy(model_dir, prompt, GEN)
    eng = tiny_engine(model_dir)
    assert LLM(engine=eng).generate([prompt], greedy())[0].token_ids == want
    assert run_batched(eng, prompt, seed=1) == want
    # Chunked prefill, preemption, n > 1 and the prefix cache: tests/test_differential.py.


@pytest.mark.parametrize("arch", TINY_MOE_ARCHS)
def test_gguf_and_safetensors_agree(tiny_dir: Path, tmp_path: Path, arch: str) -> None:
    hf_dir = make_tiny_checkpoint(tiny_dir, arch)
    gguf_path = write_moe_gguf(hf_dir, arch, tmp_path / f"{arch}.gguf")
    hf_cfg, gguf_cfg = load_model_config(hf_dir), load_model_config(gguf_path)
    # GGUF stores eps as float32; everything else must be the same config.
    assert gguf_cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(gguf_cfg, rms_norm_eps=hf_cfg.rms_norm_eps) == hf_cfg
    ids = list(range(3, 19))
    a, _ = _ours(hf_dir)
    b, _ = _ours(gguf_path)
    assert torch.equal(_prefill_logits(a, hf_cfg, ids), _prefill_logits(b, gguf_cfg, ids))


def test_gguf_quantized_experts_dequantize_per_expert(tiny_dir: Path, tmp_path: Path) -> None:
    """Q8_0 stacked experts dequantize into each expert's [out, in] layout."""
    import gguf
    from gguf.quants import dequantize, quantize

    hf_dir = make_tiny_checkpoint(tiny_dir, "qwen3_moe")
    path = write_moe_gguf(hf_dir, "qwen3_moe", tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0)
    model, _ = _ours(path)
    ref, _ = _ours(hf_dir)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for ours, theirs in zip(model.moe_blocks(), ref.moe_blocks()):
        for got, want in (
            (ours.experts.gate_up, theirs.experts.gate_up),
            (ours.experts.down, theirs.experts.down),
        ):
            assert got is not None and want is not None
            expect = dequantize(quantize(want.detach().numpy(), q8), q8)
            assert torch.equal(got.detach(), torch.from_numpy(expect))


def test_config_fields_follow_each_reference(tiny_dir: Path) -> None:
    mix = load_model_config(make_tiny_checkpoint(tiny_dir, "mixtral"))
    assert (mix.num_experts, mix.num_experts_per_tok, mix.moe_intermediate_size) == (4, 2, 32)
    assert (mix.norm_topk_prob, mix.moe_weights_fp32, mix.attention_bias) == (True, True, False)
    q2 = load_model_config(make_tiny_checkpoint(tiny_dir, "qwen2_moe"))
    assert (q2.norm_topk_prob, q2.moe_weights_fp32, q2.shared_expert_intermediate_size) == (
        False,
        False,
        64,
    )
    assert (q2.attention_bias, q2.o_proj_bias) == (True, False)
    q3 = load_model_config(make_tiny_checkpoint(tiny_dir, "qwen3_moe"))
    assert (q3.norm_topk_prob, q3.qk_norm, q3.qk_norm_full, q3.head_dim) == (True, True, False, 32)
    ol = load_model_config(make_tiny_checkpoint(tiny_dir, "olmoe"))
    assert (ol.norm_topk_prob, ol.qk_norm, ol.qk_norm_full, ol.clip_qkv) == (
        False,
        True,
        True,
        None,
    )


# ---------------------------------------------------------------- capacity routing


def _spec(e: int, k: int, norm: bool = False) -> RouterSpec:
    return RouterSpec(num_experts=e, top_k=k, norm_topk_prob=norm, weights_fp32=True)


def _ctx(
    n: int, factor: float | None, positions: list[int] | None = None, keys: list[int] | None = None
) -> RoutingContext:
    pos = torch.tensor(positions if positions is not None else list(range(n)))
    k = torch.tensor(keys) if keys is not None else torch.zeros(n, dtype=torch.int64)
    return RoutingContext(pos, k, factor)


def test_expert_capacity_formula() -> None:
    assert expert_capacity(1.0, 16, 2, 8) == 4
    assert expert_capacity(1.25, 16, 2, 8) == 5  # exactly 5, not 6 from float noise
    assert expert_capacity(1.0, 1, 2, 8) == 1
    assert expert_capacity(0.75, 4, 1, 3) == 1
    assert expert_capacity(1.1, 10, 2, 8) == math.ceil(1.1 * 10 * 2 / 8) == 3


def test_no_capacity_is_topk_exactly() -> None:
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(0))
    for norm, fp32 in ((True, True), (False, False)):
        r = route(logits, RouterSpec(6, 2, norm, fp32))
        probs = torch.softmax(logits.float(), dim=-1)
        top_v, top_i = torch.topk(probs, 2, dim=-1)
        if norm:
            top_v /= top_v.sum(dim=-1, keepdim=True)
        assert torch.equal(r.expert_ids, top_i) and torch.equal(r.weights, top_v)
        assert r.rerouted is None and r.dropped is None


def test_overflow_goes_to_next_best_expert_else_passes_through() -> None:
    # 3 experts, top-1, 4 tokens, factor 0.75: capacity ceil(0.75 * 4 / 3) = 1.
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.5, 0.1, 0.4], [0.1, 0.8, 0.1]])
    r = route(probs.log(), _spec(3, 1), _ctx(4, 0.75))
    # Expert 0 keeps t0 (0.7 beats 0.6, 0.5); expert 1 takes t3; t1 and t2 move on:
    # both want expert 2 (the only one with room), t2 wins (0.4 > 0.1), t1 is dropped.
    assert r.expert_ids.tolist() == [[0], [-1], [2], [1]]
    assert r.rerouted is not None and r.dropped is not None
    assert r.rerouted.tolist() == [0, 0, 1, 0] and r.dropped.tolist() == [0, 1, 0, 0]
    p = torch.softmax(probs.log(), dim=-1)
    assert torch.equal(r.weights[:, 0], torch.stack([p[0, 0], torch.tensor(0.0), p[2, 2], p[3, 1]]))


def test_first_choices_outrank_second_choices_and_weights_keep_topk_norm() -> None:
    # 4 experts, top-2, 2 tokens, factor 0.5: capacity 1 each, exactly T * k slots.
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.35, 0.3, 0.25, 0.1]])
    r = route(probs.log(), _spec(4, 2, norm=True), _ctx(2, 0.5))
    # Round 0: both want e0, t0 wins (0.4); t1 falls to e1. Round 1: t0's next open
    # is e2 (0.2), t1's too (0.25): t1 wins, t0 gets e3.
    assert r.expert_ids.tolist() == [[0, 3], [1, 2]]
    assert r.rerouted is not None and r.rerouted.tolist() == [1, 1]
    p = torch.softmax(probs.log(), dim=-1)
    top = torch.topk(p, 2, dim=-1).values.sum(dim=-1)
    want = torch.stack([p[0, [0, 3]] / top[0], p[1, [1, 2]] / top[1]])
    assert torch.equal(r.weights, want)


def test_ties_break_by_position_then_request_key_not_batch_order() -> None:
    # All three tokens score the same for expert 0; capacity 1 (2 experts, top-1).
    logits = torch.tensor([[1.0, 0.0]] * 3)
    positions, keys = [5, 3, 3], [10, 20, 5]
    r = route(logits, _spec(2, 1), _ctx(3, 2 / 3, positions, keys))
    # By (position, key): t2 (3, 5) first, then t1 (3, 20), then t0 (5, 10).
    assert r.expert_ids.tolist() == [[-1], [1], [0]]
    for perm in ([1, 2, 0], [2, 0, 1], [0, 2, 1]):
        rp = route(
            logits[perm],
            _spec(2, 1),
            _ctx(3, 2 / 3, [positions[i] for i in perm], [keys[i] for i in perm]),
        )
        assert rp.expert_ids.tolist() == [r.expert_ids.tolist()[i] for i in perm]


def test_random_batches_route_the_same_in_any_order() -> None:
    gen = torch.Generator().manual_seed(3)
    t, e, k = 40, 8, 2
    logits = torch.randn(t, e, generator=gen)
    logits[5] = logits[9]  # exact ties between tokens too
    positions = torch.randint(0, 6, (t,), generator=gen).tolist()
    keys = [request_key(f"req-{i % 7}") for i in range(t)]
    for factor in (0.5, 1.0, 1.25):
        base = route(logits, _spec(e, k, True), _ctx(t, factor, positions, keys))
        assert base.dropped is not None and base.rerouted is not None
        cap = expert_capacity(factor, t, k, e)
        assert torch.bincount(base.expert_ids[base.expert_ids >= 0], minlength=e).max() <= cap
        perm = torch.randperm(t, generator=gen)
        shuffled = route(
            logits[perm],
            _spec(e, k, True),
            _ctx(t, factor, [positions[i] for i in perm], [keys[i] for i in perm]),
        )
        assert torch.equal(shuffled.expert_ids, base.expert_ids[perm])
        assert torch.equal(shuffled.weights, base.weights[perm])
    assert int(base.rerouted.sum()) > 0  # the cases above really overflowed


def test_ample_capacity_equals_no_capacity_bit_for_bit() -> None:
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(4))
    free = route(logits, _spec(8, 2, True))
    capped = route(logits, _spec(8, 2, True), _ctx(20, 8.0))  # capacity 40 >= 20 tokens
    assert torch.equal(capped.expert_ids, free.expert_ids)
    assert torch.equal(capped.weights, free.weights)
    assert capped.rerouted is not None and int(capped.rerouted.sum()) == 0


def test_assignment_respects_room_and_distinct_experts() -> None:
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(30, 6, generator=gen), dim=-1)
    top_i = torch.topk(probs, 3, dim=-1).indices
    ids = assign_with_capacity(probs, top_i, 10, torch.randperm(30, generator=gen))
    kept = ids[ids >= 0]
    assert torch.bincount(kept, minlength=6).max() <= 10
    for row in ids.tolist():
        used = [x for x in row if x >= 0]
        assert len(used) == len(set(used))
    # 6 * 10 = 60 slots of room for 90 wanted: exactly 30 slots pass through.
    assert int((ids < 0).sum()) == 30


def test_dropped_token_leaves_the_block_on_residual_and_shared_expert_only(tiny_dir: Path) -> None:
    for arch in ("mixtral", "qwen2_moe"):
        model, cfg = _ours(make_tiny_checkpoint(tiny_dir, arch))
        block = model.moe_blocks()[0]
        x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
        # factor 0.01: capacity ceil(0.01 * 5 * 2 / 4) = 1 slot per expert, 4 of 10 placed.
        ctx = _ctx(5, 0.01)
        with torch.inference_mode():
            out = block(x, ctx)
            ids = route(block.gate(x), block.spec, _ctx(5, 0.01)).expert_ids
        gone = (ids < 0).all(dim=1)
        assert gone.any()
        if block.shared_expert is None:
            assert torch.equal(out[gone], torch.zeros_like(out[gone]))
        else:
            assert block.shared_expert_gate is not None
            with torch.inference_mode():
                shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
            torch.testing.assert_close(out[gone], shared[gone], atol=1e-6, rtol=1e-6)
        assert ctx.token_dropped is not None and int(ctx.token_dropped.sum()) == 6
        assert int(block.dropped_tokens) == 6


# ---------------------------------------------------------------- kernels


def _experts(w13: torch.Tensor, w2: torch.Tensor) -> MoeExperts:
    experts = MoeExperts(w13.shape[0], w13.shape[2], w2.shape[2])
    with torch.no_grad():
        assert experts.gate_up is not None and experts.down is not None
        experts.gate_up.copy_(w13)
        experts.down.copy_(w2)
    return experts


@pytest.mark.parametrize("skewed", [False, True])
def test_cpu_grouped_paths_match_reference(skewed: bool) -> None:
    """Both CPU paths (one padded bmm per matrix when the slots spread over the
    experts; a loop over the experts with tokens when they do not) vs the per-slot
    reference, and against each other (the same GEMMs up to the BLAS kernel's choice
    for the row count: a few ulps). (The Triton kernels' tests are
    in tests/test_kernels.py, which benchmarks/gpu_check.py also runs on CUDA.)"""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(19, 64, generator=g)
    w13 = torch.randn(8, 64, 64, generator=g) / 8
    w2 = torch.randn(8, 64, 32, generator=g) / 32**0.5
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(19)])
    if skewed:  # most slots on experts 0-2: 8 * 18 rows > 2 * 56 slots -> the loop
        ids = torch.stack([torch.randperm(3, generator=g) for _ in range(19)])
        ids[0] = torch.tensor([5, 6, 7])
    ids[1, -1] = -1
    w = torch.rand(19, 3, generator=g)
    routing = Routing(ids, w)
    stacked = _experts(w13, w2)
    looped = _experts(w13, w2)
    looped.use_linears(lambda m: PackedLinear(m, None, min_rows=10**6))  # F.linear per expert
    assert looped.gate_up is None
    with torch.inference_mode():
        got, loop = stacked(x, routing), looped(x, routing)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, ids, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, loop, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cpu_linear", ["onednn", "int8", "q4_1"])
def test_cpu_linear_strategies_take_the_experts(tiny_dir: Path, cpu_linear: str) -> None:
    """Expert matrices go through the same CPU linear modules as dense layers.

    References: the exact model for onednn (exact) and int8 (coarse: per-tensor
    activations); for q4_1 the exact model run on the Q4_1-rounded weights (Q8_0
    logits), from which only the kernel's 8-bit activation rounding separates it.
    """
    from torch import nn

    from kernels.quant_linear import dequantize, quantize_q4_1, quantize_q8_0

    path = make_tiny_checkpoint(tiny_dir, "qwen2_moe")
    ref, cfg = _ours(path)
    if cpu_linear == "q4_1":
        with torch.no_grad():
            for m in ref.modules():
                if isinstance(m, nn.Linear) and m is not ref.lm_head:
                    m.weight.copy_(dequantize(quantize_q4_1(m.weight)))
            for block in ref.moe_blocks():
                for w in (block.experts.gate_up, block.experts.down):
                    assert w is not None
                    for e in range(w.shape[0]):
                        w[e].copy_(dequantize(quantize_q4_1(w[e])))
            assert ref.lm_head is not None
            ref.lm_head.weight.copy_(dequantize(quantize_q8_0(ref.lm_head.weight)))
    ids = list(range(3, 20))
    want = _prefill_logits(ref, cfg, ids)
    eng = tiny_engine(path, cpu_linear=cpu_linear)
    model = eng.model
    assert isinstance(model, MoeForCausalLM)
    cls = {"onednn": PackedLinear, "int8": Int8DynamicLinear, "q4_1": BlockQuantLinear}[cpu_linear]
    for block in model.moe_blocks():
        assert block.experts.linears is not None
        assert len(block.experts.linears) == 2 * cfg.num_experts
        # oneDNN packing keeps views of the stacked weights (for the bmm path); the
        # quantized strategies own their blocks and the float weights are gone.
        if cpu_linear == "onednn":
            assert block.experts.gate_up is not None
            first = block.experts.linears[0]
            assert isinstance(first, PackedLinear)
            assert first.weight.data_ptr() == block.experts.gate_up.data_ptr()
        else:
            assert block.experts.gate_up is None
        assert all(isinstance(m, cls) for m in block.experts.linears)
        assert not isinstance(block.gate, cls)  # the router stays an exact float linear
    got = _prefill_logits(model, cfg, ids)
    atol, mean = {"onednn": (1e-5, 1e-6), "int8": (0.5, 0.06), "q4_1": (0.5, 0.1)}[cpu_linear]
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    assert float((got - want).abs().mean()) < mean


# ---------------------------------------------------------------- engine, stats, traces


def test_capacity_in_the_engine_is_batch_order_invariant_and_counted(tiny_dir: Path) -> None:
    path = make_tiny_checkpoint(tiny_dir, "qwen3_moe")
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(6 + 3 * i)] for i in range(4)]

    def run(order: list[int], factor: float | None) -> tuple[dict[int, list[int]], Any]:
        eng = tiny_engine(
            path, moe_capacity_factor=factor, enable_request_traces=True, max_num_batched_tokens=64
        )
        for i in order:
            eng.add_request(f"r{i}", prompts[i], greedy(6))
        out: dict[int, list[int]] = {i: [] for i in order}
        while eng.has_unfinished():
            for _, o in eng.step():
                for d in o.outputs:
                    out[int(o.request_id[1:])].extend(d.delta_token_ids)
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        return out, eng

    free, eng_free = run([0, 1, 2, 3], None)
    capped, eng = run([0, 1, 2, 3], 1.0)
    again, _ = run([3, 1, 0, 2], 1.0)
    assert again == capped
    k = 2
    # Every token forwarded is routed to k experts per layer, minus what was dropped.
    forwarded = sum(len(p) + 6 - 1 for p in prompts)
    for stats in (eng_free.stats, eng.stats):
        assert len(stats.moe_layers) == 2
    for layer in eng_free.stats.moe_layers:
        assert sum(layer.expert_tokens) == forwarded * k
        assert layer.rerouted_tokens == layer.dropped_tokens == 0
    total_rerouted = total_dropped = 0
    for layer in eng.stats.moe_layers:
        assert sum(layer.expert_tokens) == forwarded * k - layer.dropped_tokens
        total_rerouted += layer.rerouted_tokens
        total_dropped += layer.dropped_tokens
    assert total_rerouted > 0
    # Request traces add up to the same totals.
    traces = [eng.get_trace([f"r{i}"]) for i in range(4)]
    events = [ev for t in traces if t is not None for ev in t.events if isinstance(ev, MoeCapacity)]
    assert len(events) > 0 and all(t is not None for t in traces)
    assert sum(ev.num_rerouted for ev in events) == total_rerouted
    assert sum(ev.num_dropped for ev in events) == total_dropped
    assert all(len(v) == 6 for v in (*free.values(), *capped.values()))


def test_capacity_factor_needs_an_moe_model(tiny_dir: Path) -> None:
    dense = make_tiny_checkpoint(tiny_dir, "llama")
    with pytest.raises(ValueError, match="needs a Mixture-of-Experts model"):
        tiny_engine(dense, moe_capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"at least 0\.01"):
        tiny_engine(dense, moe_capacity_factor=0.0)


def test_metrics_family_per_layer_and_imbalance_gauge() -> None:
    m = Metrics("m")
    m.update_from_stats(
        EngineStats(
            moe_layers=(MoeLayerStats(0, (3, 1, 0, 0), 2, 1), MoeLayerStats(1, (1, 1, 1, 1)))
        )
    )
    m.update_from_stats(
        EngineStats(
            moe_layers=(MoeLayerStats(0, (5, 3, 0, 0), 5, 1), MoeLayerStats(1, (1, 1, 1, 1)))
        )
    )
    text = m.render()[0].decode()

    def value(series: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(series))
        return float(line.rsplit(" ", 1)[1])

    labels = 'engine="0",layer="{}",model_name="m"'
    assert value("fuel:moe_routed_tokens_total{" + labels.format(0) + "}") == 8
    assert value("fuel:moe_rerouted_tokens_total{" + labels.format(0) + "}") == 5
    assert value("fuel:moe_dropped_tokens_total{" + labels.format(0) + "}") == 1
    # Layer 0's last interval: (2, 2, 0, 0) -> max 2 / mean 1. Layer 1: balanced, then idle.
    assert value("fuel:moe_expert_load_imbalance{" + labels.format(0) + "}") == 2.0
    assert value("fuel:moe_expert_load_imbalance{" + labels.format(1) + "}") == 1.0
