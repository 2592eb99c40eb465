"""``--kv-events-config``: vLLM's JSON keys, and the publisher of KV event batches.

Accepted keys (vLLM's ``KVEventsConfig`` names, defaults and meanings):

* ``enable_kv_cache_events`` (false): publish at all.
* ``publisher``: ``"zmq"`` (the default when enabled) or ``"null"`` (collect
  and drop: the cost of collection without a socket).
* ``endpoint`` (``"tcp://*:5557"``): the ZMQ PUB socket. Bound when it holds a
  wildcard (``*``, ``::``) or is ``ipc://``/``inproc://``, else connected (vLLM's
  rule). With ``data_parallel_rank`` r > 0 its TCP port is offset by r.
* ``replay_endpoint`` (null): a ZMQ ROUTER socket (bound, port offset too) that
  answers a request ``[b"", start_seq (8 bytes, big-endian)]`` with every kept
  batch from that sequence number on, ``[b"", seq, payload]`` each, then
  ``[b"", -1 (8 bytes), b""]``.
* ``buffer_steps`` (10000): batches kept for replay.
* ``hwm`` (100000): the PUB socket's send high-water mark.
* ``max_queue_size`` (100000): batches waiting for the publisher thread; a
  batch that finds the queue full is dropped and counted, never waited for.
* ``topic`` (``""``): the first frame of every message.

Messages on the PUB socket are three frames, as vLLM sends them:
``[topic, seq (8 bytes, big-endian, from 0), msgpack(KVEventBatch)]``.

Anything else, or a value of the wrong type or range, is a start-up error
naming the key.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from engine.kv.events import KVEventBatch

logger = logging.getLogger(__name__)

PublisherKind = Literal["zmq", "null"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: PublisherKind = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _want(key: str, value: object, kind: type, what: str) -> None:
    # bool is an int subclass: refuse True where a count is meant.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"--kv-events-config: {key!r} must be {what}, got {value!r}")


def parse_kv_events_config(raw: dict[str, Any] | None) -> KVEventsConfig | None:
    """The typed config, or None when events are off (no key, or not enabled)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {"enable_kv_cache_events", *KVEventsConfig.__dataclass_fields__}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; accepted: {sorted(known)}")
    enabled = raw.get("enable_kv_cache_events", False)
    _want("enable_kv_cache_events", enabled, bool, "true or false")
    publisher = raw.get("publisher", "zmq")
    if publisher not in ("zmq", "null"):
        raise ValueError(
            f"--kv-events-config: 'publisher' must be 'zmq' or 'null', got {publisher!r}"
        )
    endpoint = raw.get("endpoint", KVEventsConfig.endpoint)
    _want("endpoint", endpoint, str, "a ZMQ address (tcp://HOST:PORT, ipc://, inproc://)")
    replay = raw.get("replay_endpoint")
    if replay is not None:
        _want("replay_endpoint", replay, str, "a ZMQ address or null")
    for key in (endpoint, replay):
        if key is not None and not key.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(
                f"--kv-events-config: endpoint {key!r} must start with tcp://, ipc:// or inproc://"
            )
    counts: dict[str, int] = {}
    for key, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
        value = raw.get(key, getattr(KVEventsConfig, key))
        _want(key, value, int, f"an integer >= {low}")
        if value < low:
            raise ValueError(f"--kv-events-config: {key!r} must be >= {low}, got {value}")
        counts[key] = value
    topic = raw.get("topic", "")
    _want("topic", topic, str, "a string")
    if not enabled:
        return None
    return KVEventsConfig(
        publisher=publisher,
        endpoint=endpoint,
        replay_endpoint=replay,
        topic=topic,
        **counts,
    )


def offset_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` for data-parallel rank ``rank``: TCP port + rank, ``_dp{rank}``
    appended to an inproc/ipc name (vLLM's rule)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--kv-events-config: endpoint {endpoint!r} has no port to offset")
        return f"{host}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The publisher contract, and the ``"null"`` publisher: ``publish`` never
    blocks; this base drops (and counts) every batch."""

    def __init__(self, max_queue_size: int = 1) -> None:
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self.num_dropped = 0  # batches the full queue refused
        self.num_published = 0

    def publish(self, batch: KVEventBatch) -> None:
        """Hand ``batch`` to the publisher thread, or drop and count it (queue full, closed)."""
        self.num_dropped += 1

    def close(self) -> None:
        """Stop (idempotent); batches still queued get up to a second to go out."""


class ZmqKVEventPublisher(KVEventPublisher):
    """ZMQ PUB (+ optional ROUTER replay) socket owned by one daemon thread.

    The sockets are created, used and closed by that thread only (ZMQ sockets
    are not thread-safe); the engine thread only puts batches on the queue.
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        super().__init__(config.max_queue_size)
        self.config = config
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (
            offset_endpoint(config.replay_endpoint, data_parallel_rank)
            if config.replay_endpoint is not None
            else None
        )
        self._closed = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(
                f"--kv-events-config: cannot open {self.endpoint}: {self._error}"
            ) from self._error

    def publish(self, batch: KVEventBatch) -> None:
        if self._closed:
            self.num_dropped += 1
            return
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = 0  # one engine instance per replica (see LLMEngine)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=2.0)

    def _open(
        self, ctx: zmq.Context[zmq.Socket[bytes]]
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if _binds(self.endpoint):
            pub.bind(self.endpoint)
        else:
            pub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint is not None:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(self.replay_endpoint)
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._open(ctx)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        kept: deque[tuple[int, bytes]] = deque(maxlen=self.config.buffer_steps)
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay, kept)
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encoder.encode(batch)
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                kept.append((seq, payload))
                seq += 1
                self.num_published += 1
        except Exception:  # the publisher must never take the engine down
            logger.exception("KV event publisher stopped")
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    @staticmethod
    def _serve_replay(replay: zmq.Socket[bytes], kept: deque[tuple[int, bytes]]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: ignoring a replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in kept:
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> KVEventPublisher:
    """The publisher ``config.publisher`` names."""
    if config.publisher == "null":
        return KVEventPublisher()
    return ZmqKVEventPublisher(config, data_parallel_rank)
