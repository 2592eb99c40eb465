"""Speculative decoding, piece by piece: config, n-gram lookup, rejection sampling, the
adaptive rule, and block accounting under rollback (no model needed).

The engine end to end (token-identical greedy output with speculation on and
off, seeded sampling, stops, grammar, metrics) is in tests/test_spec_engine.py.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.kv.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.sampling.rejection import VerifyRequest, verify
from engine.sampling.sampler import Sampler
from engine.scheduler import Scheduler
from engine.spec_decode.config import SpeculativeConfig, parse_speculative_config
from engine.spec_decode.controller import (
    AdaptiveDraftPolicy,
    Candidate,
    StepCostModel,
    no_draft_cost,
)
from engine.spec_decode.ngram import NgramIndex
from tests.test_sampler import base_logits, expected_probs, tv

# ------------------------------------------------------------------ config


def test_config_accepts_vllm_keys() -> None:
    c = parse_speculative_config(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    )
    assert c == SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)
    # vLLM's defaults: neither size given -> 5/5; one given -> the other equals it.
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2}) == (
        SpeculativeConfig("ngram", 2, prompt_lookup_max=5, prompt_lookup_min=5)
    )
    c = parse_speculative_config(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    )
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    # A model and no method is a draft model (as vLLM infers); no model is the self-draft.
    c = parse_speculative_config({"model": "/m", "num_speculative_tokens": 3})
    assert c is not None and c.method == "draft_model" and c.quantization is None
    c = parse_speculative_config({"method": "draft_model", "num_speculative_tokens": 3})
    assert c is not None and c.is_self_draft and c.quantization == "q4_1"
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"num_speculative_tokens": 2}, 'set "method"'),
        ({"method": "ngram", "num_speculative_tokens": 0}, "between 1 and 16"),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, "unknown key(s) draft"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min (4) exceeds prompt_lookup_max (2)",
        ),
        ({"method": "ngram", "model": "/m", "num_speculative_tokens": 2}, "takes no draft model"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
            "ngram method only",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "fp8"},
            "quantization 'fp8' is not supported",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, "adaptive must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size must be >= 1",
        ),
    ],
)
def test_bad_config_is_a_clear_error(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=raw)
    assert "--speculative-config" in str(e.value) and message in str(e.value)


def test_cli_flag_parses_json() -> None:
    from server.cli import build_configs, resolve_settings

    flag = ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    engine_cfg, _ = build_configs(resolve_settings(flag))
    assert engine_cfg.speculative == SpeculativeConfig("ngram", 3)
    with pytest.raises(SystemExit, match="num_speculative_tokens is required"):
        build_configs(resolve_settings(["--speculative-config", '{"method": "ngram"}']))
    with pytest.raises(SystemExit, match="not valid JSON"):
        resolve_settings(["--speculative-config", "{method: ngram}"])


# ------------------------------------------------------------------ n-gram lookup


def naive_lookup(tokens: list[int], nmin: int, nmax: int, k: int) -> list[int]:
    """The spec, by brute force: longest suffix n-gram, latest earlier occurrence."""
    length = len(tokens)
    for n in range(min(nmax, length), nmin - 1, -1):
        suffix = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):  # occurrences ending before the last token
            if tokens[end - n : end] == suffix:
                return tokens[end : min(end + k, length)]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    grow=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=6),
    nmin=st.integers(1, 3),
    span=st.integers(0, 2),
    k=st.integers(1, 5),
)
def test_ngram_index_matches_brute_force(
    tokens: list[int], grow: list[list[int]], nmin: int, span: int, k: int
) -> None:
    index = NgramIndex(nmin, nmin + span)
    seq = list(tokens)
    for extra in [[], *grow]:  # incremental: the index catches up with appended tokens
        seq.extend(extra)
        assert index.lookup(seq, k) == naive_lookup(seq, nmin, nmin + span, k)


def test_ngram_proposes_the_latest_continuation() -> None:
    index = NgramIndex(2, 3)
    # "1 2 3" occurs twice before the suffix "1 2 3": the latest one is followed by 7 8.
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    assert index.lookup(seq, 2) == [7, 8]
    assert index.lookup([5, 6, 7], 3) == []


# ------------------------------------------------------------------ rejection sampling

DRAWS = 20000


def rq(rid: str = "r", **kw: object) -> Request:
    return Request(rid, rid, 0, [1, 2, 3], SamplingParams(**kw))  # type: ignore[arg-type]


def tv_bound(n: int) -> float:
    """0.03 at 20,000 draws over 12 tokens (a correct sampler's TV is ~0.01 there, as
    in test_sampler), scaled as 1/sqrt(n) for fewer draws."""
    return 0.03 * (DRAWS / n) ** 0.5


def emitted_distributions(
    logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, **kw: object
) -> tuple[torch.Tensor, tuple[torch.Tensor, int], float]:
    """Empirical distributions of the first and second emitted tokens (with the number
    of second tokens), and the mean number of drafts accepted, over ``DRAWS``
    verifications of ``drafts[i]`` (drawn from ``q``, or deterministic if None)."""
    req = rq(**kw)
    k = drafts.shape[1]
    items = [
        VerifyRequest(req, drafts[i].tolist(), None if q is None else q.expand(k, -1))
        for i in range(DRAWS)
    ]
    torch.manual_seed(5)
    outs = verify(logits.expand(DRAWS * (k + 1), -1).clone(), items)
    first = torch.tensor([o.token_ids[0] for o in outs])
    second = torch.tensor([o.token_ids[1] for o in outs if len(o.token_ids) > 1])
    vocab = logits.numel()
    f = torch.bincount(first, minlength=vocab).double() / len(first)
    s = torch.bincount(second, minlength=vocab).double() / max(len(second), 1)
    return f, (s, len(second)), sum(o.num_accepted for o in outs) / DRAWS


@pytest.mark.parametrize(
    "kw",
    [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9)],
)
def test_rejection_sampling_keeps_the_target_distribution(kw: dict[str, object]) -> None:
    # The target's processed distribution p; every verification row sees the same
    # logits, so every emitted position must follow p whatever the drafts.
    logits = base_logits()
    p = expected_probs(
        logits,
        kw["temperature"],
        kw.get("top_k", 0),
        kw.get("top_p", 1.0),
        0.0,  # type: ignore[arg-type]
    )
    gen = torch.Generator().manual_seed(9)
    # Deliberately bad draft distributions: mass on the target's unlikely tokens
    # (very bad for the first position; milder so enough second tokens occur).
    for q, max_acc in (
        (torch.softmax(-logits, dim=-1), 0.2),
        (torch.softmax(-0.25 * logits, -1), 0.6),
    ):
        drafts = torch.multinomial(q, DRAWS * 2, replacement=True, generator=gen).view(DRAWS, 2)
        f, (s, n2), acc = emitted_distributions(logits, drafts, q, **kw)
        assert n2 >= 2000 or max_acc == 0.2
        assert tv(f, p) < tv_bound(DRAWS), tv(f, p)
        if n2 >= 2000:
            assert tv(s, p) < tv_bound(n2), (tv(s, p), n2)
        assert float(f[p == 0].sum()) == 0.0
        # The first draft is accepted with probability sum(min(p, q)): mostly
        # rejected, and it is the residual that restores p.
        assert acc < max_acc
    # Deterministic (one-hot) bad drafts: the least likely token (first position),
    # then the second most likely (accepted ~20%, enough second tokens).
    order = p.masked_fill(p == 0, 2.0).argsort()
    worst, second_best = int(order[0]), int(p.argsort(descending=True)[1])
    f, _, acc = emitted_distributions(logits, torch.full((DRAWS, 2), worst), None, **kw)
    assert tv(f, p) < tv_bound(DRAWS), tv(f, p)
    # Each draft accepted with probability p(d): p + p^2 accepted on average of 2.
    pw = float(p[worst])
    assert abs(acc - (pw + pw * pw)) < 0.01
    f, (s, n2), acc = emitted_distributions(logits, torch.full((DRAWS, 2), second_best), None, **kw)
    assert n2 >= 2000 and tv(f, p) < tv_bound(DRAWS) and tv(s, p) < tv_bound(n2)
    # Plain sampling is held to the same bound (the reference the rule must match).
    sampler = Sampler()
    reqs = [rq(str(i), **kw) for i in range(DRAWS)]
    plain = torch.tensor(sampler(logits.expand(DRAWS, -1).clone(), reqs).token_ids)
    assert tv(torch.bincount(plain, minlength=12).double() / DRAWS, p) < 0.03


def test_good_draft_is_mostly_accepted() -> None:
    logits = base_logits()
    p = torch.softmax(logits, dim=-1)
    gen = torch.Generator().manual_seed(3)
    drafts = torch.multinomial(p, DRAWS * 2, replacement=True, generator=gen).view(DRAWS, 2)
    f, _, acc = emitted_distributions(logits, drafts, p, temperature=1.0)
    assert tv(f, p) < tv_bound(DRAWS)
    assert acc > 1.9  # q == p: every draft is accepted (2 of 2)


def test_greedy_verification_accepts_the_argmax_chain() -> None:
    logits = torch.tensor(
        [[0.0, 5.0, 1.0, 0.0], [0.0, 0.0, 5.0, 1.0], [3.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 9.0]]
    )
    req = rq(temperature=0.0, logprobs=1)
    (out,) = verify(logits.clone(), [VerifyRequest(req, [1, 2, 3])])
    # Drafts 1, 2 are the argmaxes of rows 0, 1; draft 3 is not (row 2 says 0).
    assert out.token_ids == [1, 2, 0] and out.num_accepted == 2
    lp = torch.log_softmax(logits, dim=-1)
    assert [x.chosen.token_id for x in out.logprobs if x] == [1, 2, 0]
    for row, (x, tok) in enumerate(zip(out.logprobs, [1, 2, 0])):
        assert x is not None and abs(x.chosen.logprob - float(lp[row, tok])) < 1e-6
    (out,) = verify(logits.clone(), [VerifyRequest(req, [1, 2, 0])])
    assert out.token_ids == [1, 2, 0, 3] and out.num_accepted == 3  # all accepted: bonus


def test_seeded_verification_samples_what_plain_sampling_samples() -> None:
    # Deterministic drafts, seeded request: each emitted position consumes one noise
    # draw, so the tokens are those plain sampling would draw step by step.
    logits = base_logits()
    plain_req = rq("a", temperature=1.0, seed=11)
    plain = [Sampler()(logits[None].clone(), [plain_req]).token_ids[0] for _ in range(40)]
    spec_req = rq("b", temperature=1.0, seed=11)
    got: list[int] = []
    rng = random.Random(1)
    while len(got) < 40:
        # Drafts that are right about half the time (peeking at the plain answer).
        k = rng.randrange(0, 4)
        want = plain[len(got) : len(got) + k]
        drafts = [t if rng.random() < 0.6 else (t + 1) % 12 for t in want]
        (out,) = verify(
            logits.expand(len(drafts) + 1, -1).clone(), [VerifyRequest(spec_req, drafts)]
        )
        got.extend(out.token_ids)
    assert got[:40] == plain


def test_verification_applies_min_tokens_and_penalties_per_position() -> None:
    # Row i sees drafts 1..i as generated: the eos ban of min_tokens lifts at
    # row 1, and the frequency penalty counts the drafts before each row.
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.0]]).expand(3, -1).clone()
    req = Request("m", "m", 0, [3], SamplingParams(temperature=0.0, min_tokens=1), frozenset({1}))
    (out,) = verify(logits.clone(), [VerifyRequest(req, [2, 1])])
    assert out.token_ids == [2, 1, 1]  # row 0 bans eos 1 -> 2; rows 1, 2 allow it
    req = rq(temperature=0.0, frequency_penalty=2.0)
    (out,) = verify(logits.clone(), [VerifyRequest(req, [1, 2])])
    # Row 1 sees one 1 (3 - 2 = 1 < 2): argmax 2 accepted; row 2 sees 1 and 2 once
    # each: 1 -> 1.0, 2 -> 0.0, 0 and 3 stay 0.0: argmax 1.
    assert out.token_ids == [1, 2, 1]


# ------------------------------------------------------------------ adaptive rule


def flat_then_linear(knee: int, base: float, per_token: float) -> StepCostModel:
    """A CPU-like cost: nearly flat (weight-bandwidth bound) up to ``knee`` tokens, then
    compute bound at ``per_token`` seconds per token."""
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    return StepCostModel(
        [(n, base + per_token * (max(0, n - knee) + 0.25 * min(n - 1, knee))) for n in sizes]
    )


def test_cost_model_interpolates_and_never_decreases() -> None:
    m = StepCostModel([(1, 1.0), (5, 1.0), (9, 3.0), (17, 2.0)])
    # The noisy dip at 17 is pooled with 9 (least-squares monotone fit): 2.5 both.
    assert m(1) == 1.0 and m(3) == 1.0 and m(7) == 1.75
    assert m(9) == m(17) == m(100) == 2.5
    assert StepCostModel([(4, 2.0)])(8) == 4.0  # one point: proportional beyond it
    # Observed steps move their point (an exponential average), others stay.
    m = StepCostModel([(1, 1.0), (4, 1.0), (8, 2.0)], alpha=0.5)
    m.observe(4, 3.0)
    m.observe(5, 9.0)  # not a measured size: ignored
    assert m(4) == m(8) == 2.0 and m(1) == 1.0


def test_adaptive_rule_drafts_when_cheap_and_stops_in_large_batches() -> None:
    policy = AdaptiveDraftPolicy(flat_then_linear(8, 0.03, 0.004), no_draft_cost)
    # One stream, acceptance at the 0.5 prior: all 4 drafts pay (the step costs the same).
    assert policy.draft_counts([Candidate("a", 4)], 1) == [4]
    # A request whose drafts keep failing gets none; a good one keeps drafting.
    for _ in range(10):
        policy.observe("bad", 4, 0)
        policy.observe("good", 4, 4)
    assert policy.acceptance("bad") < 0.15 < 0.9 < policy.acceptance("good")
    counts = policy.draft_counts([Candidate("bad", 4), Candidate("good", 4)], 2)
    assert counts[0] < counts[1] == 4
    # Larger batches at the prior: fewer drafts per request, none past the crossover.
    per_request = []
    for batch in (1, 4, 16, 64):
        counts = policy.draft_counts([Candidate(f"r{i}", 4) for i in range(batch)], batch)
        per_request.append(sum(counts) / batch)
    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] == 4 and per_request[-1] == 0


def test_plain_decode_table_prices_leaving_the_fast_path() -> None:
    """Where decode-only steps run a faster path (P) than verification (T), the
    first draft pays for the switch: a batch that drafts against T alone stops
    drafting once P is known, but only for decode-only steps."""
    target = flat_then_linear(8, 0.03, 0.004)
    plain = StepCostModel([(b, 0.6 * target(b)) for b in (1, 2, 4, 8, 16, 32)])
    batch = [Candidate(f"r{i}", 4) for i in range(4)]
    assert sum(AdaptiveDraftPolicy(target).draft_counts(batch, 4, True)) > 0
    policy = AdaptiveDraftPolicy(target, plain_cost=plain)
    assert sum(policy.draft_counts(batch, 4, decode_only=True)) == 0
    assert policy.draft_counts(batch, 4, decode_only=False) == AdaptiveDraftPolicy(
        target
    ).draft_counts(batch, 4)
    # One stream at high acceptance still drafts: 5 tokens for one T step beat 1 for P.
    for _ in range(10):
        policy.observe("solo", 4, 4)
    assert policy.draft_counts([Candidate("solo", 4)], 1, decode_only=True) == [4]
    # Plain decode steps feed P, everything else T.
    before_t, before_p = target(4), plain(4)
    policy.observe_step(4, 1.0, plain_decode=True)
    assert plain(4) > before_p and target(4) == before_t
    policy.observe_step(4, 1.0)
    assert target(4) > before_t


def test_idle_requests_drift_back_to_the_prior() -> None:
    policy = AdaptiveDraftPolicy(flat_then_linear(8, 0.03, 0.004))
    for _ in range(10):
        policy.observe("x", 4, 0)
    low = policy.acceptance("x")
    policy.end_step()
    for _ in range(60):
        policy.end_step()  # not verified: the evidence fades
    assert low < 0.15 and policy.acceptance("x") > 0.4


# ------------------------------------------------------------------ rollback accounting


def _sim_config(**kw: object) -> EngineConfig:
    return EngineConfig(
        max_num_batched_tokens=kw.pop("budget", 24),  # type: ignore[arg-type]
        max_num_seqs=8,
        block_size=4,
        **kw,  # type: ignore[arg-type]
    )


def simulate_rollbacks(seed: int, num_blocks: int, k: int, budget: int, lag: bool) -> int:
    """Random drafts, acceptances, stops and aborts through the real scheduler and KV
    manager; checks the invariants after every step and that a hashed block only ever
    holds verified tokens. Returns how many draft positions were rolled back."""
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True)
    sched = Scheduler(_sim_config(budget=budget), kv, max_model_len=64)
    reqs: list[Request] = []
    prefix = [rng.randrange(5, 30) for _ in range(8)]
    for i in range(6):
        prompt = prefix[: rng.randrange(0, 9)] + [
            rng.randrange(5, 30) for _ in range(rng.randrange(1, 10))
        ]
        r = Request(f"r{i}", f"r{i}", 0, prompt, SamplingParams(max_tokens=rng.randrange(2, 20)))
        sched.add_request(r, admit_check=False)
        reqs.append(r)
    total_rolled = 0
    for _ in range(400):
        if not sched.num_unfinished:
            break
        for r in sched.running:  # what a planner would ask for
            r.num_lookahead_tokens = rng.randrange(0, k + 1)
        out = sched.schedule()
        rolled: dict[str, int] = {}
        emitted: dict[str, list[int]] = {}
        for s in out.scheduled:
            if s.num_lookahead_slots:
                n = rng.randrange(0, s.num_lookahead_slots + 1)
                s.set_drafts([rng.randrange(5, 30) for _ in range(n)])
            if not s.completes_sequence:
                continue
            j = rng.randrange(0, s.num_draft_tokens + 1)
            kept = min(j, max(s.num_draft_tokens - 1, 0)) if lag else j
            if s.num_draft_tokens:
                rolled[s.req.request_id] = s.num_draft_tokens - kept
                total_rolled += s.num_draft_tokens - kept
            emitted[s.req.request_id] = [*s.draft_token_ids[:j], rng.randrange(5, 30)]
        sched.update_after_step(out, rolled)
        for s in out.scheduled:
            s.req.num_lookahead_tokens = 0
            toks = emitted.get(s.req.request_id)
            if toks is None:
                continue
            for t in toks:
                s.req.append_output(t)
                done = s.req.num_output_tokens >= (s.req.params.max_tokens or 0)
                if done or rng.random() < 0.03:  # max_tokens, or a stop inside the run
                    sched.finish(s.req, RequestStatus.FINISHED_STOPPED)
                    break
        if rng.random() < 0.02 and sched.running:
            victim = next(iter(sched.running))
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
        sched.check_invariants()
        # A hashed block holds exactly the verified tokens of the requests using it.
        for r in itertools.chain(sched.running, sched.waiting):
            for i, bid in enumerate(r.block_ids):
                block = kv.pool.blocks[bid]
                if block.token_ids is not None:
                    assert list(block.token_ids) == r.all_token_ids[i * 4 : (i + 1) * 4]
                    assert (i + 1) * 4 <= r.num_computed_tokens
    for r in reqs:
        if not r.is_finished:
            sched.finish(r, RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    return total_rolled


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(12, 40),
    k=st.integers(1, 6),
    budget=st.sampled_from([6, 12, 24]),
    lag=st.booleans(),
)
def test_block_accounting_under_rollback(
    seed: int, num_blocks: int, k: int, budget: int, lag: bool
) -> None:
    simulate_rollbacks(seed, num_blocks, k, budget, lag)


def test_rollback_simulation_exercises_rollbacks() -> None:
    # The property test above is only as good as what it runs: drafts get slots,
    # and positions are rolled back, with and without the draft model's lag.
    assert simulate_rollbacks(1, 40, 4, 24, lag=False) > 20
    assert simulate_rollbacks(1, 40, 4, 24, lag=True) > 20


# ------------------------------------------------------------------ the planner


def test_plan_caps_drafts_and_skips_non_decoding_requests() -> None:
    from engine.spec_decode.controller import FixedDraftPolicy
    from engine.spec_decode.ngram import NgramProposer
    from engine.spec_decode.speculator import Speculator

    spec = parse_speculative_config(
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 2,
            "adaptive": False,
            "disable_by_batch_size": 5,
        }
    )
    assert spec is not None

    def decoding(rid: str, max_tokens: int, out: int = 3, max_len: int = 1000) -> Request:
        r = Request(
            rid,
            rid,
            0,
            [1, 2, 3, 1, 2, 3, 1, 2],
            SamplingParams(max_tokens=max_tokens),
            max_model_len=max_len,
        )
        for t in [3, 1, 2][:out]:
            r.append_output(t)
        r.num_computed_tokens = r.num_tokens - 1
        return r

    sp = Speculator(spec, NgramProposer(1, 2), FixedDraftPolicy())
    free = decoding("free", 100)
    near_end = decoding("end", 5)  # 3 of 5 out: one more step emits at most 2
    tight = decoding("len", 100, max_len=13)  # 11 tokens, 13 max: 1 draft fits
    prefill = Request("p", "p", 0, [1, 2, 3, 1, 2], SamplingParams(max_tokens=9))
    sp.plan([free, near_end, tight, prefill], budget=64)
    # free: "1 2" last occurred ending at 8, followed by only 3 known tokens.
    assert [r.num_lookahead_tokens for r in (free, near_end, tight, prefill)] == [3, 1, 1, 0]
    # The lookup had fewer continuation tokens than asked: only what it found.
    short = Request("s", "s", 0, [5, 6, 7, 8, 7], SamplingParams(max_tokens=50))
    short.append_output(8)
    short.num_computed_tokens = short.num_tokens - 1
    sp.plan([short], budget=64)
    # "7 8" last occurred at 2..3, followed by only "7 8" (2 tokens, 4 asked).
    assert short.num_lookahead_tokens == 2
    # disable_by_batch_size: 5 running requests turn drafting off for the step.
    sp.plan([free, near_end, tight, prefill, decoding("x", 100)], budget=64)
    assert free.num_lookahead_tokens == 0
