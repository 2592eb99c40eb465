"""Low-rank keys (--kv-low-rank-keys, engine/kv/low_rank.py): the basis, the
format, attention in the basis against its reference, and the engine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.kv.format import PlainKVFormat
from engine.kv.low_rank import KeyBasis, basis_from_samples
from engine.llm_engine import LLMEngine
from kernels.cpu_native import CpuKernels
from tests.conftest import default_gguf_path
from tests.differential import assert_same, make_cases, run_alone
from tests.model_utils import make_tiny_checkpoint, prefill_metadata

EXACT: dict[str, Any] = {"cpu_linear": "onednn", "kv_cache_dtype": "float32"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Head size 16, 2 KV heads, 4 query heads (GQA), the default model's vocabulary.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("lowrank"), "llama", vocab_size=49152)


def _config(tiny: Path, **kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        model=str(tiny),
        tokenizer=str(default_gguf_path()),
        kv_cache_memory=4 << 20,
        block_size=4,
        debug_invariants=True,
        **EXACT,
    )
    return EngineConfig(**{**base, **kw})


def _engine(tiny: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(_config(tiny, **kw))


# ---------------------------------------------------------------- the basis


def _samples(rank_of_keys: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Queries (4 heads) and keys (2 KV heads) of 3 layers, head size 16; each
    KV head's keys vary in ``rank_of_keys`` directions around a large mean."""
    gen = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    for _ in range(3):
        w = torch.randn(2, rank_of_keys, 16, generator=gen)
        z = torch.randn(400, 2, rank_of_keys, generator=gen) * torch.linspace(3, 0.5, rank_of_keys)
        mu = 5 * torch.randn(2, 16, generator=gen)
        ks.append(torch.einsum("thr,hrd->thd", z, w) + mu)
        qs.append(torch.randn(400, 4, 16, generator=gen))
    return qs, ks


def _scores(q: torch.Tensor, k: torch.Tensor, basis: KeyBasis, layer: int, h: int) -> torch.Tensor:
    """Scores of KV head ``h``'s first query head against every key, through the basis."""
    qp, kp, mu = basis.projection(layer)
    return (q[:, 2 * h] @ qp[h]) @ ((k[:, h] - mu[h]) @ kp[h]).T


def test_full_rank_form_keeps_every_score_up_to_a_per_query_shift() -> None:
    qs, ks = _samples(16)
    basis = basis_from_samples(qs, ks, rank=16)
    for layer in range(3):
        torch.testing.assert_close(
            basis.query_proj[layer] @ basis.key_proj[layer].transpose(1, 2),
            torch.eye(16).expand(2, 16, 16),
            atol=1e-4,
            rtol=0,
        )
        for h in range(2):
            got = _scores(qs[layer], ks[layer], basis, layer, h)
            want = qs[layer][:, 2 * h] @ ks[layer][:, h].T
            # Equal up to a constant per query (row): softmax sees the same thing.
            torch.testing.assert_close(got - got[:, :1], want - want[:, :1], atol=2e-3, rtol=1e-4)
            e = basis.energy[layer, h]
            assert bool((e[:-1] >= e[1:]).all())
    assert basis.with_rank(16).kept_energy() == pytest.approx(1.0)


def test_rank_r_form_is_exact_for_rank_r_keys_and_nested() -> None:
    """Keys that vary in 4 directions: rank 4 keeps every score (up to the shift);
    rank 2 loses some and is rank 4's first two columns."""
    qs, ks = _samples(4, seed=1)
    basis = basis_from_samples(qs, ks, rank=4)
    assert basis.kept_energy() == pytest.approx(1.0, abs=1e-6)
    got = _scores(qs[0], ks[0], basis, 0, 1)
    want = qs[0][:, 2] @ ks[0][:, 1].T
    torch.testing.assert_close(got - got[:, :1], want - want[:, :1], atol=2e-3, rtol=1e-4)
    two = basis.with_rank(2)
    assert two.kept_energy() < 0.99
    assert torch.equal(two.projection(0)[1], basis.projection(0)[1][..., :2])
    lossy = _scores(qs[0], ks[0], two, 0, 1)
    assert float((lossy - lossy[:, :1] - (want - want[:, :1])).abs().max()) > 0.1


