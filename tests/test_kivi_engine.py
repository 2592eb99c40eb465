"""KIVI in the engine: start-up errors, capacity, the metrics gauge, block copies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.kv.format import PlainKVFormat
from engine.kv.kivi_format import KiviKVFormat
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams
from server.metrics import Metrics
from tests.conftest import default_gguf_path
from tests.model_utils import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kivi"), "llama", vocab_size=49152)


def _engine(tiny: Path, **kw: Any) -> LLMEngine:
    base: dict[str, Any] = dict(
        model=str(tiny),
        tokenizer=str(default_gguf_path()),
        kv_cache_memory=4 << 20,
        cpu_linear="onednn",
    )
    return LLMEngine(EngineConfig(**{**base, **kw}))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kv_cache_dtype": "kivi4"}, "--block-size a multiple of --kivi-group-size 32"),
        ({"kv_cache_dtype": "kivi2", "block_size": 64, "kivi_residual_length": 20}, "multiple"),
        # kivi2's defaults: groups of 8, a window of 32 and the sink group: 40 tokens.
        ({"kv_cache_dtype": "kivi2", "block_size": 32}, "holding the float16 window"),
        (
            {
                "kv_cache_dtype": "kivi4",
                "block_size": 64,
                "kivi_residual_length": 64,
                "kivi_sink_tokens": 32,
            },
            "at least 96",
        ),
        ({"kv_cache_dtype": "kivi2", "block_size": 64, "kivi_sink_tokens": 3}, "0 or the group"),
        ({"kv_cache_dtype": "kivi4", "block_size": 64, "kv_policy": "h2o"}, "not built"),
        (
            {
                "kv_cache_dtype": "kivi2",
                "block_size": 64,
                "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
            },
            "cannot roll back",
        ),
    ],
)
def test_config_refuses_bad_kivi_settings(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_format_refuses_a_head_size_it_cannot_pack() -> None:
    # 2-bit codes pack four channels to a byte: a head size of 18 does not.
    with pytest.raises(ValueError, match="head size 18"):
        KiviKVFormat(2, 16, 1, 18, bits=2, group_size=8)


# The default model's KV shapes (SmolLM2-135M: 30 layers, 3 kv heads, head size 64).
SMOL = dict(num_layers=30, num_kv_heads=3, head_dim=64)


@pytest.mark.parametrize(("dtype", "ratio"), [("kivi4", 4.0), ("kivi2", 6.0)])
def test_capacity_ratio_against_float32(dtype: str, ratio: float) -> None:
    """At block size 1024 with each format's default window, the issue's
    capacity targets hold."""
    cfg = EngineConfig(kv_cache_dtype=dtype, block_size=1024)  # type: ignore[arg-type]
    group, ring, sink = cfg.kivi_window
    bits = 4 if dtype == "kivi4" else 2
    f32 = PlainKVFormat(block_size=1024, dtype=torch.float32, **SMOL)  # type: ignore[arg-type]
    kivi = KiviKVFormat(
        block_size=1024, bits=bits, group_size=group, ring_groups=ring, sink=sink, **SMOL
    )  # type: ignore[arg-type]
    got = f32.block_nbytes / kivi.block_nbytes
    assert got >= ratio, got
    # Bytes per token: codes (bits/8 per element, K and V), float16 scale and zero
    # (per group of tokens for K, per 32 channels for V), and the float16 slots.
    elems = SMOL["num_layers"] * SMOL["num_kv_heads"] * SMOL["head_dim"]
    slots = ring + int(sink)
    want = elems * (2 * bits / 8 + 4 / group + 4 / 32 + 2 * 2 * slots * group / 1024)
    assert kivi.bytes_per_token == pytest.approx(want, rel=1e-3)


def test_engine_reports_capacity_and_cache_config(tiny: Path) -> None:
    mem = 4 << 20
    plain = _engine(tiny, kv_cache_dtype="float32", block_size=256, kv_cache_memory=mem)
    kivi = _engine(
        tiny,
        kv_cache_dtype="kivi2",
        block_size=256,
        kivi_group_size=16,
        kivi_residual_length=16,
        kv_cache_memory=mem,
    )
    fmt = kivi.runner.kv_format
    assert isinstance(fmt, KiviKVFormat)
    assert kivi.info.num_blocks == mem // fmt.block_nbytes
    ratio = kivi.info.num_blocks / plain.info.num_blocks
    assert ratio == pytest.approx(plain.runner.kv_format.block_nbytes / fmt.block_nbytes, rel=0.05)
    assert ratio > 3.0  # head size 16: value scales per 16 channels cost more than at 64
    assert f"kv_tokens={kivi.info.num_blocks * 256}" in kivi.describe()
    info = kivi.info.cache_config()
    assert info["cache_dtype"] == "kivi2" and info["num_gpu_blocks"] == str(kivi.info.num_blocks)
    assert kivi.info.execution()["kv_cache_dtype"] == "kivi2"
    m = Metrics("tiny")
    m.set_cache_config(info)
    text = m.render()[0].decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    assert f'num_gpu_blocks="{kivi.info.num_blocks}"' in line and 'block_size="256"' in line
    assert line.endswith(" 1.0")


def test_kivi_block_bytes_round_trip(tiny: Path) -> None:
    """read_blocks/write_blocks move KIVI blocks bit for bit (what the host and
    disk tiers and swap rely on), between two engines' caches too."""
    fmt = KiviKVFormat(3, 16, 2, 16, bits=4, group_size=8)
    a, b = fmt.allocate(6, torch.device("cpu")), fmt.allocate(6, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for kc, vc in a:
        kc.copy_(torch.randint(0, 256, kc.shape, generator=gen, dtype=torch.uint8))
        vc.copy_(torch.randint(0, 256, vc.shape, generator=gen, dtype=torch.uint8))
    ids = torch.tensor([4, 1, 2])
    data = fmt.read_blocks(a, ids)
    assert data.shape == (3, fmt.block_nbytes)
    fmt.write_blocks(b, torch.tensor([0, 5, 3]), data)
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka[ids], kb[torch.tensor([0, 5, 3])])
        assert torch.equal(va[ids], vb[torch.tensor([0, 5, 3])])
    assert fmt.describe() != KiviKVFormat(3, 16, 2, 16, bits=2, group_size=8).describe()
    windowed = KiviKVFormat(3, 16, 2, 16, bits=4, group_size=4, ring_groups=2, sink=True)
    assert windowed.describe() != KiviKVFormat(3, 16, 2, 16, bits=4, group_size=4).describe()
    # Key and value rows differ in size (key scales per group, value scales per
    # token); a block's bytes still round-trip.
    lay = windowed.layout
    assert lay.k.nbytes != lay.v.nbytes
    c, d = windowed.allocate(4, torch.device("cpu")), windowed.allocate(4, torch.device("cpu"))
    for kc, vc in c:
        kc.copy_(torch.randint(0, 256, kc.shape, generator=gen, dtype=torch.uint8))
        vc.copy_(torch.randint(0, 256, vc.shape, generator=gen, dtype=torch.uint8))
        assert kc.is_contiguous() and vc.is_contiguous()
    windowed.write_blocks(d, torch.tensor([2, 0]), windowed.read_blocks(c, torch.tensor([1, 3])))
    for (kc, vc), (kd, vd) in zip(c, d):
        assert torch.equal(kc[[1, 3]], kd[[2, 0]]) and torch.equal(vc[[1, 3]], vd[[2, 0]])
    with pytest.raises(ValueError, match="re-rotated"):
        fmt.rerotate_keys(a, ids, torch.zeros(3, 16), torch.zeros(3, 16), torch.zeros(4, 16))


