"""Our Llama-family implementation and loader vs Hugging Face transformers.

Tolerances: float32 logits must agree with transformers within atol 1e-4
(rtol 1e-4) on tiny random models whose logits are O(1..10); the different
op order (fused q/k/v and gate/up matmuls, paged attention) leaves ~1e-6.
The real Q4_1 GGUF is compared on dequantized weights in float32 (same
weights on both sides), within atol 1e-3 on logits of magnitude ~20.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from model_utils import (
    hf_to_gguf_name,
    make_kv_caches,
    make_tiny_checkpoint,
    prefill_metadata,
    random_kquant_blocks,
    write_llama_gguf,
)

from engine.attention.torch_backend import TorchAttentionBackend
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import (
    gguf_to_hf_name,
    iter_weights,
    load_model,
    load_model_config,
    resolve_model_path,
)
from engine.models.registry import get_model_class

ATOL = 1e-4
RTOL = 1e-4
BLOCK = 4

# (architecture, config overrides): every family, tied and untied embeddings.
CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True}),
    ("llama3", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {}),
    ("qwen3", {"attention_bias": True}),
]


def _hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    hf.eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _ours(path: Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, ModelConfig]:
    cfg = load_model_config(path)
    model = load_model(path, cfg, TorchAttentionBackend(), dtype, "cpu")
    assert isinstance(model, LlamaForCausalLM)
    return model, cfg


def _caches(cfg: ModelConfig, num_blocks: int, dtype: torch.dtype = torch.float32):
    return make_kv_caches(
        cfg.num_hidden_layers, num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype
    )


def _prefill_logits(model: LlamaForCausalLM, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    nblk = (len(ids) + BLOCK - 1) // BLOCK
    # Non-contiguous, shuffled block ids so the block table is really used.
    blocks = [2 * i + 1 for i in range(nblk)][::-1]
    caches = _caches(cfg, 2 * nblk + 2)
    meta, pos = prefill_metadata([len(ids)], [len(ids)], [blocks], BLOCK)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), pos, caches, meta)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.mark.parametrize(("arch", "overrides"), CASES)
def test_prefill_and_decode_match_transformers(
    tiny_dir: Path, arch: str, overrides: dict[str, Any]
) -> None:
    path = make_tiny_checkpoint(tiny_dir, arch, **overrides)
    model, cfg = _ours(path)
    assert cfg.tie_word_embeddings == bool(overrides.get("tie_word_embeddings", False))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, cfg.vocab_size, (13,), generator=gen).tolist()
    ref = _hf_logits(path, ids)

    # 1) one prefill of the whole prompt.
    torch.testing.assert_close(_prefill_logits(model, cfg, ids), ref, atol=ATOL, rtol=RTOL)

    # 2) prefill 6 tokens, then extend by 3 (chunked prefill over a cached
    #    prefix), then decode the rest one token at a time: blocks of 4 so the
    #    cached context crosses block boundaries at every stage.
    blocks = [5, 0, 3, 7]
    caches = _caches(cfg, 8)
    got: list[torch.Tensor] = []
    done = 0
    with torch.inference_mode():
        for q in [6, 3, 1, 1, 1, 1]:
            meta, pos = prefill_metadata([done + q], [q], [blocks], BLOCK)
            hidden = model(torch.tensor(ids[done : done + q]), pos, caches, meta)
            got.append(model.compute_logits(hidden))
            done += q
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_flattened_batch_equals_each_sequence_alone(tiny_dir: Path, arch: str) -> None:
    path = make_tiny_checkpoint(tiny_dir, arch)
    model, cfg = _ours(path)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 9, 5)]
    alone = [_prefill_logits(model, cfg, p) for p in prompts]

    # All three prefills in one call (the 1-token one counts as a decode and
    # goes first), each in its own blocks of a shared cache.
    tables = [[0], [1, 2, 3], [4, 5]]
    meta, pos = prefill_metadata(
        [len(p) for p in prompts], [len(p) for p in prompts], tables, BLOCK
    )
    assert meta.num_decodes == 1
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, pos, _caches(cfg, 6), meta))
    torch.testing.assert_close(logits, torch.cat(alone), atol=1e-5, rtol=1e-5)

    # A mixed step: two decodes continuing the prompts above plus a fresh prefill.
    caches = _caches(cfg, 8)
    with torch.inference_mode():
        for p, table in ((prompts[1], [1, 2, 3]), (prompts[2], [4, 5])):
            meta, pos = prefill_metadata([len(p)], [len(p)], [table], BLOCK)
            model(torch.tensor(p), pos, caches, meta)
        nxt = [7, 11]
        fresh = prompts[1][:4]
        meta, pos = prefill_metadata([10, 6, 4], [1, 1, 4], [[1, 2, 3], [4, 5], [6]], BLOCK)
        mixed = model.compute_logits(model(torch.tensor([*nxt, *fresh]), pos, caches, meta))
    ref = [
        _prefill_logits(model, cfg, [*prompts[1], 7])[-1:],
        _prefill_logits(model, cfg, [*prompts[2], 11])[-1:],
        _prefill_logits(model, cfg, fresh),
    ]
    torch.testing.assert_close(mixed, torch.cat(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(tiny_dir: Path, dtype: torch.dtype) -> None:
    path = make_tiny_checkpoint(tiny_dir, "qwen2")
    ref_model, cfg = _ours(path)
    half, _ = _ours(path, dtype)
    assert half.model.embed_tokens.weight.dtype == dtype
    ids = list(range(3, 20))
    ref = _prefill_logits(ref_model, cfg, ids)
    caches = make_kv_caches(
        cfg.num_hidden_layers, 5, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype
    )
    meta, pos = prefill_metadata([len(ids)], [len(ids)], [[0, 1, 2, 3, 4]], BLOCK)
    with torch.inference_mode():
        hidden = half(torch.tensor(ids), pos, caches, meta)
        logits = half.compute_logits(hidden)
    assert hidden.dtype == dtype and logits.dtype == torch.float32
    # Half precision: ~3 significant digits through 2 layers.
    torch.testing.assert_close(logits, ref, atol=0.15, rtol=0.05)


def test_model_config_from_hf(tiny_dir: Path) -> None:
    cfg = load_model_config(make_tiny_checkpoint(tiny_dir, "llama3"))
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_theta == 500000.0
    assert cfg.kv_bytes_per_token(torch.float16) == 2 * 2 * 2 * 16 * 2
    q2 = load_model_config(make_tiny_checkpoint(tiny_dir, "qwen2"))
    assert (q2.attention_bias, q2.o_proj_bias, q2.qk_norm) == (True, False, False)
    q3 = load_model_config(make_tiny_checkpoint(tiny_dir, "qwen3"))
    assert (q3.head_dim, q3.qk_norm, q3.attention_bias) == (32, True, False)


def test_load_weights_rejects_missing_unexpected_and_misshapen(tiny_dir: Path) -> None:
    path = make_tiny_checkpoint(tiny_dir, "llama")
    cfg = load_model_config(path)
    weights = dict(iter_weights(path))
    model = LlamaForCausalLM(cfg, TorchAttentionBackend())
    with pytest.raises(ValueError, match=r"missing 1 weights.*k_proj"):
        model.load_weights(
            (n, t) for n, t in weights.items() if n != "model.layers.1.self_attn.k_proj.weight"
        )
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.extra\.weight'"):
        model.load_weights([*weights.items(), ("model.extra.weight", torch.zeros(1))])
    bad = dict(weights)
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="shape"):
        model.load_weights(bad.items())


def test_unsupported_architecture_is_named(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
    path = make_tiny_checkpoint(tiny_dir, "llama")
    cfg = load_model_config(path)
    cfg.architecture = "FalconForCausalLM"
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        load_model(path, cfg, TorchAttentionBackend(), torch.float32, "cpu")


def test_missing_and_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model_path(str(tmp_path))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        resolve_model_path(str(other))


def test_gguf_names() -> None:
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")


# ----------------------------------------------------------------- real GGUF


@pytest.fixture(scope="module")
def smollm(default_model_path: Path, hf_gguf_model: Any):
    """(our model, config, transformers model) on the default GGUF, in float32."""
    path = resolve_model_path(None)
    assert path == default_model_path
    cfg = load_model_config(path)
    t0 = time.perf_counter()
    ours = load_model(path, cfg, TorchAttentionBackend(), torch.float32, "cpu")
    print(f"\nGGUF load (ours): {time.perf_counter() - t0:.2f} s")
    return ours, cfg, hf_gguf_model


@pytest.mark.slow
def test_gguf_config_matches_transformers(smollm) -> None:
    _, cfg, hf = smollm
    hf_cfg = ModelConfig.from_hf_config(hf.config)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "tie_word_embeddings",
        "max_position_embeddings",
    ):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps)


# Arbitrary valid token ids shaped like a chat prompt (fixed ids keep this test
# independent of tokenizer code).
_PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]


@pytest.mark.slow
def test_gguf_logits_match_transformers(smollm) -> None:
    ours, cfg, hf = smollm
    with torch.inference_mode():
        ref = hf(torch.tensor([_PROMPT])).logits[0].float()
    got = _prefill_logits(ours, cfg, _PROMPT)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_gguf_greedy_decode_matches_transformers(smollm) -> None:
    ours, cfg, hf = smollm
    steps = 20
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([_PROMPT]),
            attention_mask=torch.ones(1, len(_PROMPT), dtype=torch.long),
            do_sample=False,
            max_new_tokens=steps,
        )[0, len(_PROMPT) :].tolist()

    total = len(_PROMPT) + steps
    blocks = list(range((total + BLOCK - 1) // BLOCK))
    caches = _caches(cfg, len(blocks))
    out: list[int] = []
    with torch.inference_mode():
        meta, pos = prefill_metadata([len(_PROMPT)], [len(_PROMPT)], [blocks], BLOCK)
        logits = ours.compute_logits(ours(torch.tensor(_PROMPT), pos, caches, meta))
        for _ in range(steps):
            out.append(int(logits[-1].argmax()))
            if out[-1] == cfg.eos_token_id:  # generate() stops after EOS too
                break
            n = len(_PROMPT) + len(out)
            meta, pos = prefill_metadata([n], [1], [blocks], BLOCK)
            logits = ours.compute_logits(ours(torch.tensor(out[-1:]), pos, caches, meta))
    assert out == ref


def _greedy(
    model: Any, cfg: ModelConfig, steps: int, kv_dtype: torch.dtype = torch.float32
) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens after _PROMPT and each step's logits (prefill, then 1-row decodes)."""
    total = len(_PROMPT) + steps
    blocks = list(range((total + BLOCK - 1) // BLOCK))
    caches = _caches(cfg, len(blocks), kv_dtype)
    out: list[int] = []
    rows: list[torch.Tensor] = []
    with torch.inference_mode():
        meta, pos = prefill_metadata([len(_PROMPT)], [len(_PROMPT)], [blocks], BLOCK)
        logits = model.compute_logits(model(torch.tensor(_PROMPT), pos, caches, meta))
        for _ in range(steps):
            rows.append(logits[-1])
            out.append(int(logits[-1].argmax()))
            meta, pos = prefill_metadata([len(_PROMPT) + len(out)], [1], [blocks], BLOCK)
            logits = model.compute_logits(model(torch.tensor(out[-1:]), pos, caches, meta))
    return out, rows


def _total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.softmax(-1) - b.softmax(-1)).abs().sum() / 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "kv_dtype", "max_tv", "exact_answer"),
    [
        # the default for this file: its Q4_1 blocks x 15-bit activation codes
        # (native kernel for prompt and decodes), float16 KV cache
        # (measured: TV <= 0.004)
        ("q4_1", torch.float16, 0.02, True),
        ("q4_1", torch.float32, 0.02, True),
        # float16 KV cache, exact float32 linears (measured: TV <= 0.003)
        ("float32", torch.float16, 0.02, True),
        # per-tensor 7-bit activations: the prompt's BOS row costs accuracy
        # (measured: TV 0.51 on the first token; the 8th token differs)
        ("int8", torch.float32, None, False),
    ],
)
def test_gguf_cpu_speed_options_stay_close(
    smollm, mode: str, kv_dtype: torch.dtype, max_tv: float | None, exact_answer: bool
) -> None:
    """--cpu-linear q4_1 / int8 and --kv-cache-dtype float16 on the real GGUF:
    the greedy answer and (where bounded) each step's distribution stay near
    float32's. q4_1 keeps the file's Q4_1 blocks exactly."""
    from engine.attention.cpu_backend import CpuNativeAttentionBackend
    from engine.models.linear import BlockQuantLinears, Int8Linears
    from kernels.cpu_native import CpuKernels, NativeBuildError
    from kernels.quant_linear import Q4_1

    ref_model, cfg, _ = smollm
    try:
        kernels = CpuKernels.load()
    except NativeBuildError as e:
        pytest.skip(f"native CPU kernels not buildable here: {e}")
    path = resolve_model_path(None)
    fast = load_model(path, cfg, CpuNativeAttentionBackend(kernels), torch.float32, "cpu")
    if mode == "q4_1":
        BlockQuantLinears(kernels, Q4_1).apply(fast)
    elif mode == "int8":
        Int8Linears().apply(fast)
    steps = 16
    want, ref_rows = _greedy(ref_model, cfg, steps)
    got, got_rows = _greedy(fast, cfg, steps, kv_dtype)
    # The answer, up to and including end-of-turn, is the same; what follows
    # an end-of-turn token is noise in any precision.
    end = want.index(cfg.eos_token_id) + 1 if cfg.eos_token_id in want else steps
    assert end >= 4 and got[:4] == want[:4], (got, want)
    if exact_answer:
        assert got[:end] == want[:end], (got, want)
    if max_tv is not None:
        tvs = [_total_variation(g, r) for g, r in zip(got_rows[:end], ref_rows[:end])]
        assert max(tvs) <= max_tv, tvs