def test_basis_file_round_trip_and_shape_checks(tmp_path: Path) -> None:
    qs, ks = _samples(8)
    basis = basis_from_samples(qs, ks, rank=3)
    path = tmp_path / "b.keybasis"
    basis.save(path)
    back = KeyBasis.load(path, 5)
    for name in ("query_proj", "key_proj", "key_mean", "energy"):
        assert torch.equal(getattr(back, name), getattr(basis, name))
    assert back.rank == 5 and back.digest != basis.digest
    assert KeyBasis.load(path, 3).digest == basis.digest
    with pytest.raises(ValueError, match="between 1 and the head size"):
        KeyBasis.load(path, 17)
    with pytest.raises(ValueError, match="3 layers x 2 KV heads x head size 16"):
        back.check_model(4, 2, 16)
    (tmp_path / "junk").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read the key basis"):
        KeyBasis.load(tmp_path / "junk", 2)


# ---------------------------------------------------------------- the format


def test_format_key_rows_are_rank_wide_and_round_trip() -> None:
    fmt = PlainKVFormat(3, 4, 2, 16, torch.float32, key_dim=6, key_basis="abc")
    full = PlainKVFormat(3, 4, 2, 16, torch.float32)
    assert fmt.block_nbytes == 3 * 4 * 2 * (6 + 16) * 4
    assert full.block_nbytes / fmt.block_nbytes == pytest.approx(32 / 22)
    assert "kr6/abc" in fmt.describe() and fmt.describe() != full.describe()
    a, b = fmt.allocate(5, torch.device("cpu")), fmt.allocate(5, torch.device("cpu"))
    assert a[0][0].shape == (5, 4, 2, 6) and a[0][1].shape == (5, 4, 2, 16)
    gen = torch.Generator().manual_seed(1)
    for kc, vc in a:
        kc.copy_(torch.randn(kc.shape, generator=gen))
        vc.copy_(torch.randn(vc.shape, generator=gen))
    ids = torch.tensor([3, 0])
    data = fmt.read_blocks(a, ids)
    fmt.write_blocks(b, torch.tensor([1, 4]), data)
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka[3], kb[1]) and torch.equal(va[0], vb[4])
        assert torch.equal(kb[0], torch.zeros_like(kb[0]))
    cos_sin = torch.zeros(16, 16)
    pos = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot be re-rotated"):
        fmt.rerotate_keys(a, torch.tensor([0]), pos, pos, cos_sin)


# ------------------------------------------------- attention in the basis


def _backends() -> list[Any]:
    return [TorchAttentionBackend(), CpuNativeAttentionBackend(CpuKernels.load())]


