"""The KV memory hierarchy: formats, host and disk tiers, demotion/promotion, swap.

Exact tests without a model (bytes in, the same bytes out; block and pin
accounting with the invariants checker, by hand and under hypothesis), the
disk tier's fault handling (corrupt, truncated, foreign files, failed writes,
two tiers on one directory) and the engine end to end on a tiny checkpoint:
outputs identical whether a prefix is computed or served from each tier, and
whether a preempted request was swapped or recomputed.
"""

from __future__ import annotations

import errno
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.kv.disk_tier import DiskTier
from engine.kv.format import PlainKVFormat
from engine.kv.hierarchy import KVHierarchy
from engine.kv.host_tier import HostTier
from engine.kv.manager import KVCacheManager
from engine.kv.tier import BlockMeta
from engine.kv.transfer import KVTransferExecutor
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.request import Request, RequestStatus
from engine.sampling.params import SamplingParams
from engine.scheduler import Scheduler
from tests.conftest import default_gguf_path
from tests.model_utils import make_tiny_checkpoint

BS = 4
FP = b"\x11" * 32


def make_req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, rid, 0, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def meta(key: int, n: int = BS, start: int = 0) -> BlockMeta:
    return BlockMeta(bytes([key]) * 32, tuple(range(key, key + n)), range(start, start + n))


# ------------------------------------------------------------------ KV format


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_plain_format_round_trip_and_layout(dtype: torch.dtype) -> None:
    fmt = PlainKVFormat(3, BS, 2, 8, dtype)
    caches = fmt.allocate(6, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen).to(dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    assert fmt.block_nbytes == 3 * 2 * BS * 2 * 8 * caches[0][0].element_size()
    ids = torch.tensor([4, 1])
    data = fmt.read_blocks(caches, ids)
    assert data.dtype == torch.uint8 and tuple(data.shape) == (2, fmt.block_nbytes)
    # The layout: layer by layer, k then v, each the block's slice as it is.
    want = torch.cat([torch.stack([k[4], v[4]]).reshape(-1) for k, v in caches])
    assert torch.equal(data[0].view(dtype), want)
    other = fmt.allocate(6, torch.device("cpu"))
    fmt.write_blocks(other, torch.tensor([0, 5]), data)
    for (k, v), (k2, v2) in zip(caches, other):
        assert torch.equal(k2[0], k[4]) and torch.equal(v2[5], v[1])
        assert not k2[1:5].any()
    with pytest.raises(ValueError, match="uint8"):
        fmt.write_blocks(other, torch.tensor([0]), data)


# ------------------------------------------------------------------ host tier


def test_host_tier_lru_pins_and_private_entries() -> None:
    host = HostTier(3, 8)
    a, b, c = (host.reserve(meta(i)) for i in (1, 2, 3))
    assert a and b and c and host.reserve(meta(4)) is None  # every slot pinned (pending)
    for e in (a, b, c):
        host.unpin(e)
    host.pin(a)  # a request holds a
    host.touch(b)  # b was hit: c is now the least recently used
    d = host.reserve(meta(4))
    assert d is not None and d.slot == c.slot and not host.contains(meta(3).key)
    assert host.counters.evicted == 1
    host.unpin(d)
    p = host.reserve(meta(9), private=True)
    assert p is not None and p.slot == b.slot  # b went next, a is pinned
    assert host.lookup(meta(9).key, meta(9).token_ids or ()) is None  # private: no lookups
    host.unpin(p)
    assert not host.contains(meta(9).key)  # private: gone with its last pin
    host.check_invariants()
    with pytest.raises(RuntimeError, match="no pin"):
        host.unpin(d)


def test_host_tier_put_get_batched() -> None:
    host = HostTier(4, 16)
    data = torch.arange(48, dtype=torch.uint8).view(3, 16)
    assert host.put([meta(1), meta(2), meta(3)], data) == [True, True, True]
    got = host.get([meta(2).key, b"\0" * 32, meta(1).key])
    assert got[1] is None
    assert got[0] is not None and torch.equal(got[0][1], data[1])
    assert got[2] is not None and got[2][0].token_ids == meta(1).token_ids
    assert host.evict(2) == 2 and host.usage().used_blocks == 1
    host.check_invariants()


# ------------------------------------------------------------------ disk tier


def disk(root: Path, fp: bytes = FP, nbytes: int = 32, capacity: int = 1 << 20) -> DiskTier:
    return DiskTier(root, capacity, nbytes, BS, fp)


def payload(i: int, n: int = 32) -> torch.Tensor:
    return torch.full((1, n), i, dtype=torch.uint8)


def test_disk_round_trip_and_restart(tmp_path: Path) -> None:
    d = disk(tmp_path)
    assert d.put([meta(1, start=8)], payload(7)) == [True]
    assert d.contains(meta(1).key) and not d.contains(meta(2).key)
    again = disk(tmp_path)  # a restart: the index is rebuilt from the directory
    got = again.get([meta(1).key])[0]
    assert got is not None
    m, data = got
    assert m.token_ids == meta(1).token_ids and tuple(m.positions) == tuple(range(8, 12))
    assert torch.equal(data, payload(7)[0])
    assert disk(tmp_path, fp=b"\x22" * 32).get([meta(1).key]) == [None]  # another model
    again.check_invariants()


def _the_file(root: Path) -> Path:
    files = list(root.glob("*/*.kvb"))
    assert len(files) == 1
    return files[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "foreign", "renamed"])
