"""The differential exactness suite's machinery: cases, answers, axes, comparison.

An *axis* is one way of running the same greedy requests that must not change
their answer: alone, in a batch, chunked, from the prefix cache, after a
preemption, as one of n choices, under a grammar that allows the same text,
streamed or not through the server, ... A *mode* is an engine configuration
whose numerics legitimately differ (a KV format, a linear kernel); every axis
is compared with the reference answer computed in the same mode, by the
``alone`` runner with the prefix cache off.

What "the same answer" means (``assert_same``): identical generated token ids;
the chosen token's logprob and the top-k logprobs of every generated position,
and the prompt logprobs, within ``LOGPROB_ATOL`` (the sum order of matmuls and
attention differs with batch composition, so bit equality is not promised);
identical top-k token ids where the logprob gap to the next candidate exceeds
the tolerance.

A new engine feature adds its axis to ``AXES`` in tests/test_differential.py:
a name, the engine settings it turns on, and how it runs the cases (most reuse
``run_together``). The axes and tolerances are listed in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.llm_engine import LLMEngine
from engine.outputs import PositionLogprobs
from engine.sampling.params import SamplingParams, StructuredOutputSpec

# Logprobs are float32 log-softmax values of O(1) logits; batch composition
# moves them by ~1e-6 here. 1e-4 absolute is loose enough for any summation
# order and tight enough to catch a wrong position, token or cache block.
LOGPROB_ATOL = 1e-4
TOP_K = 3

EngineFactory = Callable[..., LLMEngine]


@dataclass(frozen=True)
class Case:
    """One greedy request: its prompt ids and how many tokens to generate."""

    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Answer:
    """Everything a greedy request gives back that an axis must not change."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def greedy_params(case: Case, *, n: int = 1, **kw: Any) -> SamplingParams:
    return SamplingParams(
        n=n,
        temperature=0.0,
        max_tokens=case.max_tokens,
        ignore_eos=True,
        logprobs=TOP_K,
        prompt_logprobs=TOP_K,
        **kw,
    )


