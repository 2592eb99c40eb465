"""Applies KV policies to the paged cache: compaction plus re-rotation.

Token-level eviction on paged blocks, by **compaction** (the choice and its
measured cost: docs/benchmarks/long-context.md, benchmarks/kv_evict_bench.py):
a request's kept tokens are packed into the front of its block table, so its
cache is always dense, slot ``c`` holding its ``c``-th kept token with the key
rotated at position ``c`` (positions are assigned within the cache, as in
StreamingLLM). The attention backends, the metadata and the CUDA graphs are
unchanged (a sequence is ``num_kv_tokens`` long), and a request's memory is
``ceil(num_kv_tokens / block_size)`` blocks, bounded by its budget. The
alternative, per-slot validity masks, would leave H2O-style scattered holes
in blocks that can be freed only once every slot in them is dead, and make
every attention kernel read and mask the dead slots.

A compaction (``budget + interval`` tokens reached, back down to the
selected keep-set):

1. the policy selects the slots to keep (engine/kv/policies/vote.py);
2. blocks before the first dropped slot stay as they are (a shared
   prefix-cache block is never edited);
3. the kept keys/values from there on are gathered, the request's blocks from
   there on are given back and fresh blocks taken (KVCacheManager), and the
   gathered slots are written into them: an edited block is always a fresh,
   private block, never hashed (``cache_computed_blocks`` stops hashing a
   request once it has evicted);
4. the moved keys are re-rotated from their old cache position to the new one
   (``KVFormat.rerotate_keys``; Triton on CUDA, the torch reference elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv.format import KVFormat, LayerCaches
from engine.kv.manager import KVCacheManager
from engine.kv.policies.base import EvictionContext, KVPolicy, protected_segments, segment_index
from engine.kv.policies.resolve import KVPolicySpec
from engine.kv.policies.state import KVPolicyState
from engine.kv.policies.vote import make_policy
from engine.request import Request, Segment


class KVPolicyRuntime:
    """Owns the per-request policy states' life cycle and the compactions."""

    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        kv_format: KVFormat,
        caches: LayerCaches,
        cos_sin: Callable[[], torch.Tensor],
    ) -> None:
        """``cos_sin()`` gives the model's RoPE table ``[positions, head_dim]``."""
        self.kv = kv
        self.kv_format = kv_format
        self.caches = caches
        self.cos_sin = cos_sin
        self.block_size = kv.block_size
        self._policies: dict[str, KVPolicy] = {}
        self._vote_weights = config.vote_weights
        self.num_compactions = 0
        self.num_evicted_tokens = 0

    def policy(self, name: str) -> KVPolicy:
        p = self._policies.get(name)
        if p is None:
            p = make_policy(name, self._vote_weights)
            self._policies[name] = p
        return p

    def reads_segments(self, name: str) -> bool:
        """Whether requests under policy ``name`` need their chat segments."""
        return name != "full" and self.policy(name).reads_segments

    def new_state(self, spec: KVPolicySpec, segments: tuple[Segment, ...]) -> KVPolicyState:
        """The state of a new request under ``spec``; InvalidRequestError when the
        slots the policy must keep (sinks, recent window, protected segments)
        cannot fit the budget."""
        policy = self.policy(spec.name)
        protected = protected_segments(segments)
        forced = policy.forced_tokens(spec.budget, spec.sinks)
        forced += sum(segments[i].end - segments[i].start for i in protected)
        if forced > spec.budget:
            raise InvalidRequestError(
                f"kv_policy: the tokens policy {spec.name} must keep (sinks, recent window, "
                f"system prompt and newest user turn: {forced}) exceed budget_tokens "
                f"({spec.budget})",
                param="kv_policy",
            )
        return KVPolicyState(policy, spec.budget, spec.sinks, spec.interval, segments, protected)

    @staticmethod
    def wants_mass(reqs: Sequence[Request]) -> bool:
        return any(r.kv_state is not None and r.kv_state.policy.needs_mass for r in reqs)

    def after_step(self, reqs: Sequence[Request], masses: Mapping[str, torch.Tensor]) -> None:
        """After ``num_computed_tokens`` advanced: record the step, compact the
        requests that reached their cap."""
        for req in reqs:
            st = req.kv_state
            if st is None or req.is_finished:
                continue
            st.sync(req.num_kv_tokens, req.num_computed_tokens, masses.get(req.request_id))
            if req.num_kv_tokens >= st.cap and req.num_kv_tokens > st.budget:
                self.evict(req)

    def context(self, req: Request) -> EvictionContext:
        st = req.kv_state
        assert st is not None
        n = req.num_kv_tokens
        keys = self._gather_keys(req, n) if st.policy.needs_keys else None
        return EvictionContext(
            kv_len=n,
            budget=st.budget,
            sinks=st.sinks,
            token_index=st.token_index,
            mass=st.mass if st.policy.needs_mass else None,
            keys=keys,
            segments=st.segments,
            segment_of=segment_index(st.token_index, st.segments),
            protected=st.protected,
        )

    def evict(self, req: Request) -> None:
        """Select the keep-set and compact ``req``'s cache to it."""
        st = req.kv_state
        assert st is not None
        keep = st.policy.select(self.context(req))
        n = req.num_kv_tokens
        if int(keep.shape[0]) == n:
            return
        self.compact(req, keep)
        st.keep(keep)
        req.num_evicted_tokens += n - int(keep.shape[0])
        self.num_compactions += 1
        self.num_evicted_tokens += n - int(keep.shape[0])

    def _slots(self, req: Request, cache_pos: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(req.block_ids, dtype=torch.int64)
        bs = self.block_size
        return table[cache_pos // bs] * bs + cache_pos % bs

    def _gather_keys(self, req: Request, n: int) -> torch.Tensor:
        slots = self._slots(req, torch.arange(n, dtype=torch.int64))
        out = []
        for k_cache, _ in self.caches:
            flat = k_cache.view(-1, k_cache.shape[2] * k_cache.shape[3])
            out.append(flat.index_select(0, slots.to(flat.device)).float().cpu())
        return torch.stack(out)

    def compact(self, req: Request, keep: torch.Tensor) -> None:
        """Move the kept slots ``keep`` (increasing cache positions) to ``0..m-1``."""
        bs = self.block_size
        m = int(keep.shape[0])
        moved = torch.nonzero(keep != torch.arange(m, dtype=torch.int64))
        first = int(moved[0, 0]) if moved.numel() else m
        b0 = first // bs  # blocks before b0 keep their contents and ids
        src_pos = keep[b0 * bs :]
        device = self.caches[0][0].device
        src = self._slots(req, src_pos).to(device)
        data = [
            (k.view(-1, *k.shape[2:])[src], v.view(-1, *v.shape[2:])[src]) for k, v in self.caches
        ]
        new_ids = self.kv.replace_blocks(req, b0, -(-m // bs))
        st = req.kv_state
        if st is not None:
            fe = st.first_edited_block
            st.first_edited_block = b0 if fe is None else min(fe, b0)
        if not new_ids:
            return
        dst_pos = torch.arange(b0 * bs, m, dtype=torch.int64)
        dst = self._slots(req, dst_pos).to(device)
        for (k, v), (kd, vd) in zip(self.caches, data):
            k.view(-1, *k.shape[2:])[dst] = kd
            v.view(-1, *v.shape[2:])[dst] = vd
        # Re-rotate the moved keys: old position = source cache slot, new = destination.
        span = len(new_ids) * bs
        new_pos = torch.arange(b0 * bs, b0 * bs + span, dtype=torch.int64)
        old_pos = new_pos.clone()
        old_pos[: m - b0 * bs] = src_pos
        self.kv_format.rerotate_keys(
            self.caches,
            torch.tensor(new_ids, dtype=torch.int64),
            old_pos.view(-1, bs),
            new_pos.view(-1, bs),
            self.cos_sin(),
        )