def test_disk_bad_files_are_counted_misses(tmp_path: Path, damage: str) -> None:
    d = disk(tmp_path)
    d.put([meta(1)], payload(7))
    f = _the_file(tmp_path)
    raw = bytearray(f.read_bytes())
    if damage == "flip":
        raw[-3] ^= 0x40
    elif damage == "truncate":
        raw = raw[:-5]
    elif damage == "extend":
        raw += b"\0"
    elif damage == "foreign":  # a valid file of another model under our name
        other = disk(tmp_path / "other", fp=b"\x33" * 32)
        raw = bytearray(other.encode(meta(1), bytes(payload(7)[0].tolist())))
    elif damage == "renamed":  # a valid file of another block under this block's name
        raw = bytearray(d.encode(meta(2), bytes(payload(7)[0].tolist())))
    f.write_bytes(bytes(raw))
    assert d.get([meta(1).key]) == [None]
    assert d.counters.corrupt == 1
    assert not f.exists() and not d.contains(meta(1).key)  # removed, never read again
    d.check_invariants()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_disk_write_failure_turns_writes_off_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, caplog: pytest.LogCaptureFixture
) -> None:
    d = disk(tmp_path)
    d.put([meta(1)], payload(1))

    def fail(*a: object, **k: object) -> None:
        raise OSError(err, "injected")

    # The sandbox runs as root (chmod cannot make a directory read-only), so the
    # fault is injected where the tier creates its temporary file.
    monkeypatch.setattr("engine.kv.disk_tier.tempfile.mkstemp", fail)
    assert d.put([meta(2), meta(3)], torch.cat([payload(2), payload(3)])) == [False, False]
    assert d.counters.write_errors == 1 and d.counters.dropped == 1 and not d.writable
    assert sum("writes failed" in r.getMessage() for r in caplog.records) == 1
    got = d.get([meta(1).key])[0]  # reads of good blocks carry on
    assert got is not None and torch.equal(got[1], payload(1)[0])
    assert not list(tmp_path.glob("*/*.tmp"))


def test_disk_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    probe = disk(tmp_path / "probe")
    d = disk(tmp_path / "d", capacity=3 * probe.file_nbytes)
    for i in (1, 2, 3):
        d.put([meta(i)], payload(i))
    assert d.get([meta(1).key])[0] is not None  # 1 is now the most recent
    d.put([meta(4)], payload(4))
    assert [d.contains(meta(i).key) for i in (1, 2, 3, 4)] == [True, False, True, True]
    assert d.counters.evicted == 1 and d.usage().used_blocks == 3
    d.check_invariants()


def test_two_tiers_on_one_directory(tmp_path: Path) -> None:
    a, b = disk(tmp_path), disk(tmp_path)
    a.put([meta(1)], payload(1))
    got = b.get([meta(1).key])[0]  # written by the other server: found on a miss
    assert got is not None and torch.equal(got[1], payload(1)[0])
    b.put([meta(1)], payload(1))  # both write the same block: still one good file
    assert a.evict(1) == 1  # a removes it; b's index still lists it
    assert b.get([meta(1).key]) == [None] and b.counters.corrupt == 0  # a miss, not corrupt
    a.put([meta(2)], payload(2))
    b.put([meta(2)], payload(2))
    assert a.get([meta(2).key])[0] is not None
    assert not list(tmp_path.glob("*/*.tmp"))
    a.check_invariants()
    b.check_invariants()


