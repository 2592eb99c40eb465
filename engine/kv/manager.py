"""The KV manager: hands requests block ids and takes them back.

It owns the BlockPool. Requests hold block ids in ``Request.block_ids``; the
manager is the only code that changes reference counts.
"""

from __future__ import annotations

from engine.kv.block_pool import BlockPool, EvictionPolicy, KVBlock, hash_block
from engine.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction: EvictionPolicy | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, eviction)
        # Counters for /metrics (tokens, not blocks, as vLLM counts them).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- hashing ------------------------------------------------------
    def _update_hashes(self, req: Request, upto_tokens: int) -> None:
        """Extend ``req.block_hashes`` to every full block within ``upto_tokens``."""
        bs = self.block_size
        n_full = min(upto_tokens, req.num_tokens) // bs
        extra = req.cache_extra_key()
        while len(req.block_hashes) < n_full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if i else None
            req.block_hashes.append(
                hash_block(parent, req.all_token_ids[i * bs : (i + 1) * bs], extra)
            )

    # ---- prefix cache -------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Cached blocks holding a prefix of ``req``'s tokens (not yet referenced).

        At least one token is always left to compute, so that the step that
        finishes the prompt produces logits: the hit is capped at
        ``(num_tokens - 1) // block_size`` blocks.
        """
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return []
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        if req.wants_prompt_logprobs:
            # The logprob of prompt token p comes from the hidden state at p - 1,
            # which a hit does not compute: a request that still needs prompt
            # logprobs may skip only positions whose logprobs it already has
            # (all of them after a preemption; none on its first admission).
            max_blocks = min(max_blocks, (req.num_prompt_logprobs - 1) // bs)
        self._update_hashes(req, max_blocks * bs)
        hits: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.lookup(req.block_hashes[i], req.all_token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, req: Request, hit_tokens: int) -> None:
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit_tokens

    # ---- allocation ---------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[KVBlock] = ()) -> bool:  # type: ignore[assignment]
        need = self.blocks_needed(
            req.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        )
        have = len(req.block_ids) + len(cached)
        # Cached blocks with no reference sit in the free count; taking them uses them up.
        evictable_hits = sum(1 for b in cached if b.ref_count == 0)
        return need - have <= self.pool.num_free_blocks - evictable_hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached: list[KVBlock] | None = None
    ) -> bool:
        """Make ``req.block_ids`` cover ``num_computed_tokens (+ cached) + num_new_tokens``.

        ``cached`` are prefix-cache hits from ``find_cached_prefix`` for a
        request with nothing computed yet; on success they join the block
        table and ``num_computed_tokens`` advances past them. Returns False,
        changing nothing, when there are not enough free blocks.
        """
        cached = cached or []
        if not self.can_allocate(req, num_new_tokens, cached):
            return False
        for block in cached:
            self.pool.touch(block)
            req.block_ids.append(block.block_id)
        if cached:
            req.num_computed_tokens += len(cached) * self.block_size
        need = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        while len(req.block_ids) < need:
            req.block_ids.append(self.pool.allocate().block_id)
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register ``req``'s full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        # Capped by the known tokens: accepted drafts are computed before they join
        # ``all_token_ids``; their blocks are hashed on the next call.
        n_full = min(req.num_computed_tokens, req.num_tokens) // bs
        self._update_hashes(req, n_full * bs)
        for i in range(n_full):
            block = self.pool.blocks[req.block_ids[i]]
            if block.block_hash is None:
                self.pool.cache(
                    block, req.block_hashes[i], req.all_token_ids[i * bs : (i + 1) * bs]
                )

    def free_uncomputed_blocks(self, req: Request) -> None:
        """Give back the tail blocks past ``num_computed_tokens`` (rolled-back drafts).

        They were allocated by ``req`` for this step's speculative slots, hold no
        computed token and were never hashed, so they go straight back to the pool.
        """
        need = self.blocks_needed(req.num_computed_tokens)
        while len(req.block_ids) > need:
            self.pool.free(self.pool.blocks[req.block_ids.pop()])

    def free(self, req: Request) -> None:
        """Give back every block ``req`` holds (tail first, so prefixes stay cached longest)."""
        for bid in reversed(req.block_ids):
            self.pool.free(self.pool.blocks[bid])
        req.block_ids = []

    def check_request(self, req: Request) -> None:
        """Debug invariant: the block table covers exactly the computed tokens."""
        if req.is_finished:
            if req.block_ids:
                raise AssertionError(f"finished request {req.request_id} still holds blocks")
            return
        want = self.blocks_needed(req.num_computed_tokens)
        if len(req.block_ids) != want:
            raise AssertionError(
                f"request {req.request_id}: {len(req.block_ids)} blocks for "
                f"{req.num_computed_tokens} computed tokens (want {want})"
            )
