"""Sampler: exact masks, and empirical distributions against the processed one."""

from __future__ import annotations

import torch

from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler, filter_probs


def rq(rid: str = "r", **kw: object) -> Request:
    return Request(rid, rid, 0, [1, 2, 3], SamplingParams(**kw), eos_token_ids=frozenset({0}))  # type: ignore[arg-type]


def base_logits(vocab: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(vocab, generator=g) * 2


def expected_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The processed distribution, computed independently with plain loops."""
    p = torch.softmax(logits / temperature, dim=-1).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    mass = sum(p[i] for i in keep)
    acc = 0.0
    kept_p = set()
    for i in order:
        if i not in keep:
            continue
        if acc / mass < top_p:
            kept_p.add(i)
        acc += p[i]
    mx = max(p)
    final = [p[i] if i in kept_p and p[i] >= min_p * mx else 0.0 for i in range(len(p))]
    s = sum(final)
    return torch.tensor([x / s for x in final])


def empirical(logits: torch.Tensor, draws: int, **kw: object) -> torch.Tensor:
    sampler = Sampler()
    reqs = [rq(str(i), **kw) for i in range(draws)]
    torch.manual_seed(123)
    out = sampler(logits.expand(draws, -1).clone(), reqs)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).double() / draws


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a.double() - b.double()).abs().sum())


def test_distributions_match_processed_probs() -> None:
    # 20,000 draws over 12 tokens: TV of a correct sampler is ~0.01; 0.03 gives margin
    # while catching a wrong filter (which moves at least one token's mass by > 0.05).
    logits = base_logits()
    for kw in (
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=4),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.9, top_k=6, top_p=0.7, min_p=0.05),
    ):
        exp = expected_probs(
            logits,
            kw["temperature"],
            kw.get("top_k", 0),
            kw.get("top_p", 1.0),
            kw.get("min_p", 0.0),
        )  # type: ignore[arg-type]
        emp = empirical(logits, 20000, **kw)
        assert tv(emp, exp) < 0.03, (kw, tv(emp, exp))
        assert float(emp[exp == 0].sum()) == 0.0  # filtered tokens never drawn


def test_filter_probs_matches_reference_exactly() -> None:
    logits = base_logits()
    probs = torch.softmax(logits, dim=-1)[None]
    got = filter_probs(probs, [5], [0.6], [0.1])
    got = got / got.sum()
    assert torch.allclose(got[0], expected_probs(logits, 1.0, 5, 0.6, 0.1).float(), atol=1e-6)


def test_greedy_bias_and_min_tokens() -> None:
    logits = torch.zeros(2, 10)
    logits[:, 0] = 5.0  # eos
    logits[:, 3] = 4.0
    a = rq("a", temperature=0.0)
    b = rq("b", temperature=0.0, min_tokens=2, logit_bias={7: 100.0})
    out = Sampler()(logits, [a, b])
    assert out.token_ids == [0, 7]
    c = rq("c", temperature=0.0, min_tokens=2)
    assert Sampler()(logits[:1].clone(), [c]).token_ids == [3]  # eos masked before min_tokens


def test_seed_reproducible_whatever_the_batch() -> None:
    logits = base_logits()
    alone = Sampler()(logits[None].clone(), [rq("x", temperature=1.0, seed=42)]).token_ids
    others = [rq(str(i), temperature=1.0) for i in range(5)]
    mixed_reqs = [*others[:2], rq("x", temperature=1.0, seed=42), *others[2:]]
    mixed = Sampler()(logits.expand(6, -1).clone(), mixed_reqs).token_ids
    assert mixed[2] == alone[0]
    seq1 = [
        Sampler()(logits[None].clone(), [r]).token_ids[0]
        for r in [rq("y", temperature=1.0, seed=3)] * 1
    ]
    r = rq("y", temperature=1.0, seed=3)
    seq2 = [Sampler()(logits[None].clone(), [r]).token_ids[0] for _ in range(8)]
    r2 = rq("y", temperature=1.0, seed=3)
    seq3 = [Sampler()(logits[None].clone(), [r2]).token_ids[0] for _ in range(8)]
    assert seq2 == seq3 and seq1[0] == seq2[0]


def test_penalties() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0]])
    r = rq("p", temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0)
    r.output_token_ids = [2, 2]
    r.all_token_ids = [0, 2, 2]
    # token 2: 3 - 2*1 - 2 = -1 -> argmax becomes token 1
    assert Sampler()(logits.clone(), [r]).token_ids == [1]
    r2 = rq("q", temperature=0.0, repetition_penalty=2.0)
    r2.all_token_ids = [2, 3]
    # token 2: 3/2 = 1.5 < 2 -> token 1
    assert Sampler()(logits.clone(), [r2]).token_ids == [1]


def test_logprobs_are_model_log_softmax() -> None:
    logits = base_logits()[None]
    r = rq("l", temperature=0.0, logprobs=3)
    out = Sampler()(logits.clone(), [r])
    lp = torch.log_softmax(logits, -1)[0]
    entry = out.logprobs[0]
    assert entry is not None
    assert entry.chosen.token_id == int(lp.argmax())
    assert abs(entry.chosen.logprob - float(lp.max())) < 1e-6
    assert [t.token_id for t in entry.top] == lp.topk(3).indices.tolist()