# ------------------------------------------------------------------ manager + hierarchy


def ran(kv: KVCacheManager) -> None:
    """Pretend the executor ran this step's plan (accounting only, no bytes)."""
    plan = kv.take_transfers()
    if plan is not None:
        kv.transfers_ran(plan)


def tiered(num_blocks: int = 4, host_blocks: int = 8, **kw: Any) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, hierarchy=KVHierarchy(HostTier(host_blocks, 16), **kw))


def compute(kv: KVCacheManager, r: Request) -> None:
    hit = kv.find_cached_prefix(r)
    assert kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)


def test_evicted_blocks_are_demoted_then_promoted() -> None:
    kv = tiered(num_blocks=4)
    a = make_req("a", list(range(9)))  # 2 full blocks + 1 token
    compute(kv, a)
    kv.free(a)
    ran(kv)
    b = make_req("b", [50 + i for i in range(16)])  # needs all 4 device blocks
    compute(kv, b)
    plan = kv.take_transfers()
    assert plan is not None and [bid for bid, _ in plan.device_to_host] == [1, 0]
    kv.transfers_ran(plan)
    kv.free(b)
    ran(kv)
    c = make_req("c", list(range(9)))
    hit = kv.find_cached_prefix(c)
    # a's blocks 0 and 1 were demoted; b's blocks are on the device, a's are not.
    assert hit.origins == ["host", "host"] and hit.num_tokens == 8
    assert kv.allocate_slots(c, 1, hit)
    assert c.num_computed_tokens == 8
    plan = kv.take_transfers()
    assert plan is not None and len(plan.host_to_device) == 2
    kv.transfers_ran(plan)
    c.num_computed_tokens = 9  # the step ran
    kv.check_invariants([c])
    kv.free(c)
    kv.check_invariants([])
    assert kv.hierarchy is not None and kv.hierarchy.counters.demoted >= 2


def test_swap_out_and_back_in_keeps_the_partial_block() -> None:
    kv = tiered(num_blocks=6)
    a = make_req("a", list(range(10)))
    compute(kv, a)  # 2 full (hashed) blocks + a partial one
    assert kv.swap_out(a)
    assert a.block_ids == [] and a.num_computed_tokens == 0 and a.swapped_tokens == 10
    assert [e.private for e in a.swapped_blocks] == [False, False, True]
    kv.check_invariants([a])
    ran(kv)
    hit = kv.find_cached_prefix(a)
    assert hit.swap and hit.num_tokens == 10
    # The full blocks are still cached on the device: only the partial one is copied.
    assert hit.origins == ["device", "device", "host"]
    assert kv.allocate_slots(a, 1, hit) and a.num_computed_tokens == 10
    assert a.swapped_blocks == [] and len(a.block_ids) == 3
    kv.check_invariants([a])
    ran(kv)
    assert (
        kv.hierarchy is not None and kv.hierarchy.host.usage().used_blocks == 2
    )  # private one gone
    kv.free(a)
    kv.check_invariants([])


def test_swap_needs_room_for_every_block() -> None:
    kv = tiered(num_blocks=6, host_blocks=2)
    a = make_req("a", list(range(10)))
    compute(kv, a)
    assert not kv.swap_out(a)  # 3 blocks, 2 slots: the caller recomputes
    assert len(a.block_ids) == 3 and a.swapped_blocks == []
    kv.check_invariants([a])


def test_abort_while_swapped_out_leaves_no_reference() -> None:
    kv = tiered(num_blocks=6, host_blocks=4)
    a = make_req("a", list(range(7)))
    compute(kv, a)
    assert kv.swap_out(a)
    ran(kv)
    a.status = RequestStatus.FINISHED_ABORTED
    kv.free(a)
    kv.check_invariants([a])
    assert kv.hierarchy is not None
    assert all(e.ref_count == 0 for e in kv.hierarchy.host.entries())


