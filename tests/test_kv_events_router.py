"""vllm-router's ``kv_aware`` policy consuming our KV events, end to end on loopback.

Two tiny-checkpoint replicas publish KV events (replica 1 as data-parallel
rank 1: its endpoint port is offset by one); the router subscribes to both
(``--kv-event-source``). After one request, every later request sharing its
prefix must be routed to the replica that holds the prefix: the router
credits the prefix (its ``kv_placement_lookups{result="hit"}`` counter) and
only that replica reports prefix-cache hits.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import default_gguf_path
from tests.model_utils import make_tiny_checkpoint

ROUTER = Path(sys.executable).parent / "vllm-router"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not ROUTER.exists() and shutil.which("vllm-router") is None,
        reason="vllm-router is not installed",
    ),
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? ([0-9.e+-]+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def _wait(url: str, timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{p.args!r} exited with {p.returncode}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not ready within {timeout_s} s")


def _wait_subscribed(log: Path, workers: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if all(re.search(rf"subscriber for {re.escape(w)}\b", text) for w in workers):
            return
        time.sleep(0.2)
    raise AssertionError(f"the router did not subscribe to {workers} within {timeout_s} s")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, list[str], str, str]]:
    model = make_tiny_checkpoint(tmp_path, "llama")
    p0, p1, router_port, metrics_port, zmq_port, _ = _free_ports(6)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{zmq_port}"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        for rank, port in enumerate((p0, p1)):
            log = open(tmp_path / f"replica{rank}.log", "wb")  # closed in finally
            logs.append(log)
            cmd = [
                sys.executable, "-m", "server.cli", str(model),
                "--tokenizer", str(default_gguf_path()),
                "--host", "127.0.0.1", "--port", str(port),
                "--block-size", "16", "--num-gpu-blocks-override", "64",
                "--num-threads", "1", "--kv-events-config", json.dumps(events),
                "--data-parallel-rank", str(rank),
            ]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        workers = [f"http://127.0.0.1:{p}" for p in (p0, p1)]
        for w in workers:
            _wait(f"{w}/health", 120, procs)
        router_log = open(tmp_path / "router.log", "wb")  # closed in finally
        logs.append(router_log)
        cmd = [
            str(ROUTER) if ROUTER.exists() else "vllm-router",
            "--host", "127.0.0.1", "--port", str(router_port),
            "--worker-urls", *workers,
            "--policy", "kv_aware",
            "--kv-event-source", f"{workers[0]}=tcp://127.0.0.1:{zmq_port}",
            # rank 1 publishes on the endpoint's port + 1 (vLLM's data-parallel offset)
            "--kv-event-source", f"{workers[1]}=tcp://127.0.0.1:{zmq_port + 1}",
            "--kv-event-block-size", "16",
            "--kv-event-model", str(model),
            "--worker-startup-check-interval", "1",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=router_log, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{router_port}"
        _wait(f"{router}/v1/models", 60, procs)
        # ZMQ PUB drops what it publishes before a subscriber has joined: wait
        # until the router logs both subscribers, then for their subscriptions
        # to reach the publishers.
        _wait_subscribed(tmp_path / "router.log", workers, 60)
        time.sleep(1.0)
        yield router, workers, f"http://127.0.0.1:{metrics_port}/metrics", str(model)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for log in logs:
            log.close()


def test_kv_aware_router_follows_our_events(cluster: tuple[str, list[str], str, str]) -> None:
    """Each prefix is first computed on one replica directly (the router never
    sees it); the router's later requests with that prefix must go there, in
    both directions, so no fixed tie-break can pass this: only the events
    tell the router where the prefix is."""
    router, workers, _, model = cluster

    def complete(base: str, prompt: list[int]) -> None:
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0},
            timeout=60.0,
        )
        assert r.status_code == 200, r.text
        time.sleep(0.5)  # the step's events reach the router

    def hits() -> list[float]:
        return [
            _metric(httpx.get(f"{w}/metrics", timeout=5).text, "vllm:prefix_cache_hits_total")
            for w in workers
        ]

    for home in (1, 0):
        prefix = [(7 * i + 31 * home) % 200 + 3 for i in range(80)]  # 5 full blocks of 16
        before = hits()
        complete(workers[home], [*prefix, 250])
        for i in range(3):
            complete(router, [*prefix, 240 + i, 241 + i])
        gained = [after - b for after, b in zip(hits(), before)]
        want = [0.0, 0.0]
        want[home] = 3 * 80.0  # every follow-up found the 80-token prefix where it lives
        assert gained == want, (home, gained)
