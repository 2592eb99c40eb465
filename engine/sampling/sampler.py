"""Sampling, vectorised over the batch: no Python loop over the vocabulary.

Order of processing (as vLLM): logit_bias and min_tokens masks, penalties,
grammar mask, then temperature; greedy rows take the argmax, the rest are
filtered by top-k, top-p and min-p and sampled with the exponential-race
trick (argmax of p / Exp(1) noise), whose noise comes from the request's own
generator when it has a seed, so its samples do not depend on the batch.
Logprobs are those of the model's own log-softmax (before processing).

A row of logits is a :class:`SampleRow`: a request plus the draft tokens
assumed to follow its tokens (``prior``). Plain decoding has no prior; the
verification rows of speculative decoding (engine/sampling/rejection.py)
see the drafts before their position as already generated, so min_tokens,
penalties and the grammar treat each row exactly as plain decoding would
once those drafts are accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.outputs import PositionLogprobs, TokenLogprob
from engine.request import Request

# Fills ``bitmask``-style constraints for some rows: called with the logits
# (after penalties, before temperature) to mask tokens in place.
GrammarMaskFn = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class SampleRow:
    """One row of logits to process: ``req`` as if ``prior`` had been appended to it.

    ``prior`` is non-empty only for speculative verification rows (the drafts
    before the row's position); the request itself is never modified.
    """

    req: Request
    prior: tuple[int, ...] = ()

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens + len(self.prior)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]


def _pad(rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _token_counts(
    reqs: Sequence[Request],
    rows: Sequence[SampleRow],
    tokens_of: Callable[[Request], Sequence[int]],
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """``[len(rows), vocab]`` counts of each row's tokens (``tokens_of(req)`` + its prior).

    The requests' own tokens are counted once per request (``reqs`` lists each
    once, in row order) and gathered per row; only priors are added per row.
    """
    index = {id(r): i for i, r in enumerate(reqs)}
    toks = _pad([tokens_of(r) for r in reqs], vocab).to(device)
    counts = torch.zeros(len(reqs), vocab + 1, device=device)
    counts.scatter_add_(1, toks, torch.ones_like(toks, dtype=counts.dtype))
    per_row = counts[torch.tensor([index[id(r.req)] for r in rows], device=device)]
    if any(r.prior for r in rows):
        prior = _pad([r.prior for r in rows], vocab).to(device)
        per_row.scatter_add_(1, prior, torch.ones_like(prior, dtype=per_row.dtype))
    return per_row[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow | Request]) -> None:
    """Presence, frequency (output tokens) and repetition (prompt + output) penalties."""
    srows = [r if isinstance(r, SampleRow) else SampleRow(r) for r in rows]
    vocab = logits.shape[1]
    device = logits.device
    reqs = list({id(r.req): r.req for r in srows}.values())
    presence = torch.tensor([r.req.params.presence_penalty for r in srows], device=device)
    frequency = torch.tensor([r.req.params.frequency_penalty for r in srows], device=device)
    repetition = torch.tensor([r.req.params.repetition_penalty for r in srows], device=device)
    if bool((presence != 0).any()) or bool((frequency != 0).any()):
        counts = _token_counts(reqs, srows, lambda r: r.output_token_ids, vocab, device)
        logits -= frequency[:, None] * counts + presence[:, None] * (counts > 0)
    if bool((repetition != 1.0).any()):
        seen = _token_counts(reqs, srows, lambda r: r.all_token_ids, vocab, device) > 0
        rp = repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits.copy_(torch.where(seen, penalised, logits))


def process_logits(
    logits: torch.Tensor, rows: Sequence[SampleRow], grammar_mask: GrammarMaskFn | None = None
) -> None:
    """In place: logit_bias, min_tokens masks, penalties, then the grammar mask."""
    vocab = logits.shape[1]
    device = logits.device
    # Additive biases and hard masks, gathered as index lists.
    ri: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, row in enumerate(rows):
        r = row.req
        p = r.params
        if p.logit_bias:
            for tok, bias in p.logit_bias.items():
                if tok < vocab:
                    ri.append(i)
                    cols.append(tok)
                    vals.append(bias)
        if row.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            for tok in banned:
                if tok < vocab:
                    ri.append(i)
                    cols.append(tok)
                    vals.append(float("-inf"))
    if ri:
        logits.index_put_(
            (torch.tensor(ri, device=device), torch.tensor(cols, device=device)),
            torch.tensor(vals, device=device),
            accumulate=True,
        )
    if any(
        r.req.params.presence_penalty
        or r.req.params.frequency_penalty
        or r.req.params.repetition_penalty != 1.0
        for r in rows
    ):
        apply_penalties(logits, rows)
    if grammar_mask is not None:
        grammar_mask(logits)


def sampling_probs(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p: the (unnormalised) sampling weights."""
    device = logits.device
    temp = torch.tensor([r.params.temperature for r in reqs], device=device)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    return filter_probs(
        probs,
        top_k=[r.params.top_k for r in reqs],
        top_p=[r.params.top_p for r in reqs],
        min_p=[r.params.min_p for r in reqs],
    )