def test_promotion_racing_an_eviction_copies_the_right_bytes() -> None:
    """A host block promoted in the same step as demotions that need every host
    slot: the promoted entry is pinned (the demotion that finds no slot is
    dropped, counted), the demoted block is read before its id is rewritten,
    and the promoted device block holds exactly the bytes first computed."""
    fmt = PlainKVFormat(2, BS, 1, 4, torch.float32)
    caches = fmt.allocate(3, torch.device("cpu"))
    hierarchy = KVHierarchy(HostTier(2, fmt.block_nbytes))
    kv = KVCacheManager(3, BS, hierarchy=hierarchy)
    executor = KVTransferExecutor(fmt, caches, hierarchy, torch.device("cpu"))

    def step() -> None:
        plan = kv.take_transfers()
        if plan is not None:
            executor.run(plan)

    def fill(r: Request, base: float) -> None:
        for j, bid in enumerate(r.block_ids):
            for k, v in caches:
                k[bid].fill_(base + j)
                v[bid].fill_(-(base + j))

    a = make_req("a", list(range(8)))
    compute(kv, a)
    fill(a, 10.0)
    kv.free(a)
    b = make_req("b", [90 + i for i in range(12)])
    compute(kv, b)  # evicts a's 2 blocks (demoted: host now full) + 1 free block
    step()  # the step's copies run before its forward writes b's keys
    fill(b, 20.0)
    kv.free(b)
    host = hierarchy.host
    assert host.usage().used_blocks == 2 and host.num_evictable == 2
    c = make_req("c", [*range(8), 5])
    hit = kv.find_cached_prefix(c)
    assert hit.origins == ["host", "host"]
    # Allocating 3 device blocks evicts b's 3 cached blocks: their demotions want
    # host slots, but the two promoted entries are pinned by the plan.
    assert kv.allocate_slots(c, 1, hit)
    assert hierarchy.counters.demotions_dropped == 3
    step()
    for j in range(2):
        for k, v in caches:
            assert torch.all(k[c.block_ids[j]] == 10.0 + j)
            assert torch.all(v[c.block_ids[j]] == -(10.0 + j))
    c.num_computed_tokens = 9  # the step ran
    kv.check_invariants([c])


def test_async_copies_hold_only_the_request_that_needs_them() -> None:
    """With async copies (CUDA) a request whose blocks are in flight is admitted
    but not scheduled until they land; others run; freeing it waits."""
    clock_t = [0.0]
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64)
    hierarchy = KVHierarchy(HostTier(8, 16), async_copies=True)
    kv = KVCacheManager(6, BS, hierarchy=hierarchy)
    s = Scheduler(config, kv, max_model_len=1024, clock=lambda: clock_t[0])
    landed = [False]

    def run_plan() -> None:
        plan = kv.take_transfers()
        if plan is not None:
            if plan.host_to_device:
                plan.ticket.bind(lambda: landed[0], lambda: landed.__setitem__(0, True), None)
            kv.transfers_ran(plan)

    a = make_req("a", list(range(9)))
    s.add_request(a)
    out = s.schedule()
    s.update_after_step(out)
    run_plan()
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    # Push a's blocks out of the device pool (demoted).
    filler = Request("f", "f", 0, [70 + i for i in range(23)], SamplingParams(max_tokens=1))
    s.add_request(filler)
    out = s.schedule()
    s.update_after_step(out)
    run_plan()
    s.finish(filler, RequestStatus.FINISHED_STOPPED)
    b = make_req("b", [*range(8), 3])
    other = make_req("o", [200, 201])
    s.add_request(b)
    s.add_request(other)
    out = s.schedule()
    run_plan()
    assert [x.req.request_id for x in out.scheduled] == ["o"]  # b waits for its blocks
    assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 8
    s.update_after_step(out)
    s.check_invariants()
    kv.poll_transfers()
    out = s.schedule()
    assert "b" not in [x.req.request_id for x in out.scheduled]  # still in flight
    s.update_after_step(out)
    landed[0] = True
    kv.poll_transfers()
    out = s.schedule()
    assert ("b", 1) in [(x.req.request_id, x.num_new_tokens) for x in out.scheduled]
    s.update_after_step(out)
    s.check_invariants()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "free", "swap", "resume", "abort"]), st.integers(0, 5)),
        min_size=1,
        max_size=50,
    ),
    st.booleans(),
)
def test_random_tier_accounting_never_loses_a_block(
    ops: list[tuple[str, int]], prefix_caching: bool
) -> None:
    """Random admissions (shared prefixes), frees, swap-outs, resumes and aborts
    over a small device pool and host tier: after every operation and plan,
    every tier's accounting holds, every pin is a live request's or a plan's,
    and nothing is left once everyone has ended."""
    kv = KVCacheManager(6, BS, prefix_caching, hierarchy=KVHierarchy(HostTier(5, 16)))
    live: list[Request] = []
    swapped: list[Request] = []
    for n, (op, arg) in enumerate(ops):
        if op == "add":
            r = make_req(str(n), [arg % 3] * (4 + arg * 2) + [n])
            hit = kv.find_cached_prefix(r)
            if kv.allocate_slots(r, r.num_tokens - hit.num_tokens, hit):
                r.num_computed_tokens = r.num_tokens
                kv.cache_computed_blocks(r)
                live.append(r)
        elif op == "free" and live:
            kv.free(live.pop(arg % len(live)))
        elif op == "swap" and live:
            r = live[arg % len(live)]
            if kv.swap_out(r):
                live.remove(r)
                swapped.append(r)
        elif op == "resume" and swapped:
            r = swapped[arg % len(swapped)]
            hit = kv.find_cached_prefix(r)
            if kv.allocate_slots(r, 0, hit):
                assert r.num_computed_tokens == r.num_tokens
                swapped.remove(r)
                live.append(r)
        elif op == "abort" and swapped:
            r = swapped.pop(arg % len(swapped))
            kv.free(r)
        kv.check_invariants([*live, *swapped])
        ran(kv)
        kv.check_invariants([*live, *swapped])
    for r in [*live, *swapped]:
        kv.free(r)
    ran(kv)
    kv.check_invariants([])
    assert kv.num_free_blocks == 6
    assert kv.hierarchy is not None
    assert all(e.ref_count == 0 for e in kv.hierarchy.host.entries())


