"""Exact tests of the block pool and KV manager: hit lengths, refcounts, eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import BlockPool, LRUEvictionPolicy, hash_block
from engine.kv.manager import KVCacheManager
from engine.request import Request
from engine.sampling.params import SamplingParams


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, rid, 0, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def test_allocate_free_counts_and_double_free() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert (a.block_id, b.block_id) == (0, 1)
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    pool.free(a)
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)
    pool.check_invariants()


def test_exhaustion_raises() -> None:
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()


def test_hash_is_chained_and_salted() -> None:
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == h1
    assert hash_block(h1, [1, 2, 3, 4]) != h1
    assert hash_block(None, [1, 2, 3, 4], b"tenant") != h1
    assert len(h1) == 32


def test_prefix_hit_lengths_refcounts_and_lru_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert len(kv.find_cached_prefix(a)) == 0
    assert kv.allocate_slots(a, 10)
    assert a.block_ids == [0, 1, 2]
    a.num_computed_tokens = 10
    kv.cache_computed_blocks(a)
    # Same 8-token prefix, different tail: hits exactly the two full blocks.
    b = make_req("b", [*range(8), 99, 98, 97])
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits.device_blocks] == [0, 1]
    assert hits.origins == ["device", "device"] and hits.num_tokens == 8
    assert kv.allocate_slots(b, 3, hits)
    assert b.num_computed_tokens == 8 and b.block_ids == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 0]
    kv.free(b)
    # Freed tail first: LRU order of the evictable cached blocks is 1 then 0.
    policy = kv.pool.eviction_policy
    assert isinstance(policy, LRUEvictionPolicy)
    assert policy.order() == [1, 0]
    assert kv.num_free_blocks == 8
    kv.pool.check_invariants()


def test_full_prompt_hit_leaves_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    kv.cache_computed_blocks(a)
    b = make_req("b", list(range(8)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 1  # (8 - 1) // 4: the second block is recomputed for logits


def test_salt_isolates() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_req("a", list(range(9)), salt="t1")
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_computed_blocks(a)
    assert len(kv.find_cached_prefix(make_req("b", list(range(9)), salt="t2"))) == 0
    assert len(kv.find_cached_prefix(make_req("c", list(range(9))))) == 0
    assert len(kv.find_cached_prefix(make_req("d", list(range(9)), salt="t1"))) == 2


def test_eviction_takes_free_first_then_lru() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.free(a)  # blocks 0,1 cached+evictable (order: 1, 0), block 2 free
    c = make_req("c", [7, 7, 7])
    assert kv.allocate_slots(c, 3)
    # first the free block 2, then the LRU victim (block 1, freed first)
    assert c.block_ids == [2, 1]
    assert kv.pool.blocks[1].block_hash is None
    assert len(kv.find_cached_prefix(make_req("x", [1, 2, 3, 4, 5]))) == 1


def test_allocate_failure_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_req("a", list(range(12)))
    assert not kv.allocate_slots(a, 12)
    assert a.block_ids == [] and kv.num_free_blocks == 2


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 20), st.booleans()), min_size=1, max_size=40
    )
)
def test_random_alloc_free_never_leaks(ops: list[tuple[int, int, bool]]) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    live: list[Request] = []
    for n, (prefix, length, free_one) in enumerate(ops):
        if free_one and live:
            kv.free(live.pop(0))
        else:
            r = make_req(str(n), [prefix] * length)
            hits = kv.find_cached_prefix(r)
            if kv.allocate_slots(r, r.num_tokens - len(hits) * 4, hits):
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
                live.append(r)
        kv.pool.check_invariants()
        held = sum(len(r.block_ids) for r in live)
        assert sum(b.ref_count for b in kv.pool.blocks) == held
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == 16
    kv.pool.check_invariants()
