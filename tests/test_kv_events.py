"""KV cache events (engine/kv/events.py, engine/kv/event_publisher.py).

The wire format is checked with an independent decoder (``msgpack``, raw
arrays) against values written out by hand from vLLM's struct definitions;
the engine test subscribes to a real engine's ZMQ PUB socket on loopback.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.kv.block_pool import BlockPool, KVBlock, hash_block
from engine.kv.event_publisher import (
    KVEventPublisher,
    KVEventsConfig,
    ZmqKVEventPublisher,
    offset_endpoint,
    parse_kv_events_config,
)
from engine.kv.events import KVEventBatch, KVEventCollector
from engine.kv.host_tier import HostTier
from engine.kv.tier import BlockMeta
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams
from tests.conftest import default_gguf_path
from tests.model_utils import make_tiny_checkpoint


def _decode(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False, strict_map_key=True)


def test_crafted_sequence_is_vllm_wire_format() -> None:
    """Store 3 blocks, evict 1 (demoted to the host tier), overflow the host
    tier, clear: exact arrays, field by field, as vLLM encodes its structs."""
    events = KVEventCollector(block_size=2)
    host = HostTier(capacity_blocks=1, block_nbytes=8)
    host.events = events

    def demote(b: KVBlock) -> None:
        assert b.block_hash is not None and b.token_ids is not None
        host.unpin(host.reserve(BlockMeta(b.block_hash, b.token_ids, range(2), b.parent_hash)))  # type: ignore[arg-type]

    pool = BlockPool(3, on_evict=demote)
    pool.events = events
    h1 = hash_block(None, [1, 2])
    h2 = hash_block(h1, [3, 4])
    h3 = hash_block(h2, [5, 6])
    blocks = [pool.allocate() for _ in range(3)]
    for b, (h, parent, toks) in zip(
        blocks, [(h1, None, [1, 2]), (h2, h1, [3, 4]), (h3, h2, [5, 6])]
    ):
        pool.cache(b, h, toks, parent)
    for b in blocks:
        pool.free(b)  # LRU: h1's block is the first victim
    fresh = pool.allocate()  # evicts h1: demoted (CPU stored), then removed from the GPU
    pool.free(fresh)
    # The host tier holds one block: h2's demotion evicts h1 from it.
    demote(pool.blocks[1])
    pool.reset_prefix_cache()
    batch = KVEventBatch(1.5, events.take(), 3)
    got = _decode(msgspec.msgpack.encode(batch))

    def stored(hashes: list[bytes], parent: bytes | None, toks: list[int], medium: str) -> Any:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": toks,
            "block_size": 2,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }

    def removed(hashes: list[bytes], medium: str) -> Any:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}

    assert got == [
        1.5,
        [
            stored([h1, h2, h3], None, [1, 2, 3, 4, 5, 6], "GPU"),
            stored([h1], None, [1, 2], "CPU"),
            removed([h1], "GPU"),
            removed([h1], "CPU"),
            stored([h2], h1, [3, 4], "CPU"),
            {"type": "AllBlocksCleared"},
        ],
        3,
    ]
    # Field order inside each map is vLLM's declaration order.
    assert list(got[1][0]) == list(stored([], None, [], "GPU"))
    assert all(isinstance(h, bytes) and len(h) == 32 for h in (h1, h2, h3))
    assert events.take() == []
    assert (events.counters.stored, events.counters.removed, events.counters.cleared) == (5, 2, 1)


def test_reset_restores_referenced_blocks() -> None:
    """A reset keeps a running request's cached blocks: clear, then restore them."""
    events = KVEventCollector(block_size=1)
    pool = BlockPool(2)
    pool.events = events
    h1, h2 = hash_block(None, [7]), hash_block(None, [8])
    a, b = pool.allocate(), pool.allocate()
    pool.cache(a, h1, [7])
    pool.cache(b, h2, [8])
    pool.free(b)
    events.take()
    assert pool.reset_prefix_cache() == 1
    got = [_decode(msgspec.msgpack.encode(e)) for e in events.take()]
    assert got == [
        {"type": "AllBlocksCleared"},
        {
            "type": "BlockStored",
            "block_hashes": [h1],
            "parent_block_hash": None,
            "token_ids": [7],
            "block_size": 1,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        },
    ]


