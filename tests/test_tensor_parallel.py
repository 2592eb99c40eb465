"""Tensor parallelism (engine/parallel/): sharding, parity with one rank, loud failure.

The sharding tests are exact and in-process: every rank's slices put back
together give the full tensors, the vocabulary-parallel embedding's per-rank
lookups sum to the full lookup, row-parallel partial products sum to the full
product. The engine tests start real worker processes (gloo on the CPU) on
tiny checkpoints: greedy tokens identical to one rank and logprobs within the
differential suite's tolerance (tests/test_differential.py's ``tp2`` axis runs
the standard cases in every mode); a worker killed or stopped makes the next
step fail within a bounded time, never hang; the server answers 503 and exits
non-zero.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F
from fastapi.testclient import TestClient

from engine.config import EngineConfig
from engine.errors import WorkerDiedError
from engine.llm_engine import LLMEngine
from engine.models.config import ModelConfig
from engine.parallel.sharding import (
    RowParallel,
    ShardSpec,
    VocabParallelEmbedding,
    check_tensor_parallel,
    local_model_config,
    shard_tensor,
)
from server.app import build_app
from server.config import ServerConfig
from tests.conftest import default_gguf_path
from tests.differential import LOGPROB_ATOL, Case, Submission, assert_same, drive, greedy_params
from tests.live_server import live_server
from tests.model_utils import make_tiny_checkpoint
from tests.server_fakes import FakeEngine

MC = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=3 * 2,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=True,
    o_proj_bias=True,
)


class Identity:
    """A one-rank 'all-reduce': leaves the tensor as it is (tests sum by hand)."""

    def all_reduce(self, t: torch.Tensor) -> None:
        return None


def _full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash(name) % 1000)
    hd, h, kv, i, d = MC.head_dim, 4, 2, 12, 8
    shapes = {
        "model.embed_tokens.weight": (10, d),
        "lm_head.weight": (10, d),
        "model.norm.weight": (d,),
        "model.layers.0.self_attn.q_proj.weight": (h * hd, d),
        "model.layers.0.self_attn.q_proj.bias": (h * hd,),
        "model.layers.0.self_attn.k_proj.weight": (kv * hd, d),
        "model.layers.0.self_attn.v_proj.weight": (kv * hd, d),
        "model.layers.0.self_attn.o_proj.weight": (d, h * hd),
        "model.layers.0.self_attn.o_proj.bias": (d,),
        "model.layers.0.mlp.gate_proj.weight": (i, d),
        "model.layers.0.mlp.up_proj.weight": (i, d),
        "model.layers.0.mlp.down_proj.weight": (d, i),
        "model.layers.0.input_layernorm.weight": (d,),
    }
    return torch.randn(shapes[name], generator=g)


@pytest.mark.parametrize("world", [2, 4])
def test_shards_put_back_together_are_the_full_tensors(world: int) -> None:
    if world == 4:  # 2 KV heads cannot split 4 ways: the config says so
        with pytest.raises(ValueError, match="num_key_value_heads \\(2\\) is not divisible by 4"):
            check_tensor_parallel(MC, world)
        return
    specs = [ShardSpec(MC, r, world) for r in range(world)]
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]:  # column-parallel: output rows split
        full = _full(name)
        parts = [shard_tensor(s, name, full) for s in specs]
        assert all(p.shape[0] == full.shape[0] // world for p in parts)
        assert torch.equal(torch.cat(parts), full), name
    for name in ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"]:
        full = _full(name)  # row-parallel: input columns split
        assert torch.equal(torch.cat([shard_tensor(s, name, full) for s in specs], dim=1), full)
    bias = _full("model.layers.0.self_attn.o_proj.bias")
    parts = [shard_tensor(s, "model.layers.0.self_attn.o_proj.bias", bias) for s in specs]
    assert torch.equal(parts[0], bias) and not parts[1].any()  # added once, by rank 0
    for name in ["model.norm.weight", "model.layers.0.input_layernorm.weight"]:
        full = _full(name)
        assert all(shard_tensor(s, name, full) is full for s in specs)  # replicated


def test_vocabulary_shards_pad_the_last_one() -> None:
    """10 rows over 4 ranks: shards of 3 rows, the last holds row 9 and two zero rows."""
    mc = replace(MC, num_attention_heads=4, num_key_value_heads=4, intermediate_size=12)
    full = _full("lm_head.weight")
    specs = [ShardSpec(mc, r, 4) for r in range(4)]
    parts = [shard_tensor(s, "lm_head.weight", full) for s in specs]
    assert [p.shape[0] for p in parts] == [3, 3, 3, 3]
    assert torch.equal(torch.cat(parts)[:10], full)
    assert not parts[3][1:].any()
    assert local_model_config(mc, 4).vocab_size == 3


def test_vocab_parallel_lookups_sum_to_the_full_lookup() -> None:
    full = _full("model.embed_tokens.weight")
    ids = torch.tensor([0, 4, 5, 9, 3, 3])
    total = torch.zeros(len(ids), full.shape[1])
    for r in range(2):
        spec = ShardSpec(MC, r, 2)
        emb = torch.nn.Embedding(spec.vocab_shard, full.shape[1])
        emb.weight.data = shard_tensor(spec, "model.embed_tokens.weight", full)
        out = VocabParallelEmbedding(emb, spec.vocab_start, Identity())(ids)
        own = (ids >= spec.vocab_start) & (ids < spec.vocab_start + spec.vocab_shard)
        assert not out[~own].any()  # tokens of the other shard embed to zeros
        total += out
    assert torch.equal(total, F.embedding(ids, full))


def test_row_parallel_partial_products_sum_to_the_full_product() -> None:
    name = "model.layers.0.self_attn.o_proj"
    w, b = _full(f"{name}.weight"), _full(f"{name}.bias")
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    total = torch.zeros(5, w.shape[0])
    for r in range(2):
        spec = ShardSpec(MC, r, 2)
        lin = torch.nn.Linear(w.shape[1] // 2, w.shape[0])
        lin.weight.data = shard_tensor(spec, f"{name}.weight", w)
        lin.bias.data = shard_tensor(spec, f"{name}.bias", b)
        cols = slice(r * w.shape[1] // 2, (r + 1) * w.shape[1] // 2)
        total += RowParallel(lin, Identity())(x[:, cols])
    torch.testing.assert_close(total, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_unsupported_combinations_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="Mixture-of-Experts"):
        check_tensor_parallel(
            replace(MC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4), 2
        )
    with pytest.raises(ValueError, match="intermediate_size \\(12\\) is not divisible by 8"):
        check_tensor_parallel(replace(MC, num_attention_heads=8, num_key_value_heads=8), 8)
    with pytest.raises(ValueError, match="host KV tier"):
        EngineConfig(tensor_parallel_size=2, kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="--cpu-decode-step fused"):
        EngineConfig(tensor_parallel_size=2, cpu_decode_step="fused")


def test_an_indivisible_model_fails_the_engine_start(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=1)
    with pytest.raises(ValueError, match="num_key_value_heads \\(1\\) is not divisible by 2"):
        _engine(ckpt, tensor_parallel_size=2)


# ------------------------------------------------------------------ real ranks

CASES = [Case((20, 31, 42, 53, 64, 75, 86), 6), Case((90, 91), 5), Case(tuple(range(17, 50)), 4)]


def _engine(ckpt: Path, **kw: Any) -> LLMEngine:
    base: dict[str, Any] = dict(
        model=str(ckpt),
        tokenizer=str(default_gguf_path()),
        block_size=4,
        kv_cache_memory=4 << 20,
        cpu_linear="onednn",
        kv_cache_dtype="float32",
        debug_invariants=True,
    )
    return LLMEngine(EngineConfig(**{**base, **kw}))


def _subs() -> list[Submission]:
    return [Submission(f"r{i}", list(c.prompt), greedy_params(c)) for i, c in enumerate(CASES)]


def test_qwen3_with_biases_and_tied_embeddings_on_two_ranks_matches_one(tmp_path: Path) -> None:
    """Per-head q/k norms, q/k/v biases and an o_proj bias (kept on rank 0 only),
    tied embeddings (the vocabulary shard is also the logits shard), batched:
    the same greedy answer as one rank."""
    ckpt = make_tiny_checkpoint(
        tmp_path, "qwen3", attention_bias=True, tie_word_embeddings=True, vocab_size=49152
    )
    one = _engine(ckpt)
    want = drive(one, _subs())
    one.close()
    two = _engine(ckpt, tensor_parallel_size=2)
    try:
        assert "tensor_parallel_size=2" in two.describe()
        got = drive(two, _subs())
    finally:
        two.close()
    for rid in want:
        assert_same(got[rid][0], want[rid][0], rid, atol=LOGPROB_ATOL)


def test_speculative_decoding_on_two_ranks_matches_one_rank(tmp_path: Path) -> None:
    """The self-draft runs on rank 0 alone (its own unsharded model); verification
    and rejected drafts' KV go through both ranks: the greedy answer stays."""
    ckpt = make_tiny_checkpoint(tmp_path, "llama", vocab_size=49152)
    one = _engine(ckpt)
    want = drive(one, _subs())
    one.close()
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
    two = _engine(ckpt, tensor_parallel_size=2, speculative_config=spec)
    try:
        got = drive(two, _subs())
        assert two.speculator is not None
        stats = two.speculator.stats
        assert stats.num_accepted_tokens > 0
        assert stats.num_draft_tokens > stats.num_accepted_tokens  # some were rejected
    finally:
        two.close()
    for rid in want:
        assert_same(got[rid][0], want[rid][0], rid, atol=LOGPROB_ATOL)


