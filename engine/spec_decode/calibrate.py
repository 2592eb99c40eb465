"""Start-up measurements for the adaptive draft rule: forward cost by token count.

Run once when the engine starts with ``"adaptive": true`` (the default), on
blocks no request holds yet (the cache is empty then), so nothing real is
overwritten. The tables are logged and feed ``AdaptiveDraftPolicy``.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.spec_decode.controller import StepCostModel
from engine.worker.model_runner import ModelRunner

# Tokens of context before the measured chunk: verification chunks extend a
# sequence, they do not start one.
CONTEXT = 16


def fake_chunks(
    num_seqs: int,
    tokens_each: int,
    num_blocks: int,
    block_size: int,
    context: int = CONTEXT,
    verification: bool = False,
) -> list[ScheduledRequest] | None:
    """``num_seqs`` sequences computing ``tokens_each`` tokens after ``context`` cached
    ones, on distinct blocks from 0 up (None when the cache is too small).

    ``verification``: each chunk is its last token plus ``tokens_each - 1`` drafts,
    so every row is verified (logits and sampling for all of them), as in a
    speculative step; otherwise only the last row samples."""
    per = -(-(context + tokens_each) // block_size)
    if per * num_seqs > num_blocks:
        return None
    drafts = tokens_each - 1 if verification else 0
    out = []
    for i in range(num_seqs):
        known = context + tokens_each - drafts
        req = Request(
            f"calibrate-{i}",
            "calibrate",
            0,
            [(7 * j + i) % 17 for j in range(known)],  # in any vocabulary
            SamplingParams(temperature=0.0),
        )
        req.block_ids = list(range(i * per, (i + 1) * per))
        s = ScheduledRequest(req, tokens_each, context)
        if drafts:
            s.num_draft_tokens = s.num_lookahead_slots = drafts
            s.set_drafts([(5 * j) % 17 for j in range(drafts)])
        out.append(s)
    return out


def measure_step_cost(
    runner: ModelRunner,
    sizes: Sequence[int],
    num_blocks: int,
    block_size: int,
    plain: bool = False,
) -> StepCostModel:
    """``T(n)``: one target step verifying ``n - 1`` drafts of one sequence
    (``runner.execute``): the linears, logits and verification of ``n`` rows.
    ``plain``: ``P(n)`` instead, one decode-only step of ``n`` sequences without
    drafts (the path plain decode steps take)."""

    def batch(n: int) -> list[ScheduledRequest] | None:
        if plain:
            return fake_chunks(n, 1, num_blocks, block_size)
        return fake_chunks(1, n, num_blocks, block_size, verification=True)

    usable = [n for n in sizes if batch(n) is not None] or [1]

    def run(n: int) -> None:
        chunks = batch(n)
        assert chunks is not None
        runner.execute(chunks)

    return StepCostModel.measure(run, usable, rounds=3)