def make_cases(
    seed: int, count: int, vocab: tuple[int, int], max_prompt: int, max_tokens: int
) -> list[Case]:
    """``count`` prompts of mixed lengths, about half sharing a long common prefix
    (so the prefix cache has partial and full hits), the rest random."""
    rng = random.Random(seed)
    lo, hi = vocab
    shared = [rng.randrange(lo, hi) for _ in range(max_prompt)]
    cases = []
    for i in range(count):
        if i % 2 == 0:
            cut = rng.randrange(max_prompt // 2, max_prompt)
            prompt = shared[:cut] + [rng.randrange(lo, hi) for _ in range(rng.randrange(0, 4))]
        else:
            prompt = [rng.randrange(lo, hi) for _ in range(rng.randrange(1, max_prompt))]
        cases.append(Case(tuple(prompt), rng.randrange(max_tokens // 2, max_tokens + 1)))
    return cases


# ------------------------------------------------------------------ driving the engine


@dataclass
class Submission:
    """A request to add: its id, prompt and params, and the step it arrives at."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    arrive_at_step: int = 0


def drive(eng: LLMEngine, subs: Sequence[Submission]) -> dict[str, list[Answer]]:
    """Run ``subs`` to completion (adding each at its step); answers per id, per choice."""
    answers: dict[str, list[Answer]] = {s.rid: [Answer() for _ in range(s.params.n)] for s in subs}
    pending = sorted(subs, key=lambda s: s.arrive_at_step)
    step = 0
    while pending or eng.has_unfinished():
        while pending and pending[0].arrive_at_step <= step:
            s = pending.pop(0)
            eng.add_request(s.rid, list(s.prompt), s.params)
        for _, out in eng.step():
            group = answers[out.request_id]
            if out.prompt_logprobs is not None:
                for a in group:
                    a.prompt_logprobs = list(out.prompt_logprobs)
            for d in out.outputs:
                a = group[d.index]
                a.token_ids.extend(d.delta_token_ids)
                a.text += d.delta_text
                a.logprobs.extend(d.delta_logprobs or [])
                if d.finish_reason is not None:
                    a.finish_reason = d.finish_reason
        step += 1
        if step > 100_000:
            raise AssertionError("the engine did not finish")
    assert eng.kv.num_free_blocks == eng.kv.num_blocks, "blocks leaked"
    return answers


def run_alone(make: EngineFactory, cases: Sequence[Case], **settings: Any) -> list[Answer]:
    """The reference: each case alone in a fresh engine state, no prefix cache."""
    eng = make(enable_prefix_caching=False, **settings)
    out = []
    for i, c in enumerate(cases):
        out.append(drive(eng, [Submission(f"r{i}", list(c.prompt), greedy_params(c))])[f"r{i}"][0])
    return out


def run_together(
    make: EngineFactory,
    cases: Sequence[Case],
    *,
    stagger: int = 0,
    n: int = 1,
    params: Callable[[Case, int], SamplingParams] | None = None,
    check: Callable[[LLMEngine], None] | None = None,
    **settings: Any,
) -> list[list[Answer]]:
    """All cases in one engine, arriving together (or ``stagger`` steps apart).

    Returns each case's choices. ``check`` sees the engine after the run
    (e.g. to assert that a preemption really happened).
    """
    eng = make(**settings)
    subs = [
        Submission(
            f"r{i}",
            list(c.prompt),
            params(c, i) if params is not None else greedy_params(c, n=n),
            arrive_at_step=i * stagger,
        )
        for i, c in enumerate(cases)
    ]
    got = drive(eng, subs)
    if check is not None:
        check(eng)
    return [got[f"r{i}"] for i in range(len(cases))]


def run_warm_cache(
    make: EngineFactory,
    cases: Sequence[Case],
    *,
    prompt_logprobs: bool = False,
    **settings: Any,
) -> list[list[Answer]]:
    """Each case twice in one engine: the second run is served from the prefix cache
    (full hits for repeated prompts, partial hits for prompts sharing a prefix).

    Without prompt logprobs the second run must hit the cache; with them the
    engine may use only hits that keep them exact (none on a first admission),
    and the answer must still be the reference's.
    """
    eng = make(**settings)

    def params(c: Case) -> SamplingParams:
        p = greedy_params(c)
        return p if prompt_logprobs else replace(p, prompt_logprobs=None)

    first = [Submission(f"w{i}", list(c.prompt), params(c)) for i, c in enumerate(cases)]
    drive(eng, first)
    hits_before = eng.kv.prefix_hits
    out = []
    for i, c in enumerate(cases):
        got = drive(eng, [Submission(f"r{i}", list(c.prompt), params(c))])
        out.append(got[f"r{i}"])
    if not prompt_logprobs:
        assert eng.kv.prefix_hits > hits_before, "the warm run had no prefix-cache hits"
    return out


def run_partial_cache(
    make: EngineFactory, cases: Sequence[Case], **settings: Any
) -> list[list[Answer]]:
    """Each case after a warm-up request whose prompt is the case's followed by
    other tokens up to the end of its last block and one more: the case's last
    prompt block is then cached only inside a longer prompt's full block, so
    the case's hit ends inside a block (a partial prefix hit: a copied block,
    engine/kv/manager.py). Prompt logprobs are off (a first admission that
    wants them takes no hit)."""
    eng = make(**settings)
    bs = eng.kv.block_size

    def params(c: Case, max_tokens: int) -> SamplingParams:
        return replace(greedy_params(c), prompt_logprobs=None, max_tokens=max_tokens)

    out = []
    before = eng.kv.partial_hit_tokens
    for i, c in enumerate(cases):
        extra = [(t * 7 + 3) % 200 + 17 for t in range((-len(c.prompt)) % bs + 1)]
        drive(eng, [Submission(f"w{i}", [*c.prompt, *extra], params(c, 1))])
        got = drive(eng, [Submission(f"r{i}", list(c.prompt), params(c, c.max_tokens))])
        out.append(got[f"r{i}"])
    assert eng.kv.partial_hit_tokens > before, "no case took a partial prefix hit"
    return out


def run_from_tier(
    make: EngineFactory, cases: Sequence[Case], tier: str, **settings: Any
) -> list[list[Answer]]:
    """Each case twice, the second time served from KV tier ``tier``.

    ``host``: one engine whose device pool is too small to keep the first
    run's blocks (the cases run one after another, so the cached blocks pile
    up and the oldest are evicted), so the second run finds them demoted to
    the host tier.
    ``disk``: the first run in one engine, which then closes (flushing its
    tiers); the second in a fresh engine on the same directory, whose host
    tier starts empty. Prompt logprobs are off (as in ``run_warm_cache``).
    """
    import tempfile

    def params(c: Case) -> SamplingParams:
        return replace(greedy_params(c), prompt_logprobs=None)

    first = [Submission(f"w{i}", list(c.prompt), params(c)) for i, c in enumerate(cases)]
    out = []
    with tempfile.TemporaryDirectory() as disk_dir:
        if tier == "disk":
            settings = {**settings, "kv_offloading_disk_path": disk_dir}
        eng = make(**settings)
        for sub in first:
            drive(eng, [sub])
        if tier == "disk":
            eng.close()
            eng = make(**settings)
        before = eng.kv.hits_by_tier[tier]
        for i, c in enumerate(cases):
            got = drive(eng, [Submission(f"r{i}", list(c.prompt), params(c))])
            out.append(got[f"r{i}"])
        assert eng.kv.hits_by_tier[tier] > before, f"the second run had no {tier}-tier hits"
        eng.close()
    return out


def grammar_for(answer_text: str) -> StructuredOutputSpec:
    """A regex that allows exactly ``answer_text`` (so greedy must produce it again)."""
    import re

    return StructuredOutputSpec(regex=re.escape(answer_text))


# ------------------------------------------------------------------ comparing


# Modes that round what they store or multiply (a float16 KV cache: 11
# significant bits; block-quantized linears: 15-bit activation codes per
# 32-block) turn the ~1e-7 differences of a different summation order (one
# prefill chunk or two, another batch) into whole rounding steps now and then,
# which moves a logprob by up to ~1e-3. Block-quantized linears on builds
# without AVX-512 VNNI also switch kernels by row count (up to 8 rows the
# integer-dot kernel on 15-bit activation codes, above that fp16 weights):
# a chunk boundary or another batch moves rows from one to the other, and
# fbgemm's fp16 GEMM blocks by row count too: measured up to 6.7e-3 on the
# default model (chunked16 against one prefill chunk, q4_1 + float16 KV, a
# prompt position's top logprob; 2.4e-3 with q8_0). Tokens must still be the
# same.
ROUNDED_LOGPROB_ATOL = 1e-2


def _close(a: float, b: float, atol: float = LOGPROB_ATOL) -> bool:
    return abs(a - b) <= atol or (a == b)


def _assert_position(
    where: str, got: PositionLogprobs, want: PositionLogprobs, atol: float = LOGPROB_ATOL
) -> None:
    assert got.chosen.token_id == want.chosen.token_id, f"{where}: token differs"
    assert _close(got.chosen.logprob, want.chosen.logprob, atol), (
        f"{where}: logprob {got.chosen.logprob} vs {want.chosen.logprob}"
    )
    assert len(got.top) == len(want.top), f"{where}: {len(got.top)} vs {len(want.top)} top"
    for j, (g, w) in enumerate(zip(got.top, want.top)):
        assert _close(g.logprob, w.logprob, atol), f"{where}: top[{j}] {g.logprob} vs {w.logprob}"
        if g.token_id != w.token_id:
            # Only a near-tie may swap ranks. In the last slot the rival may be the
            # (k+1)-th token, which the list does not show: its logprob equals the
            # slot's within atol (checked above), so that is the tie.
            last = j + 1 == len(want.top)
            nxt = want.top[j + 1].logprob if not last else None
            prv = want.top[j - 1].logprob if j > 0 else None
            tie = last or any(x is not None and abs(x - w.logprob) <= atol for x in (nxt, prv))
            assert tie, f"{where}: top[{j}] token {g.token_id} vs {w.token_id}"


def assert_same(
    got: Answer,
    want: Answer,
    where: str,
    *,
    prompt_logprobs: bool = True,
    atol: float = LOGPROB_ATOL,
) -> None:
    """``got`` gives back what ``want`` did (module docstring: what "same" means;
    ``atol`` for the logprobs: LOGPROB_ATOL, or ROUNDED_LOGPROB_ATOL for modes
    that round activations or the KV cache)."""
    assert got.token_ids == want.token_ids, f"{where}: {got.token_ids} != {want.token_ids}"
    assert len(got.logprobs) == len(want.logprobs), f"{where}: logprob count differs"
    for k, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
        _assert_position(f"{where} output[{k}]", g, w, atol)
    if prompt_logprobs:
        assert len(got.prompt_logprobs) == len(want.prompt_logprobs), (
            f"{where}: {len(got.prompt_logprobs)} prompt logprobs, want {len(want.prompt_logprobs)}"
        )
        for k, (gp, wp) in enumerate(zip(got.prompt_logprobs, want.prompt_logprobs)):
            if wp is None or gp is None:
                assert gp is wp, f"{where} prompt[{k}]: {gp} vs {wp}"
            else:
                _assert_position(f"{where} prompt[{k}]", gp, wp, atol)