# ------------------------------------------------------------------ engine end to end


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiers"), "llama")


def engine(model_dir: Path, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        tokenizer=str(default_gguf_path()),
        block_size=BS,
        kv_cache_memory=4 << 20,
        max_num_batched_tokens=32,
        debug_invariants=True,
        enable_request_traces=True,
        **kw,
    )
    return LLMEngine(cfg)


PROMPTS = [[random.Random(i).randrange(3, 250) for _ in range(22 + i)] for i in range(5)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def same(got: list[Any], want: list[Any]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for x, y in zip(g.logprobs, w.logprobs, strict=True):
            assert abs(x.chosen.logprob - y.chosen.logprob) <= 1e-4


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> list[Any]:
    return LLM(engine=engine(tiny_dir, enable_prefix_caching=False)).generate(PROMPTS, PARAMS)


def test_engine_host_then_disk_after_restart(
    tiny_dir: Path, tmp_path: Path, reference: list[Any]
) -> None:
    tiers = {
        "num_gpu_blocks_override": 12,
        "num_host_blocks_override": 64,
        "kv_offloading_disk_path": str(tmp_path / "kv"),
    }
    eng = engine(tiny_dir, **tiers)
    llm = LLM(engine=eng)
    same(llm.generate(PROMPTS, PARAMS), reference)
    same(llm.generate(PROMPTS, PARAMS), reference)
    assert eng.kv.hits_by_tier["host"] > 0
    host = eng.stats.kv_tiers.tier("host")
    assert host is not None and host.read_blocks > 0 and host.stored_blocks > 0
    eng.close()
    fresh = engine(tiny_dir, **tiers)
    llm = LLM(engine=fresh)
    same(llm.generate(PROMPTS[:1], PARAMS), reference[:1])
    # The whole cacheable prompt came from disk: (22 - 1) // 4 blocks.
    assert fresh.kv.hits_by_tier["disk"] == 5 * BS
    trace = fresh.get_trace([f"offline-{id(llm)}-0"])
    assert trace is not None
    hits = [e for e in trace.events if e.kind == "prefix_hit"]
    assert [(h.num_tokens, h.disk_tokens, h.host_tokens) for h in hits] == [(20, 20, 0)]
    snap = fresh.stats.kv_tiers
    disk_stats = snap.tier("disk")
    assert disk_stats is not None and disk_stats.read_blocks == 5 and disk_stats.corrupt_blocks == 0
    fresh.close()


def test_engine_corrupt_disk_blocks_are_misses(
    tiny_dir: Path, tmp_path: Path, reference: list[Any]
) -> None:
    tiers = {"num_host_blocks_override": 64, "kv_offloading_disk_path": str(tmp_path / "kv")}
    eng = engine(tiny_dir, **tiers)
    LLM(engine=eng).generate(PROMPTS[:2], PARAMS)
    eng.close()
    files = sorted((tmp_path / "kv").glob("*/*.kvb"))
    assert files
    for i, f in enumerate(files):
        raw = bytearray(f.read_bytes())
        if i % 3 == 0:
            raw[-1] ^= 1  # corrupted payload
        elif i % 3 == 1:
            raw = raw[: len(raw) // 2]  # truncated
        else:
            raw[20] ^= 1  # header (the fingerprint): a foreign block
        f.write_bytes(bytes(raw))
    fresh = engine(tiny_dir, **tiers)
    same(LLM(engine=fresh).generate(PROMPTS[:2], PARAMS), reference[:2])
    d = fresh.stats.kv_tiers.tier("disk")
    assert d is not None and d.corrupt_blocks >= 2 and fresh.kv.hits_by_tier["disk"] == 0
    fresh.close()


def test_engine_disk_full_degrades_to_no_disk_tier(
    tiny_dir: Path, tmp_path: Path, reference: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("engine.kv.disk_tier.tempfile.mkstemp", full)
    eng = engine(
        tiny_dir,
        num_gpu_blocks_override=12,
        num_host_blocks_override=64,
        kv_offloading_disk_path=str(tmp_path / "kv"),
    )
    llm = LLM(engine=eng)
    same(llm.generate(PROMPTS, PARAMS), reference)
    same(llm.generate(PROMPTS, PARAMS), reference)  # host tier still serves
    assert eng.kv.hits_by_tier["host"] > 0
    eng.close()  # the flush finds writes off: no error
    d = eng.stats.kv_tiers.tier("disk")
    assert d is not None and d.write_errors == 1


def test_engine_unusable_disk_path_starts_without_disk_tier(
    tiny_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    eng = engine(tiny_dir, num_host_blocks_override=8, kv_offloading_disk_path=str(blocker / "kv"))
    assert eng.kv.hierarchy is not None and eng.kv.hierarchy.disk is None
    assert any("KV disk tier off" in r.getMessage() for r in caplog.records)


def test_engine_two_engines_share_a_directory(
    tiny_dir: Path, tmp_path: Path, reference: list[Any]
) -> None:
    tiers = {"num_host_blocks_override": 64, "kv_offloading_disk_path": str(tmp_path / "kv")}
    a, b = engine(tiny_dir, **tiers), engine(tiny_dir, **tiers)
    same(LLM(engine=a).generate(PROMPTS[:2], PARAMS), reference[:2])
    a.flush_kv_tiers()
    same(LLM(engine=b).generate(PROMPTS[:2], PARAMS), reference[:2])
    assert b.kv.hits_by_tier["disk"] > 0
    same(LLM(engine=b).generate(PROMPTS, PARAMS), reference)
    b.close()
    a.close()
    assert not list((tmp_path / "kv").glob("*/*.tmp"))


@pytest.mark.parametrize("prefix", [True, False])
def test_engine_swap_matches_recompute(tiny_dir: Path, reference: list[Any], prefix: bool) -> None:
    prompts = [
        [random.Random(10 + i).randrange(3, 250) for _ in range(6 + 3 * i)] for i in range(6)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    want = LLM(engine=engine(tiny_dir, enable_prefix_caching=False)).generate(prompts, params)
    small = {"num_gpu_blocks_override": 14, "enable_prefix_caching": prefix}
    swap = engine(tiny_dir, **small, num_host_blocks_override=64, preemption_mode="swap")
    llm = LLM(engine=swap)
    same(llm.generate(prompts, params), want)
    assert swap.scheduler.num_preemptions > 0
    assert swap.scheduler.num_swap_preemptions == swap.scheduler.num_preemptions
    assert swap.stats.kv_tiers.swap_ins == swap.stats.kv_tiers.swap_outs > 0
    traces = [swap.get_trace([f"offline-{id(llm)}-{i}"]) for i in range(len(prompts))]
    modes = [e.mode for t in traces if t is not None for e in t.events if e.kind == "preempted"]
    assert len(modes) == swap.scheduler.num_preemptions and set(modes) == {"swap"}
    # Host tier too small for any victim: every preemption falls back to recompute.
    tight = engine(tiny_dir, **small, num_host_blocks_override=1, preemption_mode="swap")
    same(LLM(engine=tight).generate(prompts, params), want)
    assert tight.scheduler.num_preemptions > 0 and tight.scheduler.num_swap_preemptions == 0


def test_engine_rerotate_blocks_matches_keys_at_new_positions(tmp_path: Path) -> None:
    """Moving a request's block to other positions gives the keys the model
    computes at those positions (layer 0, where a key depends only on its
    token), with llama3 RoPE scaling; and moving back restores every layer."""
    ckpt = make_tiny_checkpoint(tmp_path, "llama3")
    eng = engine(ckpt, kv_cache_dtype="float32", cpu_linear="onednn", enable_prefix_caching=False)
    prompt = [random.Random(3).randrange(3, 250) for _ in range(9)]
    eng.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()  # the prompt's keys are in the cache (block 0 holds positions 0..3)
    req = eng.scheduler.requests["r"]
    bid = req.block_ids[0]
    layers = eng.runner.kv_caches
    before = [k[bid].clone() for k, _ in layers]
    new = [40, 41, 57, 100]  # any positions, not even contiguous
    eng.rerotate_blocks([bid], [new])
    attn = eng.model.model.layers[0].self_attn
    emb = eng.model.model.embed_tokens(torch.tensor(prompt[:4]))
    h, _ = eng.model.model.layers[0].input_layernorm.norm(emb, None)
    qkv = attn.qkv_proj(h)
    k_raw = qkv[:, attn.q_size : attn.q_size + attn.kv_size].view(
        4, attn.num_kv_heads, attn.head_dim
    )
    q_raw = qkv[:, : attn.q_size].view(4, attn.num_heads, attn.head_dim)
    rope = eng.model.model.rotary_emb.inputs(torch.tensor(new), emb.dtype)
    from engine.models.ops import TorchModelOps

    _, k_new = TorchModelOps().rope(q_raw.clone(), k_raw.clone(), rope)
    torch.testing.assert_close(layers[0][0][bid], k_new, rtol=1e-5, atol=1e-5)
    assert eng.kv.pool.blocks[bid].positions == tuple(new)
    eng.rerotate_blocks([bid], [list(range(4))])
    for (k, _), b in zip(layers, before):
        torch.testing.assert_close(k[bid], b, rtol=1e-5, atol=1e-5)
    eng.abort("r")


def test_rerotate_refuses_shared_blocks(tiny_dir: Path) -> None:
    eng = engine(tiny_dir)
    eng.add_request("r", list(range(3, 12)), SamplingParams(temperature=0.0, max_tokens=2))
    eng.step()
    bid = eng.scheduler.requests["r"].block_ids[0]  # full and computed: in the prefix cache
    with pytest.raises(ValueError, match="shared or cached"):
        eng.rerotate_blocks([bid], [[0, 1, 2, 3]])
    eng.abort("r")


def test_config_needs_host_tier_for_swap_and_disk() -> None:
    with pytest.raises(ValueError, match="needs the host tier"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="needs the host tier"):
        EngineConfig(kv_offloading_disk_path="/tmp/x")
    assert EngineConfig(kv_offloading_size=0.5).host_tier_enabled


def test_metrics_export_tiers_with_vllm_names() -> None:
    from engine.stats import EngineStats, KVTierSnapshot, TierStats
    from server.metrics import Metrics

    m = Metrics("m")

    def snap(hits: int, corrupt: int) -> EngineStats:
        tiers = (
            TierStats("device", 3, 10, hit_tokens=8, query_tokens=40),
            TierStats("host", 5, 20, hit_tokens=hits, query_tokens=32, stored_blocks=7),
            TierStats("disk", 2, 99, hit_tokens=4, corrupt_blocks=corrupt),
        )
        return EngineStats(
            prefix_cache_queries=40,
            prefix_cache_hits=8,
            kv_tiers=KVTierSnapshot(
                tiers=tiers,
                bytes_moved=(("CPU_to_GPU", 4096), ("GPU_to_CPU", 2048)),
                seconds=(("CPU_to_GPU", 0.5),),
                swap_outs=2,
                num_swapped_waiting=1,
                external_queries=32,
                external_hits=hits + 4,
            ),
        )

    m.update_from_stats(snap(12, 0))
    m.update_from_stats(snap(16, 3))
    from prometheus_client.parser import text_string_to_metric_families

    samples = {
        (smp.name, smp.labels.get("tier") or smp.labels.get("transfer_type")): smp.value
        for fam in text_string_to_metric_families(m.render()[0].decode())
        for smp in fam.samples
    }

    def value(name: str, label: str | None = None) -> float:
        return samples[(name, label)]

    assert value("fuel:kv_tier_hit_tokens_total", "host") == 16
    assert value("fuel:kv_tier_corrupt_blocks_total", "disk") == 3
    assert value("fuel:kv_tier_blocks_capacity", "host") == 20
    assert value("vllm:external_prefix_cache_hits_total") == 20
    assert value("vllm:prompt_tokens_cached_total") == 28
    assert value("vllm:kv_offload_total_bytes_total", "CPU_to_GPU") == 4096
    assert value("vllm:kv_offload_cpu_cache_usage_perc") == 0.25
    assert value("vllm:num_requests_swapped") == 1
    assert value("fuel:kv_swap_outs_total") == 2


def test_grouped_format_round_trips_each_group() -> None:
    """A grouped block is each group's bytes in order; write_blocks inverts read_blocks
    for every layer of every group (here a float32 target and a float16 draft)."""
    from engine.kv.format import GroupedKVFormat

    target = PlainKVFormat(2, BS, 2, 8, torch.float32)
    draft = PlainKVFormat(1, BS, 1, 4, torch.float16)
    fmt = GroupedKVFormat([target, draft])
    assert fmt.block_nbytes == target.block_nbytes + draft.block_nbytes
    assert target.describe() in fmt.describe() and draft.describe() in fmt.describe()
    src = fmt.allocate(6, torch.device("cpu"))
    assert len(src) == 3
    gen = torch.Generator().manual_seed(3)
    for k, v in src:
        k.copy_(torch.randn(k.shape, generator=gen).to(k.dtype))
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    data = fmt.read_blocks(src, torch.tensor([4, 1]))
    # The target's part is exactly what the target format reads alone.
    assert torch.equal(
        data[:, : target.block_nbytes], target.read_blocks(src[:2], torch.tensor([4, 1]))
    )
    dst = fmt.allocate(6, torch.device("cpu"))
    fmt.write_blocks(dst, torch.tensor([0, 5]), data)
    for (ks, vs), (kd, vd) in zip(src, dst, strict=True):
        assert torch.equal(kd[0], ks[4]) and torch.equal(vd[5], vs[1])
        assert not kd[1:5].any()  # untouched blocks stay zero
    with pytest.raises(ValueError, match="layer caches"):
        fmt.read_blocks(src[:2], torch.tensor([0]))
    with pytest.raises(ValueError, match="block size"):
        GroupedKVFormat([target, PlainKVFormat(1, BS * 2, 1, 4, torch.float16)])


def test_engine_disk_tier_carries_the_draft_cache(tiny_dir: Path, tmp_path: Path) -> None:
    """With a draft model (its own KV layer group in the same block ids), blocks
    served from disk after a restart bring the draft's KV back too, bit for bit."""
    from engine.kv.format import GroupedKVFormat

    tiers = {
        "num_gpu_blocks_override": 32,
        "num_host_blocks_override": 64,
        "kv_offloading_disk_path": str(tmp_path / "kv"),
        "speculative_config": {
            "method": "draft_model",
            "num_speculative_tokens": 2,
            "adaptive": False,
        },
    }
    eng = engine(tiny_dir, **tiers)
    want = LLM(engine=eng).generate(PROMPTS[:1], PARAMS)
    assert eng.transfers is not None and isinstance(eng.transfers.fmt, GroupedKVFormat)
    fmt = eng.transfers.fmt
    cached = {h: b.block_id for h, b in eng.kv.pool._cached.items()}
    before = {
        h: fmt.read_blocks(eng.transfers.caches, torch.tensor([b])) for h, b in cached.items()
    }
    eng.close()
    fresh = engine(tiny_dir, **tiers)
    same(LLM(engine=fresh).generate(PROMPTS[:1], PARAMS), want)
    assert fresh.kv.hits_by_tier["disk"] > 0
    assert fresh.transfers is not None
    draft_from = fresh.transfers.fmt.groups[0].block_nbytes  # type: ignore[attr-defined]
    compared = 0
    for h, block in fresh.kv.pool._cached.items():
        if h in before:
            got = fresh.transfers.fmt.read_blocks(
                fresh.transfers.caches, torch.tensor([block.block_id])
            )
            assert torch.equal(got[:, draft_from:], before[h][:, draft_from:])
            assert got[:, draft_from:].any()  # the draft's half is really there
            compared += 1
    assert compared >= 5
    fresh.close()