def _wait_for(cond: Any, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_killed_worker_fails_the_engine_at_once(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "llama", vocab_size=49152)
    eng = _engine(ckpt, tensor_parallel_size=2)
    try:
        assert eng.tp is not None
        drive(eng, _subs()[:1])  # serving
        worker = eng.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        _wait_for(lambda: eng.tp is not None and eng.tp.failure is not None, 5.0)
        assert "rank 1" in (eng.tp.failure or "") and "-9" in (eng.tp.failure or "")
        with pytest.raises(WorkerDiedError, match="rank 1"):
            eng.check_health()
        eng.add_request("late", [20, 21], greedy_params(CASES[0]))
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError):
            eng.step()
        assert time.monotonic() - t0 < 5.0
    finally:
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 15.0


def test_a_stopped_worker_times_the_step_out(tmp_path: Path) -> None:
    """A rank that stops answering (not dead: no sentinel fires) cannot hang the
    engine: the collective times out after --tp-timeout-s and the step fails."""
    ckpt = make_tiny_checkpoint(tmp_path, "llama", vocab_size=49152)
    eng = _engine(ckpt, tensor_parallel_size=2, tp_timeout_s=2.0)
    assert eng.tp is not None
    worker = eng.tp.procs[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        eng.add_request("r", [20, 21, 22], greedy_params(CASES[0]))
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="step failed"):
            eng.step()
        assert time.monotonic() - t0 < 10.0
        with pytest.raises(WorkerDiedError):
            eng.check_health()
    finally:
        eng.close()  # kills the stopped rank
        assert not worker.is_alive()