def test_partial_prefix_hits_only_with_a_one_group_window(tiny: Path) -> None:
    """A window of several groups would read a copied block's slots, which hold
    the other sequence's last groups: such layouts take whole-block hits only."""
    one = _engine(
        tiny, kv_cache_dtype="kivi2", block_size=16, kivi_group_size=4, kivi_residual_length=4
    )
    wide = _engine(
        tiny, kv_cache_dtype="kivi2", block_size=16, kivi_group_size=4, kivi_residual_length=8
    )
    assert one.kv.partial_granularity == 4
    assert wide.kv.partial_granularity == 0


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Head size 64 (the native KIVI kernel's fast body), GQA 4:2."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("kivi64"),
        "llama",
        vocab_size=49152,
        hidden_size=128,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.mark.parametrize("head", ["tiny", "tiny64"])
@pytest.mark.parametrize(
    "kivi",
    [
        {"kv_cache_dtype": "kivi4", "block_size": 64, "kivi_group_size": 8},
        {
            "kv_cache_dtype": "kivi2",
            "block_size": 64,
            "kivi_group_size": 4,
            "kivi_residual_length": 8,
            "kivi_sink_tokens": 4,
        },
    ],
    ids=["kivi4", "kivi2_window_sinks"],
)
def test_fused_decode_step_is_the_per_layer_path_bit_for_bit(
    head: str, kivi: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    """Under block-quantized linears KIVI decode steps run the fused native step,
    whose C store (csrc/cpu_kivi.c fuel_kivi_store_row) and KIVI attention must
    leave every cache byte and every logprob exactly as the per-layer path (the
    torch store, the per-layer kernel) does: groups completed in decode steps,
    windows and sinks, several sequences of different lengths."""
    path = request.getfixturevalue(head)
    prompts = [list(range(100, 100 + n)) for n in (5, 23, 40)]
    runs = {}
    for step in ("fused", "per_layer"):
        eng = _engine(path, cpu_linear="q4_1", cpu_decode_step=step, **kivi)
        assert eng.info.decode_step == step
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30, logprobs=1))
        got: dict[str, list[tuple[int, float]]] = {}
        while eng.has_unfinished():
            for _, out in eng.step():
                for d in out.outputs:
                    got.setdefault(out.request_id, []).extend(
                        (t, lp.chosen.logprob)
                        for t, lp in zip(d.delta_token_ids, d.delta_logprobs or [])
                    )
        runs[step] = (got, [(k.clone(), v.clone()) for k, v in eng.runner.kv_caches])
    (fused, fc), (layered, lc) = runs["fused"], runs["per_layer"]
    assert all(len(v) == 30 for v in fused.values())
    assert fused == layered
    for (kf, vf), (kl, vl) in zip(fc, lc):
        assert torch.equal(kf, kl) and torch.equal(vf, vl)