def test_gguf_roundtrip_float32_matches_transformers(tiny_dir: Path, tmp_path: Path) -> None:
    """A llama.cpp-style conversion (names, q/k permutation, metadata) loads back exactly."""
    hf_dir = make_tiny_checkpoint(tiny_dir, "llama")
    path = write_llama_gguf(hf_dir, tmp_path / "tiny.gguf")
    model, cfg = _ours(path)
    hf_cfg = load_model_config(hf_dir)
    # GGUF stores the epsilon as float32; everything else must agree exactly.
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert cfg == dataclasses.replace(hf_cfg, rms_norm_eps=cfg.rms_norm_eps)
    ids = list(range(3, 16))
    torch.testing.assert_close(
        _prefill_logits(model, cfg, ids), _hf_logits(hf_dir, ids), atol=ATOL, rtol=RTOL
    )


def test_gguf_quant_types_dequantize_in_hf_layout(tiny_dir: Path, tmp_path: Path) -> None:
    """Each GGML type comes back as its dequantized values under the HF name and row order.

    Quantization blocks run along rows and the q/k permutation moves whole
    rows, so the expected tensor is dequantize(quantize(w)) of the HF weight.
    ``gguf`` has no K-quant quantizer, so Q4_K/Q6_K tensors are random valid
    blocks whose expected value is their direct dequantization.
    """
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    q = gguf.GGMLQuantizationType
    # 256-wide rows so K-quants (256-element blocks) fit.
    hf_dir = make_tiny_checkpoint(
        tiny_dir, "llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1
    )
    qtypes = {
        "token_embd.weight": q.Q8_0,
        "output.weight": q.F16,
        "blk.0.attn_q.weight": q.Q4_0,
        "blk.0.attn_k.weight": q.Q4_1,
        "blk.0.attn_v.weight": q.BF16,
        "blk.0.ffn_gate.weight": q.Q8_0,
        "blk.0.ffn_up.weight": q.Q4_0,
    }
    raw = {
        "blk.0.attn_output.weight": (random_kquant_blocks(q.Q6_K, 256, 256, seed=1), q.Q6_K),
        "blk.0.ffn_down.weight": (random_kquant_blocks(q.Q4_K, 256, 256, seed=2), q.Q4_K),
    }
    path = write_llama_gguf(hf_dir, tmp_path / "mixed.gguf", qtypes, raw)
    ref = load_file(str(hf_dir / "model.safetensors"))
    got = dict(iter_weights(path))
    assert set(got) == set(ref)
    for name, w in ref.items():
        expect = w.float().numpy()
        gname = hf_to_gguf_name(name)
        qtype = qtypes.get(gname)
        if gname in raw:
            expect = dequantize(raw[gname][0], raw[gname][1])
        elif qtype is not None:
            expect = dequantize(quantize(expect, qtype), qtype)
        assert torch.equal(got[name], torch.from_numpy(expect)), name
    # The mixed-type file also builds and runs end to end.
    model, cfg = _ours(path)
    ids = list(range(3, 16))
    logits = _prefill_logits(model, cfg, ids)
    assert torch.isfinite(logits).all()
