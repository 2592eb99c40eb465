"""The KV manager: hands requests block ids and takes them back.

It owns the BlockPool (the device tier) and, when tiers are configured, the
``KVHierarchy`` below it (host, disk). Requests hold block ids in
``Request.block_ids``; the manager is the only code that changes reference
counts or pins.

One scheduling model: a prefix hit from any tier, and a swapped-out request
coming back, are both a :class:`PrefixHit`: blocks that join the request's
table and advance ``num_computed_tokens`` without compute. Blocks found on
the device are shared (a reference); blocks found below get a fresh device
block each and a host->device copy in this step's transfer plan. The
scheduler never sees which tier a block came from.

Partial prefix hits (``enable_partial_hits``): where a prompt's chain of
cached blocks ends, a cached block that continues the same prefix may still
share its first tokens with the prompt's next block (the same question asked
again, with a different ending; the same chat with a new turn). The hit then
also takes those tokens, rounded down to the format's granularity: a fresh
block for the request, and a block copy queued for this step (the whole
source row: the slots past the shared tokens are overwritten by the
request's own compute before anything reads them). The source block holds
one extra reference from the moment the hit is taken until the copy ran
(``run_block_copies``), so that nothing evicts or rewrites it in between.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockPool, EvictionPolicy, KVBlock, hash_block
from engine.kv.events import KVEventCollector
from engine.kv.hierarchy import KVHierarchy, TransferPlan, TransferTicket
from engine.kv.host_tier import HostEntry
from engine.kv.tier import BlockMeta
from engine.request import Request
from engine.stats import KVTierSnapshot, TierStats

ORIGINS = ("device", "host", "disk")


@dataclass
class PrefixHit:
    """Blocks a request may take instead of computing them, in table order.

    ``sources[i]`` is a device block (shared) or a host entry (copied into a
    new device block); ``origins[i]`` names the tier it was found in
    (``device``, ``host``, or ``disk``: staged into the host tier already).
    ``num_tokens`` is what the hit advances ``num_computed_tokens`` by: whole
    blocks for a prefix hit (plus ``partial_tokens``), exactly the computed
    tokens for a swap-in. ``partial`` is a cached device block whose first
    ``partial_tokens`` tokens continue the hit (copied into a new block when
    the hit is taken; see the module doc). ``len`` counts whole blocks
    (``sources``); a hit is true when it has any, or a partial block.
    """

    sources: list[KVBlock | HostEntry] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)
    num_tokens: int = 0
    swap: bool = False
    partial: KVBlock | None = None
    partial_tokens: int = 0

    def __len__(self) -> int:
        return len(self.sources)

    def __bool__(self) -> bool:
        return bool(self.sources) or self.partial is not None

    def tokens_from(self, origin: str, block_size: int) -> int:
        """Prompt tokens of this hit found in tier ``origin`` (whole blocks)."""
        return block_size * sum(1 for o in self.origins if o == origin)

    @property
    def device_blocks(self) -> list[KVBlock]:
        return [s for s in self.sources if not isinstance(s, HostEntry)]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction: EvictionPolicy | None = None,
        hierarchy: KVHierarchy | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hierarchy = hierarchy
        self.pool = BlockPool(
            num_blocks, eviction, on_evict=self._demote if hierarchy is not None else None
        )
        # Counters for /metrics (tokens, not blocks, as vLLM counts them).
        self.prefix_queries = 0
        self.prefix_hits = 0  # found on the device (vLLM's local prefix cache)
        self.hits_by_tier = dict.fromkeys(ORIGINS, 0)  # every tier, tokens
        # Async copies: a request may run only once every block it holds has
        # arrived (request id -> tickets; device block id -> ticket).
        self._waits: dict[str, list[TransferTicket]] = {}
        self._pending_blocks: dict[int, TransferTicket] = {}
        self._swap_serial = 0
        # Partial prefix hits: 0 = off, else tokens are taken in multiples of it.
        self.partial_granularity = 0
        self.partial_hit_tokens = 0  # counter: tokens served by partial hits
        # Block copies queued by partial hits, (source, destination) device ids,
        # each source holding one reference until run_block_copies.
        self._copies: list[tuple[int, int]] = []

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def enable_partial_hits(self, granularity: int) -> None:
        """Let prefix hits end inside a block, at multiples of ``granularity``
        tokens (1 for plain formats; a quantized format's group size). The
        engine enables it only where it can run ``run_block_copies``."""
        if not 1 <= granularity <= self.block_size:
            raise ValueError(f"partial-hit granularity {granularity} outside 1..{self.block_size}")
        self.partial_granularity = granularity

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _positions(self, index: int) -> range:
        return range(index * self.block_size, (index + 1) * self.block_size)

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

    @staticmethod
    def _family(req: Request, index: int) -> bytes:
        """The children-index key of block ``index`` of ``req`` (see BlockPool):
        its parent's key, or a root key per tenant (cache salt, adapter) for a
        chain's first block, so that partial hits never cross tenants."""
        if index:
            return req.block_hashes[index - 1]
        return hashlib.sha256(b"fuel-root" + req.cache_extra_key()).digest()

    def _partial_tail(self, req: Request, index: int, limit: int) -> tuple[KVBlock | None, int]:
        """The cached block continuing ``req``'s first ``index`` blocks that shares
        the most leading tokens with its block ``index``, and how many it shares
        (at most ``limit``, rounded down to the granularity); (None, 0) if none.
        Cost: one comparison per cached sibling (bounded by the distinct
        continuations of one prefix), at admission only."""
        g = self.partial_granularity
        if not g or limit < g:
            return None, 0
        bs = self.block_size
        want = tuple(req.all_token_ids[index * bs : index * bs + min(bs, limit)])
        best: KVBlock | None = None
        best_n = 0
        for block in self.pool.children(self._family(req, index)):
            assert block.token_ids is not None
            # At most block_size tokens, once per sibling, at admission only.
            n = next(
                (j for j, (x, y) in enumerate(zip(block.token_ids, want)) if x != y), len(want)
            )
            if n > best_n:
                best, best_n = block, n
        best_n -= best_n % g
        return (best, best_n) if best_n else (None, 0)

    # ---- prefix cache -------------------------------------------------
    def find_cached_prefix(self, req: Request) -> PrefixHit:
        """Blocks holding a prefix of ``req``'s tokens, from any tier (not yet referenced).

        At least one token is always left to compute, so that the step that
        finishes the prompt produces logits: the hit is capped at
        ``(num_tokens - 1) // block_size`` blocks. A swapped-out request gets
        its own blocks back instead (see :meth:`swap_out`). Disk hits are read
        and verified here, before any hit is granted, and staged into the host
        tier; nothing else changes (a hit that is not allocated costs nothing).
        """
        if req.swapped_blocks:
            return self._swapped_hit(req)
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return PrefixHit()
        bs = self.block_size
        limit = req.num_tokens - 1  # tokens a hit may cover
        if req.kv_cap is not None:
            # A KV policy's cap: the hit must leave room for one computed token.
            limit = min(limit, req.kv_cap - 1)
        if req.wants_prompt_logprobs:
            # The logprob of prompt token p comes from the hidden state at p - 1,
            # which a hit does not compute: a request that still needs prompt
            # logprobs may skip only positions whose logprobs it already has
            # (all of them after a preemption; none on its first admission).
            limit = min(limit, req.num_prompt_logprobs - 1)
        max_blocks = max(limit, 0) // bs
        self._update_hashes(req, max_blocks * bs)
        below = self.hierarchy
        sources: list[KVBlock | HostEntry | None] = []
        origins: list[str] = []
        disk_at: list[int] = []  # chain indices only the disk tier holds
        disk_meta: list[BlockMeta] = []
        for i in range(max_blocks):
            key = req.block_hashes[i]
            tokens = req.all_token_ids[i * bs : (i + 1) * bs]
            block = self.pool.lookup(key, tokens)
            found = (
                block
                if block is not None
                else (below.locate(key, tokens) if below is not None else False)
            )
            if found is False:
                break
            if found is True:
                sources.append(None)  # read below, in one batch
                disk_at.append(i)
                parent = req.block_hashes[i - 1] if i else None
                disk_meta.append(BlockMeta(key, tuple(tokens), self._positions(i), parent))
            else:
                sources.append(found)
            if block is not None:
                origins.append("device")
            elif isinstance(found, HostEntry) and not found.from_disk:
                origins.append("host")
            else:
                origins.append("disk")
        if disk_at and below is not None:
            # Pin this hit's host entries while staging, so that staging cannot
            # evict them; released at once (nothing runs in between until
            # allocate_slots pins what it takes).
            held = [s for s in sources if isinstance(s, HostEntry)]
            for e in held:
                below.host.pin(e)
            staged = below.stage_from_disk(disk_meta)
            for e in held:
                below.host.unpin(e)
            for j, e in zip(disk_at, staged):
                sources[j] = e
            if len(staged) < len(disk_at):  # a block failed its checks: the hit ends there
                cut = disk_at[len(staged)]
                del sources[cut:], origins[cut:]
        hit = PrefixHit([s for s in sources if s is not None], origins)
        hit.num_tokens = len(hit.sources) * bs
        # Where the chain ends (a miss, the cap, or a disk block that failed its
        # checks), a cached sibling on the device may continue it partway.
        hit.partial, hit.partial_tokens = self._partial_tail(
            req, len(hit.sources), limit - hit.num_tokens
        )
        hit.num_tokens += hit.partial_tokens
        return hit

    def _swapped_hit(self, req: Request) -> PrefixHit:
        """A swapped-out request's blocks: on the device if still cached there, else the host."""
        bs = self.block_size
        hit = PrefixHit(num_tokens=req.swapped_tokens, swap=True)
        for i, e in enumerate(req.swapped_blocks):
            block = None
            if not e.private:
                block = self.pool.lookup(e.key, req.all_token_ids[i * bs : (i + 1) * bs])
            hit.sources.append(block if block is not None else e)
            hit.origins.append("device" if block is not None else "host")
        return hit

    def record_prefix_query(self, req: Request, hit: PrefixHit) -> None:
        """Count a first admission's lookup (tokens), by the tier each hit came from."""
        bs = self.block_size
        device = hit.tokens_from("device", bs) + hit.partial_tokens
        self.partial_hit_tokens += hit.partial_tokens
        host = hit.tokens_from("host", bs)
        disk = hit.tokens_from("disk", bs)
        req.cached_tokens_by_tier = {"device": device, "host": host, "disk": disk}
        self.prefix_queries += req.num_tokens
        self.prefix_hits += device
        self.hits_by_tier["device"] += device
        self.hits_by_tier["host"] += host
        self.hits_by_tier["disk"] += disk
        if self.hierarchy is not None:
            self.hierarchy.record_query(req.num_tokens - device, host, disk)

    # ---- allocation ---------------------------------------------------
    def can_allocate(
        self, req: Request, num_new_tokens: int, cached: PrefixHit | None = None
    ) -> bool:
        hit = cached or PrefixHit()
        need = self.blocks_needed(req.num_kv_tokens + hit.num_tokens + num_new_tokens)
        on_device = hit.device_blocks
        have = len(req.block_ids) + len(on_device)
        # Cached blocks with no reference sit in the free count; taking them uses
        # them up (a partial hit's source too: it is referenced until its copy).
        evictable_hits = sum(1 for b in on_device if b.ref_count == 0)
        if hit.partial is not None and hit.partial.ref_count == 0:
            evictable_hits += 1
        return need - have <= self.pool.num_free_blocks - evictable_hits

    def allocate_slots(
        self, req: Request, num_new_tokens: int, cached: PrefixHit | None = None
    ) -> bool:
        """Make ``req.block_ids`` cover ``num_computed_tokens (+ hit) + num_new_tokens``.

        ``cached`` is a hit from ``find_cached_prefix`` for a request with
        nothing computed yet; on success its blocks join the block table (a
        host block gets a new device block and a copy in this step's plan) and
        ``num_computed_tokens`` advances by ``cached.num_tokens``. Returns
        False, changing nothing, when there are not enough free blocks.
        """
        hit = cached if cached else None
        if not self.can_allocate(req, num_new_tokens, hit):
            return False
        if hit is not None:
            self._take_hit(req, hit)
        need = self.blocks_needed(req.num_kv_tokens + num_new_tokens)
        while len(req.block_ids) < need:
            block = self.pool.allocate()
            block.positions = self._positions(len(req.block_ids))
            req.block_ids.append(block.block_id)
        return True

    def _take_hit(self, req: Request, hit: PrefixHit) -> None:
        below = self.hierarchy
        # Reference device hits and pin host hits first: allocating blocks for
        # the host hits may evict (and demote) cached blocks, never these.
        for s in hit.sources:
            if isinstance(s, HostEntry):
                assert below is not None
                below.host.pin(s)
            else:
                self.pool.touch(s)
        if hit.partial is not None:
            self.pool.touch(hit.partial)  # the copy's reference (run_block_copies drops it)
        waits: list[TransferTicket] = []
        base = len(req.block_ids)
        for i, s in enumerate(hit.sources):
            if isinstance(s, HostEntry):
                assert below is not None
                block = self.pool.allocate()
                below.promote(s, block.block_id)
                below.host.unpin(s)  # the plan's pin (promote) now holds it
                block.positions = s.positions or self._positions(base + i)
                if self.enable_prefix_caching and not s.private and s.token_ids is not None:
                    # The chain's previous block is the one just before it in the table.
                    prev = self.pool.blocks[req.block_ids[-1]] if req.block_ids else None
                    parent = prev.block_hash if prev is not None else None
                    family = self._family(req, 0) if prev is None else parent
                    self.pool.cache(block, s.key, s.token_ids, parent, family)
                if below.async_copies:
                    self._pending_blocks[block.block_id] = below.current_ticket
                    waits.append(below.current_ticket)
            else:
                block = s
                pending = self._pending_blocks.get(block.block_id)
                if pending is not None:
                    waits.append(pending)
            req.block_ids.append(block.block_id)
        if hit.partial is not None:
            dst = self.pool.allocate()
            dst.positions = self._positions(len(req.block_ids))
            req.block_ids.append(dst.block_id)
            self._copies.append((hit.partial.block_id, dst.block_id))
        req.num_computed_tokens += hit.num_tokens
        if hit.swap:
            assert below is not None
            below.release(req.swapped_blocks)
            below.counters.swap_ins += 1
            below.counters.swapped_in_blocks += len(hit.sources)
            req.swapped_blocks = []
            req.swapped_tokens = 0
        if waits:
            self._waits.setdefault(req.request_id, []).extend(waits)

    def run_block_copies(self, copy: Callable[[list[int], list[int]], None]) -> int:
        """Run the block copies partial hits queued (``copy(sources, destinations)``
        copies whole device blocks, every layer), then drop the sources' copy
        references. The engine calls it every step after the tiers' demotions
        (a destination may be a block just demoted) and before promotions and
        the forward. Returns the number of blocks copied."""
        if not self._copies:
            return 0
        copies, self._copies = self._copies, []
        copy([s for s, _ in copies], [d for _, d in copies])
        for src, _ in copies:
            self.pool.free(self.pool.blocks[src])
        return len(copies)

    def is_ready(self, req: Request) -> bool:
        """Whether every block ``req`` holds has arrived (async copies only)."""
        tickets = self._waits.get(req.request_id)
        if not tickets:
            return True
        if all(t.done() for t in tickets):
            del self._waits[req.request_id]
            return True
        return False

    def cache_computed_blocks(self, req: Request) -> None:
        """Register ``req``'s full, computed blocks in the prefix cache.

        Never once a KV policy has evicted tokens of ``req``: its blocks from
        the first edited one on hold other tokens than their index says (the
        blocks before it were registered already, while they were plain)."""
        if not self.enable_prefix_caching or req.num_evicted_tokens:
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
                    block,
                    req.block_hashes[i],
                    req.all_token_ids[i * bs : (i + 1) * bs],
                    req.block_hashes[i - 1] if i else None,
                    self._family(req, i),
                )

    # ---- preemption by swapping ------------------------------------------
    def swap_out(self, req: Request) -> bool:
        """Park ``req``'s blocks in the host tier and free its device blocks.

        The rule (``--preemption-mode swap``): swap when the host tier can
        take every block the request holds that it does not already keep
        (free slots plus unpinned, evictable ones); otherwise return False,
        changing nothing, and the caller recomputes. Full blocks in the prefix
        cache are parked under their content key (shared with the prefix
        cache); the partial last block, or every block with prefix caching
        off, under a key private to this swap. On return ``req`` holds no
        device block, ``num_computed_tokens`` is 0 and ``swapped_tokens``
        says how many tokens come back on resume.
        """
        below = self.hierarchy
        if below is None or not req.block_ids or req.num_computed_tokens == 0:
            return False
        if req.num_evicted_tokens:
            return False  # a compacted cache is not block i = tokens i: recompute it
        bs = self.block_size
        self._swap_serial += 1
        blocks: list[tuple[int, BlockMeta, bool]] = []
        for i, bid in enumerate(req.block_ids):
            block = self.pool.blocks[bid]
            positions = block.positions or self._positions(i)
            if block.block_hash is not None and block.token_ids is not None:
                meta = BlockMeta(block.block_hash, block.token_ids, positions, block.parent_hash)
                blocks.append((bid, meta, False))
            else:
                key = hashlib.sha256(
                    b"fuel-swap\0" + struct.pack("<qq", self._swap_serial, i)
                ).digest()
                tokens = tuple(req.all_token_ids[i * bs : (i + 1) * bs])
                blocks.append((bid, BlockMeta(key, tokens, positions), True))
        entries = below.swap_out(blocks)
        if entries is None:
            return False
        tokens_done = req.num_computed_tokens
        self._free_device(req)
        req.num_computed_tokens = 0
        req.swapped_blocks = entries
        req.swapped_tokens = tokens_done
        return True

    def free_uncomputed_blocks(self, req: Request) -> None:
        """Give back the tail blocks past ``num_computed_tokens`` (rolled-back drafts).

        They were allocated by ``req`` for this step's speculative slots, hold no
        computed token and were never hashed, so they go straight back to the pool.
        """
        need = self.blocks_needed(req.num_computed_tokens)
        while len(req.block_ids) > need:
            self.pool.free(self.pool.blocks[req.block_ids.pop()])

    # ---- giving back ----------------------------------------------------
    def _free_device(self, req: Request) -> None:
        tickets = self._waits.pop(req.request_id, None)
        if tickets:
            # Copies still landing in these blocks: let them finish before the
            # blocks can be handed to anyone else.
            for t in tickets:
                t.wait()
        for bid in reversed(req.block_ids):
            block = self.pool.blocks[bid]
            if block.ref_count == 1:
                self._pending_blocks.pop(bid, None)
            self.pool.free(block)
        req.block_ids = []

    def replace_blocks(self, req: Request, first: int, total: int) -> list[int]:
        """KV policies' compaction: give back ``req.block_ids[first:]`` (tail
        first) and take fresh blocks until the table has ``total``; returns the
        new ids (``req.block_ids[first:]``). Never fails: ``total`` is at most
        the old length, and what was given back is handed out again. The new
        blocks are private (reference 1, not hashed) and record the dense
        positions ``i * block_size ...`` their keys are re-rotated to."""
        if total > len(req.block_ids):
            raise ValueError("a compaction cannot grow a block table")
        for bid in reversed(req.block_ids[first:]):
            self.pool.free(self.pool.blocks[bid])
        del req.block_ids[first:]
        while len(req.block_ids) < total:
            block = self.pool.allocate()
            block.positions = self._positions(len(req.block_ids))
            req.block_ids.append(block.block_id)
        return req.block_ids[first:]

    def free(self, req: Request) -> None:
        """Give back everything ``req`` holds in every tier (tail first, so
        prefixes stay cached longest): device blocks and swapped-out blocks.
        A KV policy's evictions are forgotten with them (the cache is gone)."""
        self._free_device(req)
        req.num_evicted_tokens = 0
        if req.kv_state is not None:
            req.kv_state.reset()
        if req.swapped_blocks:
            assert self.hierarchy is not None
            self.hierarchy.release(req.swapped_blocks)
            req.swapped_blocks = []
            req.swapped_tokens = 0

    # ---- tiers ------------------------------------------------------------
    def _demote(self, block: KVBlock) -> None:
        """BlockPool callback: a cached block is being reclaimed (see KVHierarchy.demote)."""
        assert self.hierarchy is not None and block.block_hash is not None
        meta = BlockMeta(
            block.block_hash, block.token_ids, block.positions or (), block.parent_hash
        )
        self.hierarchy.demote(block.block_id, meta)

    def attach_events(self, events: KVEventCollector) -> None:
        """Report blocks stored in and removed from every tier to ``events``."""
        self.pool.events = events
        if self.hierarchy is not None:
            self.hierarchy.host.events = events
            if self.hierarchy.disk is not None:
                self.hierarchy.disk.events = events

    def take_transfers(self) -> TransferPlan | None:
        """This step's block copies for the executor (None: nothing to copy)."""
        return self.hierarchy.take_plan() if self.hierarchy is not None else None

    def transfers_ran(self, plan: TransferPlan) -> None:
        assert self.hierarchy is not None
        self.hierarchy.plan_ran(plan)

    def poll_transfers(self) -> None:
        """Between steps: collect finished async copies and disk writes."""
        if self.hierarchy is None:
            return
        self.hierarchy.poll()
        if self._pending_blocks:
            for bid in [b for b, t in self._pending_blocks.items() if t.done()]:
                del self._pending_blocks[bid]

    def cached_device_blocks(self) -> list[tuple[int, BlockMeta]]:
        """Every block in the device prefix cache with its metadata (for a flush)."""
        out: list[tuple[int, BlockMeta]] = []
        for b in self.pool.cached_blocks():
            if b.block_hash is not None and b.token_ids is not None:
                meta = BlockMeta(b.block_hash, b.token_ids, b.positions or (), b.parent_hash)
                out.append((b.block_id, meta))
        return out

    # ---- observability ------------------------------------------------------
    def tier_snapshot(self, num_swapped_waiting: int = 0) -> KVTierSnapshot:
        """Per-tier gauges and counters (a new object each call)."""
        pool = self.pool
        device = TierStats(
            "device",
            pool.num_used_blocks,
            pool.num_blocks,
            hit_tokens=self.hits_by_tier["device"],
            query_tokens=self.prefix_queries,
            evicted_blocks=pool.num_evicted,
        )
        below = self.hierarchy
        if below is None:
            return KVTierSnapshot(tiers=(device,))
        c = below.counters
        tiers = [device]
        for tier in below.tiers:
            u = tier.usage()
            t = tier.counters
            tiers.append(
                TierStats(
                    tier.name,
                    u.used_blocks,
                    u.capacity_blocks,
                    hit_tokens=c.hit_tokens.get(tier.name, 0),
                    query_tokens=c.query_tokens.get(tier.name, 0),
                    stored_blocks=t.stored,
                    read_blocks=t.read,
                    evicted_blocks=t.evicted,
                    dropped_blocks=t.dropped + (c.write_through_full if tier.name == "disk" else 0),
                    corrupt_blocks=t.corrupt,
                    write_errors=t.write_errors,
                )
            )
        moved = dict(below.bytes_moved)
        if below.disk is not None:
            moved["CPU_to_DISK"] = below.disk.counters.stored * below.disk.block_nbytes
        return KVTierSnapshot(
            tiers=tuple(tiers),
            bytes_moved=tuple(sorted(moved.items())),
            seconds=tuple(sorted(below.seconds.items())),
            swap_outs=c.swap_outs,
            swap_ins=c.swap_ins,
            swapped_out_blocks=c.swapped_out_blocks,
            swapped_in_blocks=c.swapped_in_blocks,
            num_swapped_waiting=num_swapped_waiting,
            external_queries=c.query_tokens["host"],
            external_hits=c.hit_tokens["host"] + c.hit_tokens["disk"],
        )

    # ---- invariants -------------------------------------------------------
    def check_request(self, req: Request) -> None:
        """Debug invariant: the block table covers exactly the computed tokens."""
        if req.is_finished:
            if req.block_ids or req.swapped_blocks:
                raise AssertionError(f"finished request {req.request_id} still holds blocks")
            return
        want = self.blocks_needed(req.num_kv_tokens)
        if len(req.block_ids) != want:
            raise AssertionError(
                f"request {req.request_id}: {len(req.block_ids)} blocks for "
                f"{req.num_kv_tokens} cached tokens (want {want})"
            )
        if req.kv_cap is not None and req.num_kv_tokens > req.kv_cap:
            raise AssertionError(
                f"request {req.request_id}: {req.num_kv_tokens} cached tokens over its KV "
                f"policy's cap {req.kv_cap}"
            )
        st = req.kv_state
        if st is not None and st.first_edited_block is not None:
            # A block a policy edited is private: never shared, never in the prefix cache.
            for bid in req.block_ids[st.first_edited_block :]:
                b = self.pool.blocks[bid]
                if b.block_hash is not None or b.ref_count != 1:
                    raise AssertionError(
                        f"request {req.request_id}: edited KV block {bid} is shared or cached"
                    )
        if req.swapped_blocks and (req.block_ids or req.num_computed_tokens):
            raise AssertionError(f"swapped-out request {req.request_id} holds device blocks")
        if req.swapped_blocks:
            assert self.hierarchy is not None
            for e in req.swapped_blocks:
                if self.hierarchy.host.entry(e.key) is not e or e.ref_count < 1:
                    raise AssertionError(
                        f"swapped-out request {req.request_id} lost a block in the host tier"
                    )
        for i, bid in enumerate(req.block_ids):
            # Positions kept: every block records where its keys were rotated
            # (KV policies may move them, so only their presence is checked).
            positions = self.pool.blocks[bid].positions
            if positions is None or len(positions) != self.block_size:
                raise AssertionError(
                    f"request {req.request_id}: block {i} does not record its positions"
                )

    def check_invariants(self, live: list[Request]) -> None:
        """Every tier's accounting, and every reference accounted for by ``live`` requests."""
        self.pool.check_invariants()
        held = 0
        swap_pins = 0
        for req in live:
            self.check_request(req)
            held += len(req.block_ids)
            swap_pins += len(req.swapped_blocks)
        refs = sum(b.ref_count for b in self.pool.blocks)
        if refs != held + len(self._copies):
            raise AssertionError(
                f"{refs} block references but requests hold {held} and "
                f"{len(self._copies)} block copies are pending"
            )
        if self.hierarchy is not None:
            self.hierarchy.check_invariants(swap_pins)
        elif swap_pins:
            raise AssertionError("requests hold swapped blocks without a host tier")
