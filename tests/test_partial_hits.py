"""Partial prefix hits: a hit that ends inside a block copies the cached block.

Exact tests of the KV manager's side (which sibling, how many tokens, the copy's
reference, the invariants) and, on a tiny random checkpoint, that a partial hit
gives the same greedy answer and logprobs as computing the prompt, in a plain
and a KIVI format. The differential suite's ``prefix_partial`` axis covers the
other modes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.kv.manager import KVCacheManager
from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling.params import SamplingParams
from tests.conftest import default_gguf_path
from tests.differential import (
    LOGPROB_ATOL,
    ROUNDED_LOGPROB_ATOL,
    Case,
    Submission,
    assert_same,
    drive,
    greedy_params,
    run_alone,
)
from tests.model_utils import make_tiny_checkpoint
from tests.test_kv_tiers import compute as computed  # allocate, "compute", cache a prompt


def make_req(rid: str, tokens: list[int], salt: str | None = None, **kw: Any) -> Request:
    return Request(rid, rid, 0, list(tokens), SamplingParams(max_tokens=4, **kw), cache_salt=salt)


def test_partial_hit_takes_the_longest_sibling_and_copies_it() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.enable_partial_hits(1)
    a = make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # blocks [1-4] [5-8] + 1
    computed(kv, a)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 9, 9, 9, 9])  # shares 1-4 and then 5, 6
    hit = kv.find_cached_prefix(b)
    assert len(hit) == 1 and hit.partial is not None
    assert hit.partial.block_id == a.block_ids[1] and hit.partial_tokens == 2
    assert hit.num_tokens == 6
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert b.num_computed_tokens == 6
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] not in a.block_ids
    # The source holds the copy's reference until the copy has run.
    assert kv.pool.blocks[a.block_ids[1]].ref_count == 2
    b.num_computed_tokens = b.num_tokens  # the step computed the rest
    kv.check_invariants([a, b])
    seen: list[tuple[list[int], list[int]]] = []
    assert kv.run_block_copies(lambda s, d: seen.append((s, d))) == 1
    assert seen == [([a.block_ids[1]], [b.block_ids[1]])]
    assert kv.pool.blocks[a.block_ids[1]].ref_count == 1
    assert kv.run_block_copies(lambda s, d: seen.append((s, d))) == 0
    kv.check_invariants([a, b])
    kv.record_prefix_query(b, hit)
    assert b.cached_tokens_by_tier["device"] == 6 and kv.partial_hit_tokens == 2
    kv.free(a)
    kv.free(b)
    kv.check_invariants([])
    assert kv.num_free_blocks == 16


def test_partial_hits_are_off_unless_enabled_and_round_to_granularity() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=8)
    a = make_req("a", list(range(1, 18)))
    computed(kv, a)
    b = make_req("b", [*range(1, 9), 9, 10, 11, 12, 13, 99, 99])
    assert kv.find_cached_prefix(b).partial is None  # off
    kv.enable_partial_hits(4)
    hit = kv.find_cached_prefix(b)
    assert hit.partial is not None and hit.partial_tokens == 4  # 5 shared, rounded to 4
    c = make_req("c", [*range(1, 9), 9, 10, 11, 99])
    assert kv.find_cached_prefix(c).partial is None  # 3 shared < 4
    with pytest.raises(ValueError, match="granularity"):
        kv.enable_partial_hits(9)


def test_partial_hit_leaves_a_token_to_compute_and_respects_prompt_logprobs() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.enable_partial_hits(1)
    computed(kv, make_req("a", [1, 2, 3, 4, 5, 6, 7, 8]))
    # The same prompt cut short inside the second block: 5, 6, 7 cached, but the
    # last prompt token is always computed.
    hit = kv.find_cached_prefix(make_req("b", [1, 2, 3, 4, 5, 6, 7]))
    assert hit.num_tokens == 6 and hit.partial_tokens == 2
    # A first admission that wants prompt logprobs takes no hit at all.
    hit = kv.find_cached_prefix(make_req("c", [1, 2, 3, 4, 5, 6, 7], prompt_logprobs=1))
    assert not hit and hit.num_tokens == 0


def test_partial_hits_never_cross_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    kv.enable_partial_hits(1)
    computed(kv, make_req("a", [1, 2, 3, 4, 5], salt="x"))
    assert kv.find_cached_prefix(make_req("b", [1, 2, 3, 9, 9], salt="y")).partial is None
    assert kv.find_cached_prefix(make_req("b", [1, 2, 3, 9, 9])).partial is None
    hit = kv.find_cached_prefix(make_req("c", [1, 2, 3, 9, 9], salt="x"))
    assert hit.partial is not None and hit.partial_tokens == 3


def test_copy_source_survives_eviction_pressure() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.enable_partial_hits(1)
    a = make_req("a", [1, 2, 3, 4])
    computed(kv, a)
    src = a.block_ids[0]
    kv.free(a)  # cached, unreferenced: evictable
    b = make_req("b", [1, 2, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])
    hit = kv.find_cached_prefix(b)
    assert hit.partial is not None and hit.partial.block_id == src
    # 4 blocks needed, 4 in the pool, but the source is taken by the copy: no room.
    assert not kv.can_allocate(b, b.num_tokens - hit.num_tokens, hit)
    b = make_req("b", [1, 2, 9, 9, 9, 9, 9, 9, 9])  # 3 blocks: fits beside the source
    hit = kv.find_cached_prefix(b)
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit)
    assert src not in b.block_ids and kv.pool.blocks[src].ref_count == 1
    b.num_computed_tokens = b.num_tokens
    kv.check_invariants([b])
    kv.run_block_copies(lambda s, d: None)
    kv.free(b)
    kv.check_invariants([])


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 14), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=30,
    ),
)
def test_random_partial_hits_keep_every_invariant(
    granularity: int, ops: list[tuple[int, int, int, bool]]
) -> None:
    """Random prompts over three shared stems with random tails; requests end in
    random order and copies run at random points (several admissions may queue
    copies before they run). Every reference is accounted for after each op."""
    kv = KVCacheManager(num_blocks=24, block_size=4)
    kv.enable_partial_hits(granularity)
    stems = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9, 9], [8, 8, 8, 8, 8]]
    live: list[Request] = []
    copied = 0
    for n, (stem, length, tail, finish) in enumerate(ops):
        if finish and live:
            kv.free(live.pop(0))
        else:
            tokens = (stems[stem] + [20 + tail] * 14)[:length]
            r = make_req(str(n), tokens)
            hit = kv.find_cached_prefix(r)
            if hit.partial is not None:
                assert hit.partial_tokens % granularity == 0 and hit.partial_tokens > 0
                assert hit.partial.token_ids is not None
                got = tokens[len(hit) * 4 : len(hit) * 4 + hit.partial_tokens]
                assert list(hit.partial.token_ids[: hit.partial_tokens]) == got
            assert hit.num_tokens < r.num_tokens
            if kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit):
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
                live.append(r)
        kv.check_invariants(live)
        if n % 3 == 2:
            copied += kv.run_block_copies(lambda s, d: None)
            kv.check_invariants(live)
    kv.run_block_copies(lambda s, d: None)
    for r in live:
        kv.free(r)
    kv.check_invariants([])
    assert kv.num_free_blocks == 24


# ------------------------------------------------------------------ on an engine


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("partial"), "llama", vocab_size=49152))


@pytest.mark.parametrize(
    "mode",
    [
        {"cpu_linear": "onednn", "kv_cache_dtype": "float32"},
        {"cpu_linear": "onednn", "kv_cache_dtype": "kivi4", "kivi_group_size": 4},
    ],
    ids=["float32", "kivi4"],
)
def test_engine_partial_hit_gives_the_computed_answer(tiny_ckpt: str, mode: dict[str, Any]) -> None:
    def make(**kw: Any) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=tiny_ckpt,
                tokenizer=str(default_gguf_path()),
                block_size=8,
                kv_cache_memory=4 << 20,
                max_num_batched_tokens=64,
                debug_invariants=True,
                **mode,
                **kw,
            )
        )

    stem = [40 + (i * 13) % 200 for i in range(21)]
    case = Case(tuple([*stem, 77, 78]), 8)  # 23 tokens: 2 full blocks + 7
    want = run_alone(make, [case])[0]
    warm_prompt = [*stem, 90, 91, 92, 93]
    eng = make()
    try:
        # A cached request whose third block starts like the case's but goes on
        # otherwise: the case's hit is 2 blocks plus a copy of 5 tokens of the
        # third (kivi4: 4, one whole group).
        drive(eng, [Submission("w", warm_prompt, greedy_params(Case(tuple(warm_prompt), 1)))])
        # Prompt logprobs off: a first admission that wants them takes no hit.
        params = replace(greedy_params(case), prompt_logprobs=None)
        got = drive(eng, [Submission("r", list(case.prompt), params)])["r"][0]
        granularity = 4 if mode["kv_cache_dtype"] == "kivi4" else 1
        assert eng.kv.partial_hit_tokens == 5 - 5 % granularity
        assert eng.kv.prefix_hits == 16 + 5 - 5 % granularity
    finally:
        eng.close()
    atol = LOGPROB_ATOL if mode["kv_cache_dtype"] == "float32" else ROUNDED_LOGPROB_ATOL
    assert_same(got, want, "partial", prompt_logprobs=False, atol=atol)