def exponential_noise(reqs: Sequence[Request], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(reqs), vocab]`` Exp(1) noise, one row per entry, seeded rows from their generator.

    A request listed several times (consecutive verification rows) draws its
    rows in order from its generator, exactly as successive plain steps would.
    """
    noise = torch.empty(len(reqs), vocab, device=device)
    unseeded = [i for i, r in enumerate(reqs) if r.generator is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=device)
        noise[idx] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, r in enumerate(reqs):
        if r.generator is not None:
            noise[i] = torch.empty(vocab).exponential_(generator=r.generator).to(device)
    return noise


class Sampler:
    """Turns a step's logits (one row per sampling request) into tokens."""

    def __call__(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Request],
        grammar_mask: GrammarMaskFn | None = None,
    ) -> SamplerOutput:
        logits = logits.float()
        n = logits.shape[0]
        device = logits.device
        want_logprobs = [r.params.logprobs for r in reqs]
        raw_logprobs = None
        if any(k is not None for k in want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        process_logits(logits, [SampleRow(r) for r in reqs], grammar_mask)

        temps = [r.params.temperature for r in reqs]
        greedy = [t == 0.0 for t in temps]
        tokens = torch.empty(n, dtype=torch.long, device=device)
        if all(greedy):
            # The common serving case (temperature 0): one argmax, no gathers.
            tokens = logits.argmax(dim=-1)
        elif any(greedy):
            g_idx = torch.tensor([i for i, g in enumerate(greedy) if g], device=device)
            tokens[g_idx] = logits[g_idx].argmax(dim=-1)
        if not all(greedy):
            s_list = [i for i, g in enumerate(greedy) if not g]
            s_idx = torch.tensor(s_list, device=device)
            tokens[s_idx] = self._sample(logits[s_idx], [reqs[i] for i in s_list])

        token_list = tokens.tolist()
        logprobs: list[PositionLogprobs | None] = [None] * n
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, tokens, want_logprobs)
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        probs = sampling_probs(logits, reqs)
        noise = exponential_noise(reqs, probs.shape[1], probs.device)
        return (probs / noise).argmax(dim=-1)


def gather_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, want: Sequence[int | None]
) -> list[PositionLogprobs | None]:
    """Row ``i``'s logprob of ``tokens[i]`` and its top-``want[i]`` (None: not asked)."""
    chosen = raw.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max((w for w in want if w is not None), default=0)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        v, ix = raw.topk(k, dim=-1)
        top_vals, top_ids = v.tolist(), ix.tolist()
    toks = tokens.tolist()
    out: list[PositionLogprobs | None] = []
    for i, w in enumerate(want):
        if w is None:
            out.append(None)
            continue
        top = [TokenLogprob(top_ids[i][j], top_vals[i][j]) for j in range(w)] if w else []
        out.append(PositionLogprobs(TokenLogprob(toks[i], chosen[i]), top))
    return out


def filter_probs(
    probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float], min_p: Sequence[float]
) -> torch.Tensor:
    """Zero the probabilities outside top-k, then top-p, then min-p, per row.

    Order: top-k; top-p over the renormalised top-k distribution; min-p
    relative to the most likely token. The result is not renormalised: the
    exponential race samples proportionally to what is left.
    """
    device = probs.device
    vocab = probs.shape[1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if any(p < 1.0 for p in top_p) or any(k < vocab for k in ks):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        keep = ranks < torch.tensor(ks, device=device)[:, None]
        p_t = torch.tensor(top_p, device=device, dtype=probs.dtype)[:, None]
        sorted_p = sorted_p.masked_fill(~keep, 0.0)
        # top-p over what top-k left (renormalised): keep a token while the mass
        # before it is below top_p, so the most likely token always stays.
        before = (sorted_p.cumsum(dim=-1) - sorted_p) / sorted_p.sum(dim=-1, keepdim=True)
        sorted_p = sorted_p.masked_fill(before >= p_t, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    if any(m > 0 for m in min_p):
        m_t = torch.tensor(min_p, device=device, dtype=probs.dtype)[:, None]
        threshold = m_t * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs
