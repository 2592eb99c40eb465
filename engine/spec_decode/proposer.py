"""The proposer contract: drafts for the chunks the scheduler reserved slots for.

A step with speculation runs: the planner sets each decoding request's
``num_lookahead_tokens``; the scheduler reserves that many slots past the
request's last token (engine/scheduler.py); the proposer fills them
(``propose``); the target verifies every draft in the step's one forward
pass (engine/sampling/rejection.py); the scheduler rolls back what was not
kept (``num_computed_drafts``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv.format import KVFormat, LayerCaches
from engine.request import Request
from engine.sampling.rejection import RowMaskFactory
from engine.scheduler import ScheduledRequest


@dataclass
class Proposal:
    """Drafts for one request; ``draft_probs`` ``[k, vocab]`` when they were sampled
    (row ``i``: the normalised distribution draft ``i`` was drawn from), None when
    they are deterministic (n-gram lookup, greedy drafting)."""

    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None


class Proposer(ABC):
    """Strategy that drafts tokens. One instance per engine, driven by its step thread."""

    name: str = "abstract"

    def available(self, req: Request, k: int) -> int:
        """How many of ``k`` drafts ``req`` could get now (the planner asks before
        scheduling). The default: all of them (a draft model always proposes)."""
        return k

    @abstractmethod
    def propose(
        self, batch: Sequence[ScheduledRequest], mask_for: RowMaskFactory | None
    ) -> dict[str, Proposal]:
        """Drafts for the chunks of ``batch`` with reserved slots, at most
        ``num_lookahead_slots`` each, keyed by request id.

        Called after scheduling and before the target's forward pass, with the
        whole step's batch: a proposer with its own KV cache computes it here for
        every scheduled token (the same block ids as the target), so that it
        stays valid wherever the target's is. ``mask_for`` builds grammar masks
        for rows of structured-output requests.
        """

    def num_computed_drafts(self, num_drafts: int, num_accepted: int) -> int:
        """Of ``num_accepted`` accepted drafts, how many have KV in every model's cache.

        The target computed all of them; a proposer with its own cache may not
        have seen the last draft (it drafted it, but never ran it): the request's
        computed tokens stop before such a position, which is recomputed next step.
        """
        return num_accepted

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request ended: drop any state kept for it."""

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token of the proposer's own cache (0: none)."""
        return 0

    def kv_format(self, block_size: int) -> KVFormat | None:
        """The layout of the proposer's own cache (None: it has none). The engine
        groups it with the target's (engine/kv/format.py ``GroupedKVFormat``), so
        the KV tiers move the draft's blocks with the target's."""
        return None

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the proposer's cache for the engine's block count (if it has one)."""
        return None

    def cache_tensors(self) -> LayerCaches:
        """The proposer's per-layer caches, in ``kv_format``'s layout (empty: none)."""
        return []
