"""KV policies (issue 17): exact keep-sets, compaction, and the engine under every policy.

Keep-sets are checked on crafted score patterns whose expected sets are
worked out by hand in each test's docstring. Engine tests run on a tiny
random Llama in exact mode with ``debug_invariants`` (block accounting and the
"an edited block is private" rule after every step).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv.policies.base import EvictionContext, protected_segments, segment_index
from engine.kv.policies.resolve import policy_unavailable, resolve_policy
from engine.kv.policies.vote import VotePolicy, make_policy, tie_ranks
from engine.llm_engine import LLMEngine
from engine.request import KVPolicyRequest, RequestOptions, RequestStatus, Segment
from engine.sampling.params import SamplingParams
from kernels.attention_mass import attention_mass_ref, attention_mass_triton
from tests.model_utils import make_tiny_checkpoint
from tests.test_engine import EXACT, greedy, tiny_engine

WEIGHTS = {"recency": 1.0, "mass": 1.0, "redundancy": 0.5, "segment": 0.5}
POLICIES = ("streaming", "h2o", "rkv", "vote", "segmented")


def ctx(n: int, budget: int, sinks: int, **kw: object) -> EvictionContext:
    return EvictionContext(n, budget, sinks, torch.arange(n, dtype=torch.int64), **kw)  # type: ignore[arg-type]


def kept(policy: VotePolicy, c: EvictionContext) -> list[int]:
    return policy.select(c).tolist()


# ---- keep-sets -------------------------------------------------------------


def test_tie_ranks_average_ties() -> None:
    r = tie_ranks(torch.tensor([0.0, 10.0, 0.0, 0.0, 0.0, 0.0]))
    # five zeros share ranks 0..4 (average 2 -> 2/5), the ten is rank 5 -> 1.
    assert r.tolist() == pytest.approx([0.4, 1.0, 0.4, 0.4, 0.4, 0.4])


def test_streaming_keeps_sinks_and_recent_window() -> None:
    p = make_policy("streaming", WEIGHTS)
    assert kept(p, ctx(10, 6, 2)) == [0, 1, 6, 7, 8, 9]
    assert kept(p, ctx(10, 6, 0)) == [4, 5, 6, 7, 8, 9]  # no sinks: a plain sliding window
    assert kept(p, ctx(5, 6, 2)) == [0, 1, 2, 3, 4]  # under budget: everything
    assert not p.needs_mass and not p.needs_keys


def test_h2o_keeps_sinks_recent_half_and_heavy_hitters() -> None:
    """n=12, budget 8, 1 sink: recent = int(0.5 * 7) = 3 (slots 9..11); the other 4
    are the heaviest of slots 1..8 (masses 0,5,1,7,0,3,2,8): 8, 4, 2, 6."""
    p = make_policy("h2o", WEIGHTS)
    mass = torch.tensor([9, 0, 5, 1, 7, 0, 3, 2, 8, 0, 0, 0], dtype=torch.float32)
    assert kept(p, ctx(12, 8, 1, mass=mass)) == [0, 2, 4, 6, 8, 9, 10, 11]
    assert p.needs_mass and not p.needs_keys


def test_rkv_drops_near_duplicates_first() -> None:
    """Equal mass (one shared rank: no vote), one-hot keys with key 1 == key 3 and
    key 2 == key 6: slots 1 and 2 duplicate a later key (redundancy 1) and go
    first; recent = int(0.25 * 4) = 1 (slot 7); the third to go is the oldest of
    the equally voted 3..6, slot 3."""
    p = make_policy("rkv", WEIGHTS)
    basis = [0, 1, 2, 1, 4, 5, 2, 7]
    keys = torch.zeros(2, 8, 8)
    for i, b in enumerate(basis):
        keys[:, i, b] = 1.0
    c = ctx(8, 5, 1, mass=torch.ones(8), keys=keys)
    assert kept(p, c) == [0, 4, 5, 6, 7]
    assert p.needs_mass and p.needs_keys


def test_vote_sums_weighted_ranks() -> None:
    """Recency ranks i/5; mass ranks 0.4 (the five zeros) and 1.0 (slot 1). Votes of
    slots 1..5: 1.2, 0.8, 1.0, 1.2, 1.4: slots 2 and 3 go."""
    p = VotePolicy({"recency": 1.0, "mass": 1.0}, recent_fraction=0.0)
    mass = torch.tensor([0, 10, 0, 0, 0, 0], dtype=torch.float32)
    assert kept(p, ctx(6, 4, 1, mass=mass)) == [0, 1, 4, 5]
    # Recency alone: the two oldest non-sinks go.
    assert kept(VotePolicy({"recency": 1.0}, 0.0), ctx(6, 4, 1, mass=mass)) == [0, 3, 4, 5]


CHAT = (
    Segment(0, 4, "system", 0),
    Segment(4, 8, "user", 1),
    Segment(8, 12, "assistant", 2),
    Segment(12, 16, "user", 3),
)


def seg_ctx(n: int, budget: int, mass: torch.Tensor | None = None) -> EvictionContext:
    ti = torch.arange(n, dtype=torch.int64)
    return EvictionContext(
        n,
        budget,
        2,
        ti,
        mass=mass,
        segments=CHAT,
        segment_of=segment_index(ti, CHAT),
        protected=protected_segments(CHAT),
    )


def test_segmented_drops_whole_turns_oldest_first() -> None:
    """20 slots (16 prompt, 4 generated); sinks 0-1, recent int(0.25 * (b - 2)).
    System (0-3) and the newest user turn (12-15) are protected."""
    p = make_policy("segmented", {"recency": 1.0})
    assert protected_segments(CHAT) == frozenset({0, 3})
    # budget 16 (recent 3): 4 to go: the oldest turn, 4-7, whole.
    assert kept(p, seg_ctx(20, 16)) == [0, 1, 2, 3, *range(8, 20)]
    # budget 14 (recent 3): 6 to go: turn 1 (4) then turn 2 whole, never half of it.
    assert kept(p, seg_ctx(20, 14)) == [0, 1, 2, 3, *range(12, 20)]
    # budget 10 (recent 2): both turns go, then the oldest generated slots 16, 17.
    assert kept(p, seg_ctx(20, 10)) == [0, 1, 2, 3, 12, 13, 14, 15, 18, 19]


def test_segmented_bends_to_tokens_rather_than_stall() -> None:
    """30 slots of a prompt whose assistant turn (8-39) is longer than the budget
    (12) and is being prefilled: the recent window (28, 29) is inside it, so it is
    not droppable whole. The old user turn (4-7) goes whole, then the oldest
    slots of the long turn, down to the budget: the request keeps making room."""
    turns = (
        Segment(0, 4, "system", 0),
        Segment(4, 8, "user", 1),
        Segment(8, 40, "assistant", 2),
        Segment(40, 44, "user", 3),
    )
    ti = torch.arange(30, dtype=torch.int64)
    c = EvictionContext(
        30,
        12,
        2,
        ti,
        segments=turns,
        segment_of=segment_index(ti, turns),
        protected=protected_segments(turns),
    )
    assert kept(make_policy("segmented", {"recency": 1.0}), c) == [0, 1, 2, 3, *range(22, 30)]


def test_segmented_keeps_the_attended_turn() -> None:
    """With mass voting, a heavily attended old turn outlives a newer one."""
    p = make_policy("segmented", {"recency": 1.0, "mass": 4.0})
    mass = torch.zeros(20)
    mass[4:8] = 10.0
    assert kept(p, seg_ctx(20, 16, mass=mass)) == [*range(0, 8), *range(12, 20)]


def test_segmented_without_segments_is_token_level() -> None:
    p = make_policy("segmented", {"recency": 1.0})
    assert kept(p, ctx(10, 6, 2)) == [0, 1, 6, 7, 8, 9]


def test_vote_weights_parse_and_refuse() -> None:
    assert EngineConfig(kv_vote_weights="mass=2").vote_weights == {"mass": 2.0}
    for bad in ("mass", "speed=1", "mass=x", "mass=0", "mass=-1"):
        with pytest.raises(ValueError, match="kv-vote-weights"):
            EngineConfig(kv_vote_weights=bad)
    with pytest.raises(ValueError, match="needs --kv-budget-tokens"):
        EngineConfig(kv_policy="h2o")


# ---- narrowing -------------------------------------------------------------


def test_request_policy_only_narrows() -> None:
    full = EngineConfig()
    assert resolve_policy(full, None, 1024) is None
    spec = resolve_policy(full, KVPolicyRequest("streaming", 64, 2), 1024)
    assert spec is not None and (spec.name, spec.budget, spec.sinks) == ("streaming", 64, 2)
    with pytest.raises(InvalidRequestError, match="budget_tokens is required"):
        resolve_policy(full, KVPolicyRequest("h2o"), 1024)
    server = EngineConfig(kv_policy="h2o", kv_budget_tokens=128)
    spec = resolve_policy(server, None, 1024)
    assert spec is not None and (spec.name, spec.budget, spec.sinks) == ("h2o", 128, 4)
    spec = resolve_policy(server, KVPolicyRequest(budget_tokens=32), 1024)
    assert spec is not None and (spec.name, spec.budget) == ("h2o", 32)
    for asked, match in (
        (KVPolicyRequest("full"), "widen"),
        (KVPolicyRequest(budget_tokens=256), "widen"),
        (KVPolicyRequest(sink_tokens=128), "below budget_tokens"),
    ):
        with pytest.raises(InvalidRequestError, match=match) as e:
            resolve_policy(server, asked, 1024)
        assert e.value.param == "kv_policy"
    with pytest.raises(InvalidRequestError, match="exceeds the model's context"):
        resolve_policy(full, KVPolicyRequest("streaming", 1020), 1024)


def test_request_policy_refused_where_policies_cannot_run() -> None:
    """A full server's request may not bring a policy the engine refuses at
    start-up: speculation, tensor parallelism, KIVI blocks, a model without RoPE."""
    asked = KVPolicyRequest("streaming", 64, 2)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    for cfg, rope, match in (
        (EngineConfig(speculative_config=ngram), True, "speculative decoding"),
        (EngineConfig(tensor_parallel_size=2), True, "tensor parallelism"),
        (EngineConfig(kv_cache_dtype="kivi4", kivi_group_size=16), True, "kivi4"),
        (EngineConfig(), False, "no RoPE"),
    ):
        with pytest.raises(InvalidRequestError, match=match) as e:
            resolve_policy(cfg, asked, 1024, policy_unavailable(cfg, rope))
        assert e.value.param == "kv_policy"
        # Asking for nothing (or the server's own full) stays allowed.
        assert resolve_policy(cfg, None, 1024, policy_unavailable(cfg, rope)) is None
    assert policy_unavailable(EngineConfig(), True) is None


def test_kivi_engine_refuses_a_request_policy(tiny: Path) -> None:
    """End to end through the engine: validate_request answers a 400-class error
    instead of letting a compaction reach KIVI blocks."""
    eng = tiny_engine(tiny, **{**EXACT, "kv_cache_dtype": "kivi4", "kivi_group_size": 4})
    opts = RequestOptions(kv_policy=KVPolicyRequest("streaming", 20, 4))
    with pytest.raises(InvalidRequestError, match="kivi4"):
        eng.validate_request([5, 6, 7], greedy(2), opts)
    assert eng.validate_request([5, 6, 7], greedy(2), RequestOptions()) is None


# ---- attention mass -----------------------------------------------------------


def _mass_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    g = torch.Generator().manual_seed(0)
    bs, hkv, hq, d = 4, 2, 4, 16
    k_cache = torch.randn(12, bs, hkv, d, generator=g)
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = [13, 7]
    qsl = [0, 1, 4]  # a decode (1 query) then a 3-token extend
    q = torch.randn(4, hq, d, generator=g)
    return q, k_cache, tables, qsl, seq_lens


def test_attention_mass_reference_is_the_softmax_column_sum() -> None:
    q, k_cache, tables, qsl, seq_lens = _mass_case()
    out = torch.zeros(2, 16)
    attention_mass_ref(q, k_cache, tables, qsl, seq_lens, 0.25, out)
    # Independent: dense per-head softmax over the gathered keys, GQA by repeat.
    for i in range(2):
        keys = k_cache[tables[i].long()].reshape(-1, 2, 16)[: seq_lens[i]]
        want = torch.zeros(16)
        for row in range(qsl[i], qsl[i + 1]):
            pos = seq_lens[i] - (qsl[i + 1] - row)
            for h in range(4):
                s = keys[: pos + 1, h // 2] @ q[row, h] * 0.25
                want[: pos + 1] += torch.softmax(s, 0)
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-6)
    # Each query row spreads exactly one unit per head.
    assert out.sum(1).tolist() == pytest.approx([4.0, 12.0], rel=1e-5)


def test_attention_mass_triton_matches_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k_cache, tables, qsl, seq_lens = _mass_case()
    ref = torch.zeros(2, 16)
    attention_mass_ref(q, k_cache, tables, qsl, seq_lens, 0.25, ref)
    out = torch.zeros(2, 16)
    attention_mass_triton(q, k_cache, tables, qsl, seq_lens, 0.25, out)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


# ---- the engine ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("kvp"), "llama")


def drain(eng: LLMEngine) -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for _, out in eng.step():
            for d in out.outputs:
                toks.setdefault(out.request_id, []).extend(d.delta_token_ids)
    return toks


def policy_engine(model: Path, policy: str, budget: int, **kw: object) -> LLMEngine:
    return tiny_engine(
        model, kv_policy=policy, kv_budget_tokens=budget, kv_evict_interval=8, **EXACT, **kw
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_above_every_length_equals_full(tiny: Path, policy: str) -> None:
    """No eviction: token ids and logprobs identical to full, alone and batched."""
    prompts = [[(5 * i + j) % 250 + 3 for j in range(4 + 7 * i)] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)

    def run(eng: LLMEngine, batched: bool) -> list[list[tuple[int, float]]]:
        outs: dict[str, list[tuple[int, float]]] = {}
        for i, p in enumerate(prompts if batched else prompts[:1]):
            eng.add_request(f"r{i}", p, params)
        while eng.has_unfinished():
            for _, out in eng.step():
                for d in out.outputs:
                    lps = [(lp.chosen.token_id, lp.chosen.logprob) for lp in d.delta_logprobs or []]
                    outs.setdefault(out.request_id, []).extend(lps)
        return [outs[k] for k in sorted(outs)]

    full_alone = run(tiny_engine(tiny, **EXACT), False)
    full_batched = run(tiny_engine(tiny, **EXACT), True)
    assert run(policy_engine(tiny, policy, 100), False) == full_alone
    assert run(policy_engine(tiny, policy, 100), True) == full_batched
    assert [t for t, _ in full_batched[0]] == [t for t, _ in full_alone[0]]


def test_compaction_rerotates_to_a_fresh_prefill(tiny: Path) -> None:
    """Layer 0's keys and values depend only on the token and its position: after
    a compaction the cache must hold exactly what a fresh prefill of the kept
    tokens at positions 0..m-1 writes (up to the re-rotation's rounding)."""
    eng = policy_engine(tiny, "streaming", 20, num_sink_tokens=3)
    prompt = [(7 * j) % 250 + 3 for j in range(40)]
    eng.add_request("s", prompt, greedy(5))
    req = eng.scheduler.requests["s"]
    while req.kv_state is not None and req.kv_state.num_evictions < 2:
        eng.step()
    st = req.kv_state
    assert st is not None and req.num_evicted_tokens > 0
    kept_tokens = [req.all_token_ids[t] for t in st.token_index.tolist()]
    assert st.token_index[:3].tolist() == [0, 1, 2]  # the sinks stay
    m = req.num_kv_tokens
    slots = torch.tensor([req.block_ids[c // 4] * 4 + c % 4 for c in range(m)])
    k0, v0 = (t.view(-1, *t.shape[2:])[slots].clone() for t in eng.runner.kv_caches[0])

    ref = tiny_engine(tiny, **EXACT)
    ref.add_request("r", kept_tokens, greedy(3))
    rreq = ref.scheduler.requests["r"]
    while rreq.num_computed_tokens < len(kept_tokens):
        ref.step()
    rslots = torch.tensor([rreq.block_ids[c // 4] * 4 + c % 4 for c in range(m)])
    rk, rv = (t.view(-1, *t.shape[2:])[rslots] for t in ref.runner.kv_caches[0])
    torch.testing.assert_close(k0, rk, rtol=1e-5, atol=1e-5)
    assert torch.equal(v0, rv)  # values are moved, never rotated
    drain(eng)
    drain(ref)


@pytest.mark.parametrize("policy", POLICIES)
def test_generation_past_max_model_len_bounded_memory(tiny: Path, policy: str) -> None:
    """The tiny model's context is 128 positions: a 150-token prompt and 200 new
    tokens run under a 24-token budget, holding at most ceil(32 / 4) blocks."""
    eng = policy_engine(tiny, policy, 24)
    prompt = [(11 * j) % 250 + 3 for j in range(150)]
    eng.add_request("long", prompt, greedy(200))
    req = eng.scheduler.requests["long"]
    most = 0
    toks: list[int] = []
    while eng.has_unfinished():
        for _, out in eng.step():
            toks.extend(out.outputs[0].delta_token_ids)
        most = max(most, len(req.block_ids))
    assert len(toks) == 200 and req.status is RequestStatus.FINISHED_LENGTH
    assert most <= 8
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    # The full policy refuses the same request (today's 400).
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        tiny_engine(tiny, **EXACT).add_request("x", prompt, greedy(200))


def test_request_extension_under_full_server_and_prefix_cache(tiny: Path) -> None:
    """A streaming request under a full server edits its blocks; a later full
    request with the same prompt hits only the blocks hashed before any edit and
    answers exactly as on a fresh engine."""
    prompt = [(13 * j) % 250 + 3 for j in range(60)]
    fresh = tiny_engine(tiny, **EXACT)
    fresh.add_request("f", prompt, greedy(6))
    want = drain(fresh)["f"]

    eng = tiny_engine(tiny, **EXACT)
    opts = RequestOptions(kv_policy=KVPolicyRequest("streaming", 20, 4))
    eng.add_request("w", prompt, greedy(6), options=opts)
    got_w = drain(eng)["w"]
    assert len(got_w) == 6 and eng.kv_policies.num_compactions > 0
    for b in eng.kv.pool.cached_blocks():
        # Only plain prefix blocks were registered: block i holds tokens i*4..i*4+3.
        assert b.token_ids is not None and b.positions is not None
        i = b.positions[0] // 4
        assert tuple(prompt[i * 4 : i * 4 + 4]) == b.token_ids
    eng.add_request("f", prompt, greedy(6))
    assert drain(eng)["f"] == want
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("policy", POLICIES)
def test_no_block_leaks_however_requests_end(tiny: Path, policy: str) -> None:
    """Finish, stop string, abort mid-decode, preemption (a small cache) and a
    failed step, under each policy: every block comes back; invariants run after
    every step (debug_invariants)."""
    eng = policy_engine(tiny, policy, 16, num_gpu_blocks_override=14, max_num_batched_tokens=16)
    rng = random.Random(1)
    for i in range(6):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(5, 40))]
        stop = [" "] if i % 3 == 1 else []
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, stop=stop))
    for _ in range(6):
        eng.step()
    eng.abort("r2")
    drain(eng)
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    # A failing step ends the requests in it and gives their blocks back.
    eng.add_request("bad", list(range(3, 50)), greedy(20))
    eng.step()
    eng.step()

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("injected")

    eng.runner.execute = boom  # type: ignore[method-assign]
    eng.step()
    assert not eng.has_unfinished()
    eng.scheduler.check_invariants()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_segmented_request_refused_when_protected_spans_exceed_budget(tiny: Path) -> None:
    eng = policy_engine(tiny, "segmented", 16)
    segs = (Segment(0, 10, "system", 0), Segment(10, 20, "user", 1))
    with pytest.raises(InvalidRequestError, match="exceed budget_tokens"):
        eng.add_request("s", list(range(3, 23)), greedy(4), options=RequestOptions(segments=segs))
    # Fits: system 4 + newest user 4 + sinks 4 + recent int(0.25 * 12) = 15 <= 16.
    segs = (
        Segment(0, 4, "system", 0),
        Segment(4, 12, "user", 1),
        Segment(12, 20, "assistant", 2),
        Segment(20, 24, "user", 3),
    )
    eng.add_request("t", list(range(3, 27)), greedy(30), options=RequestOptions(segments=segs))
    req = eng.scheduler.requests["t"]
    while eng.has_unfinished():
        eng.step()
        st = req.kv_state
        if st is not None and st.token_index.numel():
            ti = set(st.token_index.tolist())
            assert set(range(0, 4)) <= ti and set(range(20, 24)) <= ti  # protected stay
            for s in segs:  # a turn is whole or gone
                inside = len(ti & set(range(s.start, s.end)))
                assert inside in (0, s.end - s.start)
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
