"""Speculative verification: accept a prefix of each request's drafts, then sample one token.

A request with ``k`` drafts ``d_1..d_k`` has ``k + 1`` rows of target logits:
row ``i`` (after the request's tokens and ``d_1..d_i``) predicts the token
at draft position ``i + 1``. Each row is processed exactly as plain sampling
would process it once ``d_1..d_i`` are accepted (engine/sampling/sampler.py,
``SampleRow``), giving the target distribution ``p_i``.

Acceptance (Leviathan et al. / Chen et al. speculative sampling), per draft
position in order, stopping at the first rejection:

* greedy requests: accept ``d_{i+1}`` iff it is the argmax of row ``i``;
* drafts with a distribution ``q`` (a draft model sampling at temperature >
  0): accept with probability ``min(1, p_i(d) / q_i(d))``; on rejection the
  token is drawn from the residual ``max(p_i - q_i, 0)`` (normalised);
* deterministic drafts (n-gram lookup, greedy drafting; ``q`` one-hot): the
  same rule with ``q = 1`` at ``d``: accept with probability ``p_i(d)``, else
  draw from ``p_i`` without ``d``. It is implemented as "draw ``t ~ p_i`` as
  plain sampling would; accept iff ``t == d``; else emit ``t``", which is
  that rule exactly (``P(t = d) = p_i(d)``; given ``t != d``, ``t`` follows
  the residual) and emits, position by position, the very token that plain
  sampling with the same noise would have drawn.

After ``j`` accepted drafts one more token is emitted from row ``j`` (the
rejection's residual sample, or the bonus token when ``j == k``), so every
verification emits ``j + 1`` tokens and the output follows the target
distribution exactly, whatever the drafts.

Randomness: row ``i`` uses one Exp(1) noise vector, drawn like plain
sampling draws it (the request's generator when seeded, in row order). For a
seeded request the generator is rewound to just after the last emitted
row, so each emitted position consumes exactly one draw, as in plain
decoding: with deterministic drafts a seeded request samples the same
tokens with or without speculation. The acceptance test for drafts with a
distribution uses ``u = exp(-e[d])`` (uniform) from the same vector; the
residual race over the other entries is independent of it because the
residual is zero at ``d`` whenever rejection is possible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.outputs import PositionLogprobs
from engine.request import Request
from engine.sampling.sampler import (
    GrammarMaskFn,
    SampleRow,
    gather_logprobs,
    process_logits,
    sampling_probs,
)

# Builds the grammar mask for the given rows (None: no row is constrained).
RowMaskFactory = Callable[[Sequence[SampleRow]], GrammarMaskFn | None]


@dataclass
class VerifyRequest:
    """One request to verify: its drafts and, when they were sampled, their distribution.

    ``draft_probs`` is ``[k, vocab]``: row ``i`` is the normalised distribution
    ``d_{i+1}`` was drawn from. ``None`` means the drafts are deterministic
    (one-hot ``q``). With no drafts the request is sampled plainly.
    """

    req: Request
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return 1 + len(self.draft_token_ids)

    def rows(self) -> list[SampleRow]:
        d = tuple(self.draft_token_ids)
        return [SampleRow(self.req, d[:i]) for i in range(self.num_rows)]


@dataclass
class VerifyOutput:
    """``token_ids``: the accepted drafts, then the one sampled token (``num_accepted + 1``)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]
    num_accepted: int


