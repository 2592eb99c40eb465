"""The engine end to end on tiny random checkpoints and the default model.

Greedy outputs must be token-identical to Hugging Face transformers on the
same weights, alone and inside a batch of other requests of different lengths
arriving at different steps (continuous batching, chunked prefill, prefix
cache). Block accounting is checked after every step (debug_invariants).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams
from engine.worker.cuda_graphs import batch_size_ladder
from tests.conftest import default_gguf_path
from tests.model_utils import TINY_ARCHS, make_tiny_checkpoint

GEN = 12
# Exact mode: float32 weights and KV cache, token-identical to transformers.
EXACT: dict[str, object] = {"cpu_linear": "onednn", "kv_cache_dtype": "float32"}


def hf_greedy(model_dir: Path | str | Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation; ``model_dir`` is a checkpoint dir or a loaded model."""
    from transformers import AutoModelForCausalLM

    if isinstance(model_dir, str | Path):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        model.eval()
    else:
        model = model_dir
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def tiny_engine(model_dir: Path, **kw: object) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        tokenizer=str(default_gguf_path()),
        block_size=4,
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 32),  # type: ignore[arg-type]
        debug_invariants=True,
        **kw,  # type: ignore[arg-type]
    )
    return LLMEngine(cfg)


def greedy(max_tokens: int = GEN) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_batched(eng: LLMEngine, target: list[int], seed: int) -> list[int]:
    """Run ``target`` with 8 other requests joining at different steps."""
    rng = random.Random(seed)
    tokens: dict[str, list[int]] = {}
    arrivals = sorted(rng.randrange(0, 6) for _ in range(8))
    others = [[rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    eng.add_request("target", target, greedy())
    step = 0
    pending = list(zip(arrivals, others))
    while eng.has_unfinished() or pending:
        while pending and pending[0][0] <= step:
            _, prompt = pending.pop(0)
            eng.add_request(f"o{len(pending)}", prompt, greedy(rng.randrange(1, GEN)))
        for _, out in eng.step():
            for d in out.outputs:
                tokens.setdefault(out.request_id, []).extend(d.delta_token_ids)
        step += 1
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    return tokens["target"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tiny")
    dirs = {a: make_tiny_checkpoint(base, a) for a in TINY_ARCHS}
    dirs["llama-tied"] = make_tiny_checkpoint(base, "llama", tie_word_embeddings=True)
    return dirs


@pytest.mark.parametrize("arch", [*TINY_ARCHS, "llama-tied"])
def test_greedy_matches_transformers_alone_and_batched(
    tiny_dirs: dict[str, Path], arch: str
) -> None:
    model_dir = tiny_dirs[arch]
    prompt = [random.Random(arch).randrange(3, 250) for _ in range(23)]
    want = hf_greedy(model_dir, prompt, GEN)
    eng = tiny_engine(model_dir, **EXACT)
    alone = LLM(engine=eng).generate([prompt], greedy())[0].token_ids
    assert alone == want
    assert run_batched(eng, prompt, seed=1) == want
    # Small chunks force chunked prefill across block boundaries.
    eng_small = tiny_engine(model_dir, max_num_batched_tokens=5, **EXACT)
    assert run_batched(eng_small, prompt, seed=2) == want


@pytest.mark.parametrize("cpu_linear", ["onednn", "q4_1"])
def test_float16_kv_cache_and_q4_1_linears_run_batched(
    tiny_dirs: dict[str, Path], cpu_linear: str
) -> None:
    """--kv-cache-dtype float16 (and --cpu-linear q4_1) through the whole engine:
    float16 caches, batched and chunked runs agree with the same engine alone,
    and the answer starts like the float32 model's (random tiny weights have
    near-tied logits, so only a prefix is held)."""
    model_dir = tiny_dirs["llama"]
    prompt = [random.Random(11).randrange(3, 250) for _ in range(23)]
    want = hf_greedy(model_dir, prompt, GEN)
    eng = tiny_engine(model_dir, kv_cache_dtype="float16", cpu_linear=cpu_linear)
    assert all(k.dtype == torch.float16 for k, _ in eng.runner.kv_caches)
    alone = LLM(engine=eng).generate([prompt], greedy())[0].token_ids
    assert alone[:2] == want[:2]
    if cpu_linear == "onednn":
        assert alone == want
    # Batching must not change a sequence's tokens: exact linears, and q4_1
    # wherever every batch size runs the native kernel (it computes each row
    # the same way whatever the batch; builds without VNNI switch to fp16
    # weights above 8 rows).
    batched = run_batched(eng, prompt, seed=1)
    assert batched[:2] == want[:2]
    if cpu_linear == "onednn" or getattr(eng.linear_strategy, "max_native_rows", 0) is None:
        assert batched == alone
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    with pytest.raises(ValueError, match=r"--kv-cache-dtype: .fp8. is not one of"):
        tiny_engine(model_dir, kv_cache_dtype="fp8")


def _tokens_and_logprobs(
    eng: LLMEngine, prompts: list[list[int]], n: int
) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs, all prompts together (a batched decode)."""
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    outs = LLM(engine=eng).generate(prompts, p)
    return [(o.token_ids, [lp.chosen.logprob for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize(
    ("arch", "cpu_linear", "kv"),
    [
        ("llama", "q4_1", "float16"),
        ("llama-tied", "q4_1", "float32"),
        ("qwen2", "q4_1", "float16"),  # q/k/v biases
        ("mistral", "q8_0", "float16"),
    ],
)
def test_fused_decode_step_matches_per_layer(
    tiny_dirs: dict[str, Path], arch: str, cpu_linear: str, kv: str
) -> None:
    """The native decode step (every layer in one call) gives bit for bit the
    per-layer forward's tokens and logprobs, alone and batched, across block
    boundaries and chunked prefills."""
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(5 + 9 * i)] for i in range(4)]
    runs = {}
    for mode in ("fused", "per_layer"):
        eng = tiny_engine(
            tiny_dirs[arch],
            cpu_linear=cpu_linear,
            kv_cache_dtype=kv,
            cpu_decode_step=mode,
            max_num_batched_tokens=16,
        )
        assert eng.info.decode_step == mode and eng.info.cpu_linear == cpu_linear
        assert (eng.runner.native_step is not None) == (mode == "fused")
        runs[mode] = _tokens_and_logprobs(eng, prompts[:1], GEN) + _tokens_and_logprobs(
            eng, prompts, GEN
        )
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert runs["fused"] == runs["per_layer"]


def test_execution_path_resolution(tiny_dirs: dict[str, Path]) -> None:
    """auto: a float checkpoint runs oneDNN float32 linears with a float16 cache
    (the native attention backend) and layer by layer; the fused step needs
    block-quantized linears and no per-head q/k norms; the exact flags are exact."""
    eng = tiny_engine(tiny_dirs["llama"])
    assert eng.info.execution() == {
        "device": "cpu",
        "dtype": "float32",
        "cpu_linear": "onednn",
        "kv_cache_dtype": "float16",
        "attention": "cpu",
        "decode_step": "per_layer",
        "kv_policy": "full",
        "kv_key_rank": "full",
    }
    assert "cpu_linear=onednn kv_cache_dtype=float16" in eng.describe()
    exact = tiny_engine(tiny_dirs["llama"], **EXACT)
    assert exact.linear_strategy.exact and exact.info.kv_cache_dtype == torch.float32
    torch_attn = tiny_engine(tiny_dirs["llama"], attention_backend="torch")
    assert torch_attn.info.kv_cache_dtype == torch.float32  # only the native backend reads fp16
    qwen3 = tiny_engine(tiny_dirs["qwen3"], cpu_linear="q4_1")
    assert qwen3.info.decode_step == "per_layer"
    with pytest.raises(ValueError, match="q/k norms"):
        tiny_engine(tiny_dirs["qwen3"], cpu_linear="q4_1", cpu_decode_step="fused")
    with pytest.raises(ValueError, match="block-quantized"):
        tiny_engine(tiny_dirs["llama"], cpu_decode_step="fused")


def test_prefix_cache_on_off_identical(tiny_dirs: dict[str, Path]) -> None:
    base = [random.Random(5).randrange(3, 250) for _ in range(30)]
    prompts = [[*base, 7, 8, 9], [*base, 10], base[:17], [*base, 7, 8, 9]]
    on = tiny_engine(tiny_dirs["qwen2"])
    off = tiny_engine(tiny_dirs["qwen2"], enable_prefix_caching=False)
    # Sequentially (cached by an earlier request) and concurrently.
    seq_on = [LLM(engine=on).generate([p], greedy())[0].token_ids for p in prompts]
    seq_off = [LLM(engine=off).generate([p], greedy())[0].token_ids for p in prompts]
    assert seq_on == seq_off
    assert on.kv.prefix_hits > 0 and off.kv.prefix_hits == 0
    # vLLM's cache_config_info label says which (routers and dashboards read it).
    assert on.info.cache_config()["enable_prefix_caching"] == "True"
    assert off.info.cache_config()["enable_prefix_caching"] == "False"
    conc_on = [r.token_ids for r in LLM(engine=on).generate(prompts, greedy())]
    assert conc_on == seq_off


def test_preemption_gives_identical_output(tiny_dirs: dict[str, Path]) -> None:
    model_dir = tiny_dirs["llama"]
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(12 + i)] for i in range(4)]
    want = [r.token_ids for r in LLM(engine=tiny_engine(model_dir)).generate(prompts, greedy(16))]
    # 14 blocks of 4 tokens: four requests growing to ~30 tokens must preempt.
    eng = tiny_engine(model_dir, num_gpu_blocks_override=14)
    got = [r.token_ids for r in LLM(engine=eng).generate(prompts, greedy(16))]
    assert eng.scheduler.num_preemptions > 0
    assert got == want
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_n_seed_stop_and_logprobs(tiny_dirs: dict[str, Path]) -> None:
    eng = tiny_engine(tiny_dirs["mistral"])
    llm = LLM(engine=eng)
    prompt = list(range(10, 40))
    p = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=8, ignore_eos=True, logprobs=2)
    a = llm.generate([prompt], p)
    b = llm.generate([prompt], p)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) > 1  # choices differ (seed + index)
    assert all(len(r.logprobs) == 8 and len(r.logprobs[0].top) == 2 for r in a)
    # The same seeded request inside a different batch gives the same tokens.
    c = llm.generate([list(range(50, 60)), prompt], [greedy(), p])
    assert [r.token_ids for r in c[1:]] == [r.token_ids for r in a]


def test_stop_string_never_leaks(tiny_dirs: dict[str, Path]) -> None:
    eng = tiny_engine(tiny_dirs["llama"])
    llm = LLM(engine=eng)
    prompt = list(range(20, 35))
    full = llm.generate([prompt], greedy(20))[0]
    text = full.text
    if len(text) < 6:
        pytest.skip("tiny model produced too little text")
    stop = text[3:6]
    cut = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 20),  # tokens shared with the common prefix
            st.integers(1, 10),  # own tokens after it
            st.integers(1, 10),  # max_tokens
            st.integers(1, 3),  # n
            st.sampled_from(["run", "abort", "stop"]),
        ),
        min_size=1,
        max_size=10,
    ),
    st.integers(0, 3),
)
def test_block_accounting_random_arrivals_aborts_stops(
    tiny_dirs: dict[str, Path], reqs: list[tuple[int, int, int, int, str]], when: int
) -> None:
    """Prompts share prefixes (prefix cache hits, n > 1 choices sharing the prompt), arrive
    between steps, are aborted or stopped; every block comes back. Every request fits the
    cache on its own (64 blocks of 4), so an add that raises is a bug, not an expected 400;
    together they overflow it, so preemption runs too."""
    eng = tiny_engine(
        tiny_dirs["llama"],
        num_gpu_blocks_override=64,
        max_num_batched_tokens=16,
        # Admission's 429 (kv_pressure) has its own tests; here every add must succeed.
        kv_pressure_preemptions_per_s=1e9,
    )
    common = [(7 * j) % 250 + 3 for j in range(20)]
    for i, (shared, own, max_tokens, n, kind) in enumerate(reqs):
        stop = [" "] if kind == "stop" else []
        prompt = common[:shared] + [(i * 11 + j) % 250 + 3 for j in range(own)]
        eng.add_request(
            f"r{i}",
            prompt,
            SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens, stop=stop),
        )
        for _ in range(when):
            eng.step()
        if kind == "abort":
            eng.abort(f"r{i}")
    while eng.has_unfinished():
        eng.step()
    eng.scheduler.check_invariants()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert all(b.ref_count == 0 for b in eng.kv.pool.blocks)


def test_abort_returns_blocks(tiny_dirs: dict[str, Path]) -> None:
    eng = tiny_engine(tiny_dirs["llama"])
    eng.add_request("a", list(range(3, 30)), greedy(50))
    eng.step()
    eng.step()
    held = eng.kv.num_blocks - eng.kv.num_free_blocks
    assert held > 0
    out = eng.abort("a")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.slow
def test_default_gguf_greedy_matches_transformers(hf_gguf_model: Any) -> None:
    llm = LLM(
        EngineConfig(
            debug_invariants=True,
            kv_cache_memory=64 << 20,
            max_num_batched_tokens=64,
            cpu_linear="onednn",
            kv_cache_dtype="float32",
        )
    )
    assert llm.engine.info.execution()["cpu_linear"] == "onednn"
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}])
    want = hf_greedy(hf_gguf_model, prompt, 24)
    got = llm.generate([prompt], greedy(24))[0].token_ids
    assert got == want
    # Inside a batch with others arriving at different steps, chunked prefill (64).
    rng = random.Random(0)
    eng = llm.engine
    tokens: dict[str, list[int]] = {}
    eng.add_request("t", prompt, greedy(24))
    step = 0
    while eng.has_unfinished():
        if step < 8:
            eng.add_request(
                f"o{step}",
                [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 90))],
                greedy(rng.randrange(1, 20)),
            )
        for _, out in eng.step():
            for d in out.outputs:
                tokens.setdefault(out.request_id, []).extend(d.delta_token_ids)
        step += 1
    assert tokens["t"] == want


def test_request_traces_add_up_and_hold_no_text(tiny_dirs: dict[str, Path]) -> None:
    from engine.trace import (
        DecodeStep,
        PrefillChunk,
        QueueWait,
        review_for_publication,
        summarize_timings,
    )

    eng = tiny_engine(tiny_dirs["llama"], enable_request_traces=True, max_num_batched_tokens=8)
    eng.add_request("t", list(range(3, 23)), greedy(5))
    while eng.has_unfinished():
        eng.step()
    trace = eng.get_trace(["t"])
    assert trace is not None
    kinds = [type(e) for e in trace.events]
    assert kinds.count(PrefillChunk) == 3  # 20 prompt tokens in chunks of 8, 8, 4
    assert kinds.count(DecodeStep) == 4
    assert kinds[0] is QueueWait
    summary = summarize_timings(trace)
    assert summary.consistent and summary.e2e_ms is not None
    published = review_for_publication(trace)
    for private in ("prompt_text", "output_text", "prompt_token_ids", "output_token_ids", "user"):
        assert published.get(private) is None, private
    assert trace.prompt_token_ids is None and trace.output_token_ids is None


def test_structured_output_follows_schema(tiny_dirs: dict[str, Path]) -> None:
    import json

    from engine.sampling.params import StructuredOutputSpec

    eng = tiny_engine(tiny_dirs["qwen3"])
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    p = SamplingParams(
        temperature=1.0,
        seed=3,
        max_tokens=60,
        structured=StructuredOutputSpec(json_schema=schema),
        n=3,
    )
    plain = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    # Constrained and unconstrained requests share the same steps.
    results = LLM(engine=eng).generate([list(range(3, 20)), list(range(3, 20))], [p, plain])
    for r in results[:3]:
        assert r.finish_reason == "stop", r
        value = json.loads(r.text)
        assert (
            value["a"] in ("x", "yy") and isinstance(value["b"], bool) and set(value) == {"a", "b"}
        )
    assert results[3].finish_reason == "length"
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_profile_step_runs_the_largest_batch(tiny_dirs: dict[str, Path]) -> None:
    """The CUDA sizing pass runs on any device; here it must just run and leave no state."""
    eng = tiny_engine(tiny_dirs["llama"], max_num_seqs=3, max_num_batched_tokens=10)
    eng._profile_step(eng.info.device, eng.info.dtype, eng.info.max_model_len)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    assert eng.info.model_name == str(tiny_dirs["llama"])


class EmulatedGraph:
    """CPU stand-in for a CUDA graph: replay calls the recorded work again on the
    same buffers and writes the same output buffer, which is what a replay does."""

    def __init__(self) -> None:
        self.fn: Any = None
        self.out: torch.Tensor | None = None
        self.replays = 0

    def capture(self, fn: Any) -> torch.Tensor:
        self.fn = fn
        self.out = fn().clone()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        self.out.copy_(self.fn())
        self.replays += 1


def test_decode_graphs_match_eager(tiny_dirs: dict[str, Path]) -> None:
    """Decode-only steps replayed from graphs at padded ladder sizes (3 -> 4 rows, then
    2, then 1) give eager's tokens; mixed steps still run eagerly."""
    prompts = [[5, 9, 13], [7] * 11, [3, 4, 5, 6, 7, 8, 9]]
    lengths = [3, 6, 9]

    def run(graphs: bool) -> tuple[dict[str, list[int]], list[EmulatedGraph]]:
        eng = tiny_engine(tiny_dirs["llama"], attention_backend="triton", max_num_seqs=4)
        made: list[EmulatedGraph] = []
        if graphs:

            def factory() -> EmulatedGraph:
                made.append(EmulatedGraph())
                return made[-1]

            eng.runner.enable_decode_graphs([1, 2, 4], eng.info.max_model_len, factory)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            eng.add_request(str(i), p, greedy(n))
        toks: dict[str, list[int]] = {}
        while eng.has_unfinished():
            for _, out in eng.step():
                for d in out.outputs:
                    toks.setdefault(out.request_id, []).extend(d.delta_token_ids)
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        return toks, made

    eager, _ = run(False)
    graphed, made = run(True)
    assert graphed == eager and [len(eager[str(i)]) for i in range(3)] == lengths
    assert len(made) == 3 and all(g.replays > 0 for g in made)


def test_decode_graphs_need_a_graph_safe_backend(tiny_dirs: dict[str, Path]) -> None:
    eng = tiny_engine(tiny_dirs["llama"], attention_backend="torch")
    with pytest.raises(ValueError, match="cannot be captured"):
        eng.runner.enable_decode_graphs([1, 2], eng.info.max_model_len, EmulatedGraph)
    assert batch_size_ladder(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_size_ladder(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_size_ladder(1) == [1]


def test_fused_decode_step_refuses_what_it_cannot_read(tiny_dirs: dict[str, Path]) -> None:
    """The native step checks layouts and bounds before any raw pointer is read."""
    eng = tiny_engine(tiny_dirs["llama"], cpu_linear="q4_1")
    step = eng.runner.native_step
    assert step is not None
    h = eng.model_config.hidden_size
    x = torch.zeros(1, h)
    pos, slots = torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    bt, sl = torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    run = step.kernels.decode_step
    ok = {"max_position": 0, "max_slot": 0, "max_seq_len": 1}
    assert run(step.plan, x.clone(), pos, slots, bt, sl, **ok).shape == (1, h)
    with pytest.raises(ValueError, match="out of range"):
        run(step.plan, x.clone(), pos, slots, bt, sl, **{**ok, "max_position": 10**6})
    with pytest.raises(ValueError, match="out of range"):
        run(step.plan, x.clone(), pos, slots, bt, sl, **{**ok, "max_slot": eng.kv.num_blocks * 4})
    with pytest.raises(ValueError, match="layout"):
        run(step.plan, x.double(), pos, slots, bt, sl, **ok)
