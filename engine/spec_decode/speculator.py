"""The engine's side of speculative decoding: plan, propose, roll back, count.

Per step (engine/llm_engine.py):

1. ``plan(running)`` sets each decoding request's ``num_lookahead_tokens``
   (the draft policy's count, capped by what the proposer has, by
   ``max_tokens`` and by ``disable_by_batch_size``);
2. the scheduler reserves those slots (engine/scheduler.py);
3. ``propose(batch)`` fills them (the proposer), dropping any draft the
   request's grammar forbids, and everything after it, before verification;
4. the target's forward verifies (engine/sampling/rejection.py);
5. ``rolled_back(batch, result)`` tells the scheduler how many trailing
   positions of each chunk to give back; ``observe`` feeds acceptance to the
   policy and the counters (vLLM's ``spec_decode_*`` metrics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.request import Request
from engine.sampling.rejection import RowMaskFactory
from engine.scheduler import ScheduledRequest
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.controller import Candidate, DraftPolicy
from engine.spec_decode.proposer import Proposer


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's names): verifications with drafts, draft tokens,
    accepted drafts, and accepted drafts per position (index 0: the first draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, policy: DraftPolicy) -> None:
        self.config = config
        self.proposer = proposer
        self.policy = policy
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def plan(self, running: Iterable[Request], budget: int) -> None:
        """Set ``num_lookahead_tokens`` on every running request (0: no drafts)."""
        reqs = list(running)
        k = self.config.num_speculative_tokens
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(reqs) >= limit
        candidates: list[Candidate] = []
        owners: list[Request] = []
        base = 0
        decode_only = True
        for req in reqs:
            req.num_lookahead_tokens = 0
            todo = req.num_tokens - req.num_computed_tokens
            base += min(todo, budget)
            decode_only = decode_only and todo == 1
            # Drafts go after the last sampled token: only decoding requests draft.
            if off or req.num_output_tokens == 0 or todo > 2:
                continue
            room = k
            if req.params.max_tokens is not None:
                # A verification emits up to drafts + 1 tokens.
                room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
            room = min(room, req.max_model_len - req.num_tokens - 1)
            if room <= 0:
                continue
            candidates.append(Candidate(req.request_id, self.proposer.available(req, room)))
            owners.append(req)
        if not candidates:
            return
        for req, n in zip(owners, self.policy.draft_counts(candidates, base, decode_only)):
            req.num_lookahead_tokens = n

    def propose(
        self, batch: Sequence[ScheduledRequest], mask_for: RowMaskFactory | None
    ) -> dict[str, torch.Tensor | None]:
        """Fill the reserved slots of ``batch``; the drafts' distributions by request id."""
        proposals = self.proposer.propose(batch, mask_for)
        probs: dict[str, torch.Tensor | None] = {}
        for s in batch:
            if not s.num_lookahead_slots:
                continue
            p = proposals.get(s.req.request_id)
            drafts = p.draft_token_ids if p is not None else []
            q = p.draft_probs if p is not None else None
            grammar = s.req.grammar
            if grammar is not None and drafts:
                # A draft the grammar forbids is rejected before verification.
                drafts = drafts[: grammar.valid_prefix_length(drafts)]
            s.set_drafts(drafts)
            if s.num_draft_tokens:
                probs[s.req.request_id] = None if q is None else q[: s.num_draft_tokens]
        return probs

    def rolled_back(
        self, batch: Sequence[ScheduledRequest], accepted: Mapping[str, int]
    ) -> dict[str, int]:
        """Trailing positions of each verification chunk whose KV is not kept."""
        out: dict[str, int] = {}
        for s in batch:
            k = s.num_draft_tokens
            if not k:
                continue
            j = accepted.get(s.req.request_id, 0)
            out[s.req.request_id] = k - self.proposer.num_computed_drafts(k, j)
        return out

    def observe(
        self,
        batch: Sequence[ScheduledRequest],
        accepted: Mapping[str, int],
        target_seconds: float | None = None,
    ) -> None:
        """Count the step's verifications (and feed the target forward's time to the
        policy's cost table); the step's lookahead requests are spent."""
        if target_seconds is not None:
            plain = all(s.num_new_tokens == 1 and not s.num_draft_tokens for s in batch)
            self.policy.observe_step(sum(s.num_new_tokens for s in batch), target_seconds, plain)
        st = self.stats
        for s in batch:
            s.req.num_lookahead_tokens = 0
            k = s.num_draft_tokens
            if not k:
                continue
            j = accepted.get(s.req.request_id, 0)
            st.num_drafts += 1
            st.num_draft_tokens += k
            st.num_accepted_tokens += j
            for i in range(j):
                st.accepted_per_pos[i] += 1
            self.policy.observe(s.req.request_id, k, j)
        self.policy.end_step()

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.policy.forget(request_id)
