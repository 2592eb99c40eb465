"""The KV policy contract: given what is known about a sequence's cached tokens,
say which to keep.

A policy sees only an :class:`EvictionContext` (tensors indexed by *cache
slot*: slot ``c`` holds the ``c``-th kept token, rotated at position ``c``)
and returns the cache slots to keep. It never touches blocks: the runtime
(engine/kv/policies/runtime.py) compacts the kept slots and gives the freed
blocks back through the KV manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from engine.segments import Segment


@dataclass
class EvictionContext:
    """One sequence's cache, slot by slot, at the moment a policy must choose.

    Attributes:
        kv_len: cached tokens (slots ``0 .. kv_len - 1``).
        budget: the most slots to keep (the keep-set may be smaller).
        sinks: the first ``sinks`` slots are always kept (attention sinks).
        token_index: int64 ``[kv_len]``, the token index (in ``all_token_ids``)
            each slot holds; increasing.
        mass: float32 ``[kv_len]``, attention mass each slot's key received,
            accumulated since it was computed (None: the policy did not ask).
        keys: float32 ``[layers, kv_len, features]``, each slot's key per layer
            (heads concatenated; None: the policy did not ask).
        segments: the prompt's segments (token spans; may be empty).
        segment_of: int64 ``[kv_len]``, index into ``segments`` of the segment
            each slot's token belongs to, -1 for none (generated tokens).
        protected: indices into ``segments`` that are never evicted (the
            system prompt and the newest user turn).
    """

    kv_len: int
    budget: int
    sinks: int
    token_index: torch.Tensor
    mass: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    segments: tuple[Segment, ...] = ()
    segment_of: torch.Tensor | None = None
    protected: frozenset[int] = frozenset()

    def segment_ids(self) -> torch.Tensor:
        if self.segment_of is not None:
            return self.segment_of
        return torch.full((self.kv_len,), -1, dtype=torch.int64)


class KVPolicy(ABC):
    """Chooses the cache slots a sequence keeps once it outgrows its budget."""

    name: str = "abstract"

    @property
    @abstractmethod
    def needs_mass(self) -> bool:
        """Whether ``select`` reads ``ctx.mass`` (the attention kernels then emit it)."""

    @property
    @abstractmethod
    def needs_keys(self) -> bool:
        """Whether ``select`` reads ``ctx.keys`` (gathered from the cache)."""

    @property
    @abstractmethod
    def reads_segments(self) -> bool:
        """Whether ``select`` reads ``ctx.segments`` (and keeps ``ctx.protected``):
        only then does the server render a chat request's segments for it."""

    @abstractmethod
    def forced_tokens(self, budget: int, sinks: int) -> int:
        """Slots the policy keeps whatever the scores (sinks plus recent window)."""

    @abstractmethod
    def select(self, ctx: EvictionContext) -> torch.Tensor:
        """The slots to keep: int64, strictly increasing, at most ``ctx.budget``
        long unless protected slots alone exceed it. Always includes the first
        ``ctx.sinks`` slots."""


def protected_segments(segments: tuple[Segment, ...]) -> frozenset[int]:
    """The system prompt(s) and the newest user turn: never evicted."""
    keep = {i for i, s in enumerate(segments) if s.kind == "system"}
    users = [i for i, s in enumerate(segments) if s.kind == "user"]
    if users:
        newest = max(segments[i].turn for i in users)
        keep.update(i for i in users if segments[i].turn == newest)
    return frozenset(keep)


def segment_index(token_index: torch.Tensor, segments: tuple[Segment, ...]) -> torch.Tensor:
    """``segment_of`` for ``token_index``: the segment holding each token, -1 for none.

    Segments must not overlap (the renderer tags disjoint spans); vectorised
    with one ``searchsorted`` over the sorted span starts.
    """
    n = int(token_index.shape[0])
    if not segments:
        return torch.full((n,), -1, dtype=torch.int64)
    order = sorted(range(len(segments)), key=lambda i: segments[i].start)
    starts = torch.tensor([segments[i].start for i in order], dtype=torch.int64)
    ends = torch.tensor([segments[i].end for i in order], dtype=torch.int64)
    ids = torch.tensor(order, dtype=torch.int64)
    j = torch.searchsorted(starts, token_index, right=True) - 1
    jc = j.clamp(min=0)
    inside = (j >= 0) & (token_index < ends[jc])
    return torch.where(inside, ids[jc], torch.full_like(token_index, -1))
