"""Speculative decoding through the engine on tiny random checkpoints.

Greedy output (token ids and logprobs) must be identical with speculation on
and off, for n-gram drafting and for draft models (a different tiny model,
which is mostly rejected; the target's own checkpoint, which is always
accepted; the self-draft, the target's weights in Q4_1), alone and batched,
chunked, with prefix hits, after preemption, with stops, penalties, n > 1 and
grammars. Seeded sampling with n-gram drafts samples exactly what it samples
without speculation. Block accounting is checked after every step
(``debug_invariants``) and every block comes back at the end.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import PositionLogprobs
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from engine.spec_decode.controller import AdaptiveDraftPolicy
from engine.trace import DecodeStep
from tests.conftest import default_gguf_path
from tests.model_utils import make_tiny_checkpoint

LOGPROB_ATOL = 1e-4


@dataclass
class Out:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("spec")
    return {
        "target": make_tiny_checkpoint(base, "llama"),
        # Same vocabulary, different (random) weights: a deliberately bad draft.
        "draft": make_tiny_checkpoint(base, "llama", seed=1, num_hidden_layers=1),
        "short": make_tiny_checkpoint(base, "llama", seed=2, max_position_embeddings=32),
        "vocab": make_tiny_checkpoint(base, "llama", seed=3, vocab_size=300),
    }


def engine(dirs: dict[str, Path], spec: dict[str, Any] | None, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(
        model=str(dirs["target"]),
        tokenizer=str(default_gguf_path()),
        block_size=4,
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 64),
        debug_invariants=True,
        speculative_config=spec,
        **kw,
    )
    return LLMEngine(cfg)


def spec_configs(dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {
        "ngram1": {**ngram, "num_speculative_tokens": 1, "adaptive": False},
        "ngram4": {**ngram, "num_speculative_tokens": 4, "adaptive": False},
        "ngram_adaptive": {**ngram, "num_speculative_tokens": 5},
        "draft_bad3": {"model": str(dirs["draft"]), "num_speculative_tokens": 3, "adaptive": False},
        "draft_same4": {
            "model": str(dirs["target"]),
            "num_speculative_tokens": 4,
            "adaptive": False,
        },
        "self_q4_1_2": {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False},
    }


def run(
    eng: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    stagger: int = 0,
) -> list[list[Out]]:
    """Every prompt to completion (prompt ``i`` arriving at step ``i * stagger``)."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    outs = {f"p{i}": [Out() for _ in range(p.n)] for i, p in enumerate(plist)}
    pending = list(enumerate(zip(prompts, plist)))
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] * stagger <= step:
            i, (prompt, p) = pending.pop(0)
            eng.add_request(f"p{i}", list(prompt), p)
        for _, out in eng.step():
            for d in out.outputs:
                o = outs[out.request_id][d.index]
                o.token_ids.extend(d.delta_token_ids)
                o.logprobs.extend(d.delta_logprobs or [])
                o.text += d.delta_text
                o.finish_reason = d.finish_reason or o.finish_reason
        step += 1
        assert step < 10_000
    assert eng.kv.num_free_blocks == eng.kv.num_blocks, "blocks leaked"
    return [outs[f"p{i}"] for i in range(len(prompts))]


def assert_same(got: list[list[Out]], want: list[list[Out]], where: str) -> None:
    for i, (g_choices, w_choices) in enumerate(zip(got, want, strict=True)):
        for c, (g, w) in enumerate(zip(g_choices, w_choices, strict=True)):
            at = f"{where} prompt {i} choice {c}"
            assert g.token_ids == w.token_ids, f"{at}: {g.token_ids} != {w.token_ids}"
            assert g.text == w.text and g.finish_reason == w.finish_reason, at
            assert len(g.logprobs) == len(w.logprobs), at
            for gp, wp in zip(g.logprobs, w.logprobs):
                assert gp.chosen.token_id == wp.chosen.token_id, at
                assert abs(gp.chosen.logprob - wp.chosen.logprob) <= LOGPROB_ATOL, at
                for a, b in zip(gp.top, wp.top):
                    assert abs(a.logprob - b.logprob) <= LOGPROB_ATOL, at