def test_config_validation() -> None:
    assert parse_kv_events_config(None) is None
    assert parse_kv_events_config({"enable_kv_cache_events": False, "publisher": "zmq"}) is None
    cfg = parse_kv_events_config({"enable_kv_cache_events": True, "topic": "kv-events"})
    assert cfg == KVEventsConfig(topic="kv-events")
    for raw, msg in [
        ({"enable_kv_cache_events": True, "endpont": "tcp://*:1"}, "unknown key"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
        ({"enable_kv_cache_events": True, "endpoint": "http://x:1"}, "must start with tcp://"),
        ({"enable_kv_cache_events": True, "hwm": -1}, "'hwm' must be >= 0"),
        ({"enable_kv_cache_events": True, "buffer_steps": True}, "buffer_steps"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_kv_events_config(raw)
    with pytest.raises(ValueError, match="kv-events-config"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "max_queue_size": 0})
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sub(port: int) -> zmq.Socket[bytes]:
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _receive(sub: zmq.Socket[bytes], want: int, timeout_s: float = 5.0) -> list[list[bytes]]:
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        if sub.poll(50):
            out.append(sub.recv_multipart())
    return out


def _drain(sub: zmq.Socket[bytes], timeout_s: float = 5.0) -> list[list[bytes]]:
    """Every batch until the socket has been quiet for 0.5 s (bounded by ``timeout_s``)."""
    out = _receive(sub, 1, timeout_s)
    deadline = time.monotonic() + timeout_s
    while out and time.monotonic() < deadline and sub.poll(500):
        out.append(sub.recv_multipart())
    return out


def test_publisher_drops_when_full_and_replays() -> None:
    port, replay_port = _free_port(), _free_port()
    cfg = KVEventsConfig(
        endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}", max_queue_size=2
    )
    pub = ZmqKVEventPublisher(cfg, data_parallel_rank=0)
    try:
        sub = _sub(port)
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription must arrive first
        for i in range(3):
            pub.publish(KVEventBatch(float(i), []))
        frames = _receive(sub, 3, timeout_s=3.0)
        assert pub.num_dropped + len(frames) == 3
        assert [f[0] for f in frames] == [b""] * len(frames)
        assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
        assert [_decode(f[2]) for f in frames] == [[float(i), [], 0] for i in range(len(frames))]
        req: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        replies = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            if req.poll(50):
                replies.append(req.recv_multipart())
                if replies[-1][1] == (-1).to_bytes(8, "big", signed=True):
                    break
        assert [r[1] for r in replies[:-1]] == [f[1] for f in frames[1:]]
        assert [r[2] for r in replies[:-1]] == [f[2] for f in frames[1:]]
        assert replies[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        req.close()
        sub.close()
    finally:
        pub.close()
    pub.publish(KVEventBatch(0.0, []))  # closed: dropped, never raises or blocks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama")


def _engine(model_dir: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model_dir),
            tokenizer=str(default_gguf_path()),
            block_size=4,
            num_gpu_blocks_override=8,
            max_num_batched_tokens=32,
            debug_invariants=True,
            **kw,
        )
    )


def _run(eng: LLMEngine, rid: str, prompt: list[int], n: int) -> None:
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()


def test_engine_publishes_stored_and_removed(tiny_dir: Path) -> None:
    port = _free_port()
    eng = _engine(
        tiny_dir,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"},
    )
    sub = _sub(port)
    try:
        time.sleep(0.3)  # slow joiner
        a = list(range(10, 20))  # 10 tokens: 2 full prompt blocks
        _run(eng, "a", a, 3)  # 12 tokens computed by the end: 3 full blocks
        expect = [hash_block(None, a[0:4])]
        expect.append(hash_block(expect[0], a[4:8]))
        frames = _drain(sub)
        assert frames, "no KV event batch arrived"
        batches = [_decode(f[2]) for f in frames]
        stored = [e for b in batches for e in b[1] if e["type"] == "BlockStored"]
        first = stored[0]
        assert first["block_hashes"] == expect and first["parent_block_hash"] is None
        assert first["token_ids"] == a[:8] and first["block_size"] == 4
        assert first["medium"] == "GPU"
        assert all(b[2] == 0 for b in batches)
        third = [e for e in stored if e["parent_block_hash"] == expect[1]]
        # The prompt's tail and two generated tokens, cached once computed.
        assert len(third) == 1 and len(third[0]["block_hashes"]) == 1
        assert third[0]["token_ids"][:2] == a[8:10]
        # A prompt of 31 distinct tokens needs all 8 blocks: every cached block of a goes.
        _run(eng, "b", list(range(100, 131)), 1)
        frames = _drain(sub)
        gone = [e for f in frames for e in _decode(f[2])[1] if e["type"] == "BlockRemoved"]
        assert set(expect) <= {h for e in gone for h in e["block_hashes"]}
        assert {e["medium"] for e in gone} == {"GPU"}
    finally:
        sub.close()
        eng.close()
    assert eng.kv_event_publisher is not None and eng.kv_event_publisher.num_dropped == 0