def _noise(
    items: Sequence[VerifyRequest], rows_of: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    """Exp(1) noise for the sampled rows, in row order; seeded items keep the generator
    state before each of their rows (``states[item][i]``) for the rewind."""
    noise = torch.empty(len(rows_of), vocab, device=device)
    unseeded = [n for n, it in enumerate(rows_of) if items[it].req.generator is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=device)
        noise[idx] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    states: dict[int, list[torch.Tensor]] = {}
    for n, it in enumerate(rows_of):
        gen = items[it].req.generator
        if gen is not None:
            states.setdefault(it, []).append(gen.get_state())
            noise[n] = torch.empty(vocab).exponential_(generator=gen).to(device)
    return noise, states


def _draft_probs(item: VerifyRequest) -> torch.Tensor:
    assert item.draft_probs is not None
    return item.draft_probs


def _acceptance(
    items: Sequence[VerifyRequest],
    first_row: list[int],
    greedy: list[bool],
    t: torch.Tensor,
    probs: torch.Tensor | None,
    noise: torch.Tensor | None,
    s_rows: list[int],
) -> list[bool]:
    """Per row: whether the draft that follows it is accepted (False for last rows)."""
    device = t.device
    follow_list = [-1] * t.shape[0]
    with_q: list[tuple[int, int]] = []  # (item, first row) of drafts with a distribution
    for n, it in enumerate(items):
        if it.draft_token_ids:
            r0 = first_row[n]
            follow_list[r0 : r0 + len(it.draft_token_ids)] = it.draft_token_ids
            if it.draft_probs is not None and not greedy[n]:
                with_q.append((n, r0))
    follow = torch.tensor(follow_list, dtype=torch.long, device=device)
    accept = t == follow  # deterministic drafts: the plain sample equals the draft
    if with_q:
        assert probs is not None and noise is not None
        s_pos = {i: m for m, i in enumerate(s_rows)}
        row_list = [r0 + j for n, r0 in with_q for j in range(len(items[n].draft_token_ids))]
        rows = torch.tensor(row_list, device=device)
        sp = torch.tensor([s_pos[r] for r in row_list], device=device)
        d = follow[rows]
        p_d = probs[sp].gather(1, d[:, None]).squeeze(1) / probs[sp].sum(dim=-1)
        q_d = torch.cat(
            [
                _draft_probs(items[n])
                .gather(1, torch.tensor(items[n].draft_token_ids)[:, None])
                .squeeze(1)
                for n, _ in with_q
            ]
        ).to(device)
        # u = exp(-e[d]) is uniform; accept with probability min(1, p(d) / q(d)).
        u = torch.exp(-noise[sp].gather(1, d[:, None]).squeeze(1))
        accept[rows] = u * q_d < p_d
    out: list[bool] = accept.tolist()
    return out


def _draw_residuals(
    outputs: list[VerifyOutput],
    residual_rows: list[tuple[int, int, int]],
    items: Sequence[VerifyRequest],
    probs: torch.Tensor,
    noise: torch.Tensor,
    s_rows: list[int],
) -> None:
    """Replace the emitted token of each rejected draft with a distribution by a draw
    from the normalised residual ``max(p - q, 0)`` of its row (same noise vector)."""
    device = probs.device
    s_pos = {i: m for m, i in enumerate(s_rows)}
    sp = torch.tensor([s_pos[row] for _, row, _ in residual_rows], device=device)
    p = probs[sp] / probs[sp].sum(dim=-1, keepdim=True)
    q = torch.stack([_draft_probs(items[n])[j] for n, _, j in residual_rows]).to(device)
    residual = (p - q).clamp_min(0.0)
    # p == q leaves no residual, but then rejection cannot happen: keep p.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    drawn = (residual / noise[sp]).argmax(dim=-1).tolist()
    for (n, _, _), tok in zip(residual_rows, drawn):
        outputs[n].token_ids[-1] = tok


def verify(
    logits: torch.Tensor,
    items: Sequence[VerifyRequest],
    grammar_mask_for: RowMaskFactory | None = None,
) -> list[VerifyOutput]:
    """Verify every item's drafts against ``logits`` (``sum(num_rows)`` rows, items in order)."""
    logits = logits.float()
    device = logits.device
    vocab = logits.shape[1]
    rows = [row for it in items for row in it.rows()]
    if len(rows) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} verification rows")
    item_of = [n for n, it in enumerate(items) for _ in range(it.num_rows)]
    first_row = [0]
    for it in items:
        first_row.append(first_row[-1] + it.num_rows)
    want = [rows[i].req.params.logprobs for i in range(len(rows))]
    raw = torch.log_softmax(logits, dim=-1) if any(w is not None for w in want) else None
    process_logits(logits, rows, grammar_mask_for(rows) if grammar_mask_for else None)

    # t[i]: what plain sampling would draw at row i (argmax for greedy rows).
    t = torch.empty(len(rows), dtype=torch.long, device=device)
    greedy = [it.req.params.temperature == 0.0 for it in items]
    g_rows = [i for i in range(len(rows)) if greedy[item_of[i]]]
    s_rows = [i for i in range(len(rows)) if not greedy[item_of[i]]]
    if g_rows:
        gi = torch.tensor(g_rows, device=device)
        t[gi] = logits[gi].argmax(dim=-1)
    probs = noise = None
    states: dict[int, list[torch.Tensor]] = {}
    if s_rows:
        si = torch.tensor(s_rows, device=device)
        probs = sampling_probs(logits[si], [rows[i].req for i in s_rows])
        noise, states = _noise(items, [item_of[i] for i in s_rows], vocab, device)
        t[si] = (probs / noise).argmax(dim=-1)
    # accept[i]: the draft after row i (d at draft position i + 1) is accepted.
    accept = _acceptance(items, first_row, greedy, t, probs, noise, s_rows)
    t_list = t.tolist()
    outputs: list[VerifyOutput] = []
    emitted_rows: list[int] = []
    emitted_tokens: list[int] = []
    residual_rows: list[tuple[int, int, int]] = []  # (output, row, draft position)
    for n, it in enumerate(items):
        r0 = first_row[n]
        drafts = it.draft_token_ids
        j = 0
        while j < len(drafts) and accept[r0 + j]:
            j += 1
        # The emitted token after j accepted drafts: the plain sample of row j (the
        # bonus token, or the residual's draw for deterministic drafts); drafts with
        # a distribution draw from their residual instead (filled in below).
        tokens = [*drafts[:j], t_list[r0 + j]]
        if j < len(drafts) and it.draft_probs is not None and not greedy[n]:
            residual_rows.append((n, r0 + j, j))
        gen = it.req.generator
        if gen is not None and n in states and j + 1 < len(states[n]):
            gen.set_state(states[n][j + 1])  # one draw per emitted position
        outputs.append(VerifyOutput(tokens, [None] * len(tokens), j))
        emitted_rows.extend(range(r0, r0 + j + 1))
    if residual_rows:
        assert probs is not None and noise is not None
        _draw_residuals(outputs, residual_rows, items, probs, noise, s_rows)
    for out in outputs:
        emitted_tokens.extend(out.token_ids)
    if raw is not None:
        lps = gather_logprobs(
            raw[torch.tensor(emitted_rows, device=device)],
            torch.tensor(emitted_tokens, device=device),
            [want[i] for i in emitted_rows],
        )
        k = 0
        for out in outputs:
            out.logprobs = lps[k : k + len(out.token_ids)]
            k += len(out.token_ids)
    return outputs