def prompts_with_repeats(seed: int, count: int) -> list[list[int]]:
    """Prompts of mixed lengths, some repeating a pattern (n-gram lookup has matches),
    half sharing a prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(13)]
    out = []
    for i in range(count):
        if i % 3 == 0:
            pattern = [rng.randrange(3, 250) for _ in range(rng.randrange(2, 6))]
            out.append(pattern * rng.randrange(2, 6))
        elif i % 3 == 1:
            out.append(shared + [rng.randrange(3, 250) for _ in range(rng.randrange(0, 5))])
        else:
            out.append([rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))])
    return out


def greedy(max_tokens: int = 12, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2, **kw)


PROMPTS = prompts_with_repeats(0, 6)


@pytest.fixture(scope="module")
def reference(dirs: dict[str, Path]) -> dict[str, list[list[Out]]]:
    """Speculation off: each prompt alone, and the batch."""
    eng = engine(dirs, None, enable_prefix_caching=False)
    alone = [run(eng, [p], greedy())[0] for p in PROMPTS]
    return {"alone": alone}


@pytest.mark.parametrize(
    "name", ["ngram1", "ngram4", "ngram_adaptive", "draft_bad3", "draft_same4", "self_q4_1_2"]
)
def test_greedy_identical_alone_batched_chunked_cached_preempted(
    dirs: dict[str, Path], reference: dict[str, list[list[Out]]], name: str
) -> None:
    spec = spec_configs(dirs)[name]
    want = reference["alone"]
    eng = engine(dirs, spec)
    alone = [run(eng, [p], greedy())[0] for p in PROMPTS[:3]]
    assert_same(alone, want[:3], f"{name} alone")
    # Batched, arriving two steps apart, in a small step budget (prefill chunks share
    # steps with verification chunks; drafts are cut to the budget left).
    eng = engine(dirs, spec, max_num_batched_tokens=12)
    assert_same(run(eng, PROMPTS, greedy(), stagger=2), want, f"{name} batched chunked")
    # Prefix-cache hits: everything again in the same engine.
    hits = eng.kv.prefix_hits
    assert_same(run(eng, PROMPTS, greedy()), want, f"{name} warm")
    assert eng.kv.prefix_hits > hits
    # Preemption: a cache too small for the batch (drafts never preempt, but the
    # requests' own growth does).
    eng = engine(dirs, spec, num_gpu_blocks_override=16)
    assert_same(run(eng, PROMPTS, greedy()), want, f"{name} preempted")
    assert eng.scheduler.num_preemptions > 0
    st = eng.speculator.stats if eng.speculator else None
    assert st is not None and st.num_drafts > 0 and st.num_draft_tokens > 0
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens <= st.num_draft_tokens
    if name == "draft_same4":  # the target drafting for itself: every draft accepted
        assert st.num_accepted_tokens == st.num_draft_tokens
    if name in ("ngram4", "self_q4_1_2"):  # some drafts accepted, some rejected
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


def test_stops_penalties_bias_min_tokens_and_n(dirs: dict[str, Path]) -> None:
    """Everything that shapes a greedy answer gives the same answer with drafts:
    stop strings and tokens inside an accepted run end the request there."""
    eng_off = engine(dirs, None)
    off = run(eng_off, PROMPTS[:6], greedy(20))
    # Stop on a token that appears mid-answer, and on the text of a later token.
    stop_tok = off[0][0].token_ids[5]
    stop_str = eng_off.tokenizer.decode(off[3][0].token_ids[6:8])
    params = [
        greedy(20, stop_token_ids=[stop_tok]),
        greedy(20, frequency_penalty=1.5, presence_penalty=0.5),
        greedy(20, repetition_penalty=1.8, logit_bias={off[2][0].token_ids[1]: -100.0}),
        greedy(20, stop=[stop_str]),
        replace(greedy(20, min_tokens=10), ignore_eos=False, stop_token_ids=[stop_tok]),
        replace(greedy(12), n=3),
    ]
    want = run(engine(dirs, None), PROMPTS[:6], params)
    assert want[0][0].finish_reason == want[3][0].finish_reason == "stop"
    assert stop_str not in want[3][0].text and len(want[3][0].token_ids) < 20
    for name in ("ngram4", "draft_same4"):
        eng = engine(dirs, spec_configs(dirs)[name])
        assert_same(run(eng, PROMPTS[:6], params), want, name)
        assert eng.speculator is not None and eng.speculator.stats.num_accepted_tokens > 0


def test_grammar_rejects_forbidden_drafts_before_verification(dirs: dict[str, Path]) -> None:
    # A regex that allows exactly the unconstrained answer's text: with speculation
    # the answer is unchanged; drafts that leave the regex are cut before verification.
    eng = engine(dirs, None)
    free = run(eng, [PROMPTS[0]], greedy(10))[0][0]
    import re

    regex = re.escape(free.text) if free.text and "\ufffd" not in free.text else "[a-z ]{1,20}"
    params = replace(greedy(10), structured=StructuredOutputSpec(regex=regex))
    want = run(engine(dirs, None), PROMPTS[:3], params)
    for name in ("ngram4", "draft_same4", "self_q4_1_2"):
        eng = engine(dirs, spec_configs(dirs)[name])
        assert_same(run(eng, PROMPTS[:3], params), want, name)


def test_seeded_sampling_with_ngram_samples_what_plain_sampling_samples(
    dirs: dict[str, Path],
) -> None:
    # Deterministic drafts and a seed: each emitted position uses the noise plain
    # sampling would use, so the samples are the same, not just equally distributed.
    params = [
        SamplingParams(temperature=0.6, top_k=5, seed=100 + i, max_tokens=24, ignore_eos=True)
        for i in range(4)
    ]
    prompts = [[7, 8, 9] * 5, [5] * 12, PROMPTS[3], PROMPTS[4]]
    want = run(engine(dirs, None), prompts, params)
    eng = engine(dirs, spec_configs(dirs)["ngram4"])
    got = run(eng, prompts, params)
    assert [o[0].token_ids for o in got] == [o[0].token_ids for o in want]
    assert eng.speculator is not None and eng.speculator.stats.num_accepted_tokens > 0


def test_sampling_with_a_draft_model_is_seed_reproducible(dirs: dict[str, Path]) -> None:
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    spec = spec_configs(dirs)["self_q4_1_2"]
    first = run(engine(dirs, spec), PROMPTS[:3], params)
    second = run(engine(dirs, spec), PROMPTS[:3], params)
    assert [o[0].token_ids for o in first] == [o[0].token_ids for o in second]


def test_metrics_and_traces_count_drafts(dirs: dict[str, Path]) -> None:
    eng = engine(dirs, spec_configs(dirs)["draft_same4"], enable_request_traces=True)
    run(eng, PROMPTS[:2], greedy(20))
    st = eng.stats
    assert st.spec_decode_num_drafts > 0
    assert st.spec_decode_accepted_tokens == st.spec_decode_draft_tokens > 0
    assert sum(st.spec_decode_accepted_per_pos) == st.spec_decode_accepted_tokens
    assert st.spec_decode_accepted_per_pos[0] == st.spec_decode_num_drafts
    trace = eng.get_trace(["p0"])
    assert trace is not None
    steps = [e for e in trace.events if isinstance(e, DecodeStep)]
    assert sum(e.num_accepted_tokens for e in steps) > 0
    # Every output token is a decode step's sampled token or one of its accepted drafts.
    emitted = len(steps) + sum(e.num_accepted_tokens for e in steps)
    assert emitted == 20 - 1  # the first token comes from the prefill

    from server.metrics import Metrics

    m = Metrics("tiny")
    m.update_from_stats(st)
    text = m.render()[0].decode()
    assert (
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="tiny"}} {float(st.spec_decode_num_drafts)}'
        in text
    )
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="3"}'
        in text
    )


def test_draft_model_must_fit_the_target(dirs: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        engine(dirs, {"model": str(dirs["vocab"]), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="supports 32 positions"):
        engine(dirs, {"model": str(dirs["short"]), "num_speculative_tokens": 2})
    with pytest.raises(FileNotFoundError):
        engine(dirs, {"model": str(dirs["target"] / "nope"), "num_speculative_tokens": 2})


def test_self_draft_in_the_targets_own_linears_is_refused(dirs: dict[str, Path]) -> None:
    """A Q4_1 target with its Q4_1 self-draft would draft with itself: refused at
    start-up, naming the way out; an int8 self-draft of the same target runs."""
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False}
    with pytest.raises(ValueError, match=r"own q4_1 linears.*--cpu-linear onednn"):
        engine(dirs, spec, cpu_linear="q4_1")
    eng = engine(dirs, {**spec, "quantization": "int8"}, cpu_linear="q4_1")
    try:
        assert eng.speculator is not None
        assert eng.linear_strategy.name == "q4_1"
    finally:
        eng.close()


def test_plain_decode_table_only_where_verification_leaves_the_fused_step(
    dirs: dict[str, Path],
) -> None:
    """The native CPU backend splits verification chunks into decode rows of the
    fused step: one path, no P table. The torch backend does not split them, so
    they leave the fused step and P is measured (engine/spec_decode/controller.py)."""
    spec = spec_configs(dirs)["ngram_adaptive"]
    for backend, has_plain in (("auto", False), ("torch", True)):
        eng = engine(dirs, spec, cpu_linear="q4_1", attention_backend=backend)
        assert eng.runner.native_step is not None
        assert eng.speculator is not None
        policy = eng.speculator.policy
        assert isinstance(policy, AdaptiveDraftPolicy)
        assert (policy.plain_cost is not None) == has_plain, backend
