"""Per-request KV policy state: the policy, its limits, and what it knows per cache slot."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kv.policies.base import KVPolicy
from engine.segments import Segment


@dataclass
class KVPolicyState:
    """Owned by one request (``Request.kv_state``); only the policy runtime changes it.

    ``token_index`` and ``mass`` are indexed by cache slot and cover exactly
    the request's ``num_kv_tokens`` slots after :meth:`sync`; ``reset`` (the
    request lost its KV: recompute preemption) empties them.
    """

    policy: KVPolicy
    budget: int
    sinks: int
    interval: int
    segments: tuple[Segment, ...] = ()
    protected: frozenset[int] = frozenset()
    token_index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    mass: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float32))
    num_evictions: int = 0  # compactions so far
    # The first block index any compaction rewrote since the cache was built
    # (None: none); from there on every block is private (checked invariant).
    first_edited_block: int | None = None
    num_evicted: int = 0  # tokens dropped so far (kept across preemptions: a counter)

    @property
    def cap(self) -> int:
        """The most tokens the cache holds after a step (``Request.kv_cap``)."""
        return self.budget + self.interval

    def reset(self) -> None:
        self.first_edited_block = None
        self.token_index = torch.zeros(0, dtype=torch.int64)
        self.mass = torch.zeros(0, dtype=torch.float32)

    def sync(self, kv_len: int, num_computed: int, step_mass: torch.Tensor | None) -> None:
        """Cover ``kv_len`` slots: the new ones hold the newest tokens (a step's
        chunk, or a prefix hit taken at admission), up to ``num_computed``.
        ``step_mass`` (float32 ``[kv_len]``) is this step's attention mass."""
        have = int(self.token_index.shape[0])
        if have < kv_len:
            new = torch.arange(num_computed - (kv_len - have), num_computed, dtype=torch.int64)
            self.token_index = torch.cat([self.token_index, new])
            self.mass = torch.cat([self.mass, torch.zeros(kv_len - have, dtype=torch.float32)])
        if step_mass is not None:
            self.mass += step_mass[:kv_len].to(device="cpu", dtype=torch.float32)

    def keep(self, slots: torch.Tensor) -> None:
        """Only ``slots`` (increasing) stay, renumbered from 0."""
        dropped = int(self.token_index.shape[0]) - int(slots.shape[0])
        self.token_index = self.token_index[slots]
        self.mass = self.mass[slots]
        self.num_evictions += 1
        self.num_evicted += dropped