def test_events_off_opens_no_socket(tiny_dir: Path) -> None:
    port = _free_port()
    cfg = {"enable_kv_cache_events": False, "endpoint": f"tcp://*:{port}"}
    eng = _engine(tiny_dir, kv_events_config=cfg)
    assert eng.kv_event_publisher is None and eng.kv_events is None
    assert eng.kv.pool.events is None
    _run(eng, "a", list(range(10, 20)), 2)
    with socket.socket() as s:  # nobody bound the port
        s.bind(("0.0.0.0", port))
    eng.close()


def test_disk_tier_reports_writes_and_evictions(tmp_path: Path) -> None:
    """Disk blocks are stored (with their parent) when written and removed when
    evicted to stay under budget; the writer thread may report them (locked)."""
    import torch

    from engine.kv.disk_tier import DiskTier

    events = KVEventCollector(block_size=2)
    h1 = hash_block(None, [1, 2])
    h2 = hash_block(h1, [3, 4])
    m1, m2 = BlockMeta(h1, (1, 2), range(2), None), BlockMeta(h2, (3, 4), range(2, 4), h1)
    probe = DiskTier(tmp_path / "probe", 1 << 20, 8, 2, b"\x01" * 32)
    blob = len(probe.encode(m1, bytes(8)))
    disk = DiskTier(tmp_path / "d", blob + blob // 2, 8, 2, b"\x01" * 32)  # room for one
    disk.events = events
    rows = torch.zeros((1, 8), dtype=torch.uint8)
    assert disk.put([m1], rows) == [True]
    assert disk.put([m2], rows) == [True]
    got = [_decode(msgspec.msgpack.encode(e)) for e in events.take()]
    assert [(e["type"], e["block_hashes"], e.get("medium")) for e in got] == [
        ("BlockStored", [h1, h2], "DISK"),  # one chain: merged into one event
        ("BlockRemoved", [h1], "DISK"),
    ]
    assert got[0]["parent_block_hash"] is None and got[0]["token_ids"] == [1, 2, 3, 4]


def test_engine_reports_demotions_to_the_host_tier(tiny_dir: Path) -> None:
    """An evicted device block demoted into the host tier: CPU stored (same
    key, same parent chain), then GPU removed."""
    eng = _engine(tiny_dir, num_host_blocks_override=16, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "null"})  # fmt: skip
    assert eng.kv_events is not None

    class Recorder(KVEventPublisher):
        def __init__(self) -> None:
            super().__init__()
            self.batches: list[KVEventBatch] = []

        def publish(self, batch: KVEventBatch) -> None:
            self.batches.append(batch)

    rec = Recorder()
    eng.kv_event_publisher = rec
    a = list(range(10, 20))
    _run(eng, "a", a, 3)
    _run(eng, "b", list(range(100, 131)), 1)
    events = [_decode(msgspec.msgpack.encode(e)) for b in rec.batches for e in b.events]
    h0 = hash_block(None, a[0:4])
    h1 = hash_block(h0, a[4:8])
    cpu = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "CPU"]
    parent: dict[bytes, bytes | None] = {}
    for e in cpu:  # an event's first block names its parent; each next one follows it
        for k, h in enumerate(e["block_hashes"]):
            parent[h] = e["block_hashes"][k - 1] if k else e["parent_block_hash"]
    assert parent[h0] is None and parent[h1] == h0
    assert all(len(e["token_ids"]) == 4 * len(e["block_hashes"]) for e in cpu)
    order = [(e["type"], e["medium"], h) for e in events for h in e.get("block_hashes", [])]
    assert order.index(("BlockStored", "CPU", h0)) < order.index(("BlockRemoved", "GPU", h0))
    eng.close()