@pytest.mark.parametrize("backend", _backends(), ids=lambda b: b.name)
def test_attention_in_the_basis_matches_the_projected_reference(backend: Any) -> None:
    """Rank-r keys attended in the basis equal full attention over keys projected
    onto the basis' span (q . U U^T k), for decodes and chunks after cached
    context, GQA, across block boundaries."""
    gen = torch.Generator().manual_seed(2)
    hq, hkv, d, r, bs = 4, 2, 16, 5, 4
    u = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen))[0][..., :r]  # [Hkv, D, r]
    # Two sequences: a decode at length 11, a 6-token chunk after 7 cached tokens.
    seq_lens, qlens = [11, 13], [1, 6]
    tables = [[0, 1, 2], [3, 4, 5, 6]]
    total = [torch.randn(n, hkv, d, generator=gen) for n in seq_lens]
    vals = [torch.randn(n, hkv, d, generator=gen) for n in seq_lens]
    qs = [torch.randn(n, hq, d, generator=gen) for n in qlens]
    kc = torch.zeros(8, bs, hkv, r)
    vc = torch.zeros(8, bs, hkv, d)

    def proj(x: torch.Tensor) -> torch.Tensor:  # [T, Hkv, D] -> [T, Hkv, r]
        return torch.einsum("thd,hdr->thr", x, u)

    # The cached context, stored as the engine stores it.
    for s, (keys, vv, blocks) in enumerate(zip(total, vals, tables)):
        ctx = seq_lens[s] - qlens[s]
        for p in range(ctx):
            b, o = blocks[p // bs], p % bs
            kc[b, o] = proj(keys[p : p + 1])[0]
            vc[b, o] = vv[p]
    meta, _ = prefill_metadata(seq_lens, qlens, tables, bs)
    g = hq // hkv
    q_r = torch.cat([torch.einsum("thgd,hdr->thgr", q.view(-1, hkv, g, d), u) for q in qs])
    q_r = q_r.reshape(-1, hq, r)
    k_new = torch.cat([proj(k[-n:]) for k, n in zip(total, qlens)])
    v_new = torch.cat([v[-n:] for v, n in zip(vals, qlens)])
    scale = d**-0.5
    got = backend.forward(q_r, k_new, v_new, kc, vc, meta, scale)
    assert got.shape == (sum(qlens), hq, d)
    # Reference: full-width attention over keys projected onto span(U).
    p_mat = u @ u.transpose(1, 2)  # [Hkv, D, D]
    start = 0
    for s, n in enumerate(qlens):
        keys = torch.einsum("thd,hde->the", total[s], p_mat)
        ctx = seq_lens[s] - n
        mask = torch.arange(seq_lens[s])[None, :] <= torch.arange(ctx, seq_lens[s])[:, None]
        want = F.scaled_dot_product_attention(
            qs[s].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            vals[s].transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(got[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n


# ---------------------------------------------------------------- the engine


def test_full_rank_basis_is_the_full_rank_answer(tiny: Path) -> None:
    """rank = head size: U U^T is the identity, so answers and logprobs are
    the plain engine's (exact mode, within rounding); a lower rank stores
    narrower keys, changes the logprobs and keeps what it can of the energy."""
    cases = make_cases(3, 6, (17, 256), max_prompt=24, max_tokens=8)
    plain = run_alone(lambda **kw: _engine(tiny, **kw), cases)
    full = run_alone(lambda **kw: _engine(tiny, kv_low_rank_keys=16, **kw), cases)
    for i, (a, b) in enumerate(zip(full, plain)):
        assert_same(a, b, f"full-rank case {i}", atol=1e-4)
    low_eng = _engine(tiny, kv_low_rank_keys=4)
    assert low_eng.runner.kv_caches[0][0].shape[-1] == 4
    assert low_eng.runner.kv_caches[0][1].shape[-1] == 16
    assert low_eng.info.execution()["kv_key_rank"] == "4"
    low = run_alone(lambda **kw: _engine(tiny, kv_low_rank_keys=4, **kw), cases)
    diffs = [
        abs(x.chosen.logprob - y.chosen.logprob)
        for a, b in zip(low, plain)
        for x, y in zip(a.logprobs, b.logprobs)
        if x.chosen.token_id == y.chosen.token_id
    ]
    assert max(diffs) > 1e-3, "rank 4 of 16 changed nothing: keys are not projected"


def test_capacity_grows_by_the_key_ratio(tiny: Path) -> None:
    plain = _engine(tiny)
    low = _engine(tiny, kv_low_rank_keys=8)
    # Keys 8 wide instead of 16, values 16: 32 / 24 elements per token and head.
    assert low.info.kv_bytes_per_token / plain.info.kv_bytes_per_token == pytest.approx(24 / 32)
    assert low.info.num_blocks == pytest.approx(plain.info.num_blocks * 32 / 24, rel=0.01)
    assert low.info.cache_config()["kv_tokens"] == str(low.info.num_blocks * 4)


def test_basis_is_cached_beside_the_model_and_reused(
    tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _engine(tiny, kv_low_rank_keys=8)
    cached = sorted(tiny.glob("fuel-key-basis-*.keybasis"))
    assert cached, "no basis cached beside the model"
    with caplog.at_level(logging.INFO, logger="engine.kv.low_rank"):
        again = _engine(tiny, kv_low_rank_keys=6)
    assert "key basis from" in caplog.text and "calibrated" not in caplog.text
    # The cache is rank-independent: one file serves every rank.
    assert sorted(tiny.glob("fuel-key-basis-*.keybasis")) == cached
    assert again.key_basis is not None and again.key_basis.rank == 6
    # An explicit basis file wins, and its digest keys the disk fingerprint.
    again.key_basis.save(tmp_path / "mine.keybasis")
    explicit = _engine(
        tiny, kv_low_rank_keys=6, kv_low_rank_keys_file=str(tmp_path / "mine.keybasis")
    )
    assert explicit.key_basis is not None
    assert explicit.key_basis.digest == again.key_basis.digest
    fmt = explicit.runner.kv_format
    assert isinstance(fmt, PlainKVFormat) and fmt.key_basis == again.key_basis.digest[:16]


def test_a_different_calibration_text_gives_another_basis(tiny: Path, tmp_path: Path) -> None:
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    a = _engine(tiny, kv_low_rank_keys=8)
    b = _engine(tiny, kv_low_rank_keys=8, kv_low_rank_calibration=str(text))
    assert a.key_basis is not None and b.key_basis is not None
    assert a.key_basis.digest != b.key_basis.digest


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"kv_low_rank_keys": 8, "kv_cache_dtype": "kivi4", "block_size": 64}, "KIVI layout"),
        (
            {"kv_low_rank_keys": 8, "kv_policy": "h2o", "kv_budget_tokens": 64},
            "cannot be re-rotated",
        ),
        ({"kv_low_rank_keys": 8, "tensor_parallel_size": 2}, "tensor-parallel-size"),
        ({"kv_low_rank_keys": 8, "attention_backend": "triton"}, "Triton"),
        ({"kv_low_rank_keys_file": "x"}, "need --kv-low-rank-keys"),
        ({"kv_low_rank_calibration": "x"}, "need --kv-low-rank-keys"),
        ({"kv_low_rank_keys": 0}, "--kv-low-rank-keys: must be at least 1"),
    ],
)
def test_config_refusals(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_start_up_errors_that_need_the_model(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="between 1 and the head size \\(16\\)"):
        _engine(tiny, kv_low_rank_keys=17)
    with pytest.raises(ValueError, match="cannot read the key basis file"):
        _engine(tiny, kv_low_rank_keys=8, kv_low_rank_keys_file=str(tmp_path / "missing"))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="at least 64 are needed"):
        _engine(tiny, kv_low_rank_keys=8, kv_low_rank_calibration=str(short))
    with pytest.raises(ValueError, match="cannot read --kv-low-rank-calibration"):
        _engine(tiny, kv_low_rank_keys=8, kv_low_rank_calibration=str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="not in the native step"):
        _engine(tiny, kv_low_rank_keys=8, cpu_linear="q4_1", cpu_decode_step="fused")
    other = make_tiny_checkpoint(tmp_path, "llama", vocab_size=49152, num_hidden_layers=3)
    eng = _engine(tiny, kv_low_rank_keys=8)
    assert eng.key_basis is not None
    eng.key_basis.save(tmp_path / "two_layers.keybasis")
    with pytest.raises(ValueError, match="the model has 3"):
        _engine(
            other, kv_low_rank_keys=8, kv_low_rank_keys_file=str(tmp_path / "two_layers.keybasis")
        )