def test_health_turns_503_when_the_engine_fails() -> None:
    engine = FakeEngine()
    reasons: list[str] = []
    app = build_app(engine, ServerConfig(), on_fatal=reasons.append)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        engine.fatal_error = "WorkerDiedError: tensor-parallel worker rank 1 exited with code -9"
        r = client.get("/health")
        assert r.status_code == 503
        assert "rank 1 exited" in r.json()["error"]["message"]
        _wait_for(lambda: bool(reasons), 3.0)
    assert reasons == [engine.fatal_error]


@pytest.mark.slow
def test_server_exits_non_zero_when_a_worker_dies(tmp_path: Path) -> None:
    """The real CLI with --tensor-parallel-size 2: a worker killed while serving
    makes the server exit 1 with the reason, and the worker's peer goes too."""
    ckpt = make_tiny_checkpoint(tmp_path, "llama", vocab_size=49152)
    flags = [str(ckpt), "--tokenizer", str(default_gguf_path())]
    flags += ["--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB"]
    log = tmp_path / "server.log"
    with live_server(flags, log) as (proc, base):
        body = {"model": str(ckpt), "prompt": "hi", "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        # The rank's process (multiprocessing spawn), not the resource tracker.
        workers = [int(c) for c in children if "spawn_main" in _cmdline(int(c))]
        assert len(workers) == 1, children
        os.kill(workers[0], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    assert "the engine failed" in log.read_text()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
