"""End to end overload: the real server with small limits, hit by a burst beyond capacity.

What must hold under overload: excess requests get 429 with Retry-After and an
OpenAI error body, nothing gets a 5xx, every admitted request completes with a
proper finish_reason, and once the burst is over the engine is empty with every
KV block free. Plus the two at-once refusals: a request that can never fit the
KV cache (400) and a latency budget the predictor says cannot be met (429 whose
message states the predicted time).

One server for the module (model load dominates): ``--max-num-seqs 4
--max-waiting-requests 4`` and a 16 MiB KV cache (45 blocks of 16 tokens with
the default model's float16 KV, the CPU default), so a short request fits but
900 tokens never do.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import live_server

import engine.async_engine  # noqa: F401  (an engine import error must fail, not skip)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
MODEL = "smol"
BURST = 40
FINISH_REASONS = {"stop", "length"}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("overload") / "server.log"
    flags = [
        "--enable-debug-endpoints",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "16MiB",
        "--max-num-seqs",
        "4",
        "--max-waiting-requests",
        "4",
        "--served-model-name",
        MODEL,
    ]
    with live_server(flags, log) as (_, base):
        yield base


@dataclass
class Outcome:
    """One burst request: its status, headers and (error or completion) body."""

    stream: bool
    status: int
    headers: httpx.Headers
    body: dict[str, Any] | None  # JSON body of a non-200 or a non-streaming 200
    finish_reasons: list[str | None]
    done: bool  # streaming: saw ``data: [DONE]``


async def _one(client: httpx.AsyncClient, i: int, stream: bool) -> Outcome:
    payload: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
    }
    if not stream:
        r = await client.post("/v1/chat/completions", json=payload)
        body = r.json()
        reasons = [c.get("finish_reason") for c in body.get("choices", [])]
        return Outcome(False, r.status_code, r.headers, body, reasons, False)
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            await r.aread()
            return Outcome(True, r.status_code, r.headers, r.json(), [], False)
        seen: list[str | None] = []
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            seen += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
        return Outcome(True, 200, r.headers, None, seen, done)


async def _burst(base: str) -> list[Outcome]:
    limits = httpx.Limits(max_connections=BURST + 8, max_keepalive_connections=BURST + 8)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        return await asyncio.gather(*(_one(client, i, stream=i % 2 == 0) for i in range(BURST)))


def _assert_openai_error(body: dict[str, Any] | None) -> dict[str, Any]:
    assert body is not None and isinstance(body.get("error"), dict), body
    err = body["error"]
    assert err["type"] and err["message"] and err["code"], err
    return err  # type: ignore[no-any-return]


def _wait_idle(base: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """/debug/engine once nothing runs or waits (the stats are published after each step)."""
    end = time.monotonic() + timeout_s
    while True:
        state: dict[str, Any] = httpx.get(f"{base}/debug/engine", timeout=5).json()
        idle = (
            state["num_running"] == 0
            and state["num_waiting"] == 0
            and state["num_unfinished_requests"] == 0
        )
        if idle or time.monotonic() > end:
            return state
        time.sleep(0.2)


def test_burst_beyond_capacity(base_url: str) -> None:
    outcomes = asyncio.run(_burst(base_url))
    statuses = [o.status for o in outcomes]
    assert all(s < 500 for s in statuses), statuses
    assert set(statuses) <= {200, 429}, statuses
    rejected = [o for o in outcomes if o.status == 429]
    admitted = [o for o in outcomes if o.status == 200]
    # 4 running + 4 waiting cannot hold 40 simultaneous arrivals. At least the
    # first 4 get in (the waiting bound); 8 or more only when the engine moved
    # some to running between arrivals, which depends on timing.
    assert rejected and len(admitted) >= 4, statuses
    for o in rejected:
        retry = o.headers.get("retry-after")
        assert retry is not None and int(retry) >= 1, o.headers
        err = _assert_openai_error(o.body)
        assert err["code"] in {"queue_full", "kv_pressure"}, err
    for o in admitted:
        assert o.finish_reasons and set(o.finish_reasons) <= FINISH_REASONS, o
        if o.stream:
            assert o.done, o

    state = _wait_idle(base_url)
    assert state["num_running"] == 0 and state["num_waiting"] == 0, state
    assert state["num_unfinished_requests"] == 0, state
    assert state["num_free_blocks"] == state["num_total_blocks"] > 0, state
    assert state["kv_cache_usage"] == 0.0, state
    assert state["rejections"].get("queue_full", 0) + state["rejections"].get(
        "kv_pressure", 0
    ) >= len(rejected), state
    # Every admitted request was scored against its admission-time prediction.
    assert state["predictor_samples"] >= len(admitted), state
    assert state["predictor_mean_abs_rel_error"] >= 0.0

    metrics = httpx.get(f"{base_url}/metrics", timeout=5).text
    m = re.search(r"^fuel:latency_predictor_samples\{[^}]*\} (\S+)$", metrics, re.M)
    assert m is not None and float(m.group(1)) >= len(admitted), metrics[-2000:]
    assert re.search(r"^fuel:latency_predictor_mean_abs_rel_error\{", metrics, re.M)


def test_never_fits_kv_cache_is_400_at_once(base_url: str) -> None:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Write a long story."}],
        # Below --max-model-len 1024, above the KV cache: 16 MiB of float16 KV
        # (the CPU default) holds 720 tokens.
        "max_tokens": 900,
    }
    t0 = time.monotonic()
    r = httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "max_tokens", err
    assert "KV cache" in err["message"], err
    assert elapsed < 5.0  # refused at arrival, not after waiting for room


def test_impossible_latency_budget_is_429_with_prediction(base_url: str) -> None:
    _wait_idle(base_url)
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 200,
        "latency_budget_ms": 1,
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = _assert_openai_error(r.json())
    assert err["code"] == "latency_budget", err
    m = re.search(r"predicted completion time is (\d+) ms for up to 200 tokens", err["message"])
    assert m is not None and int(m.group(1)) > 1, err["message"]

    # The same request with a generous budget is admitted and completes.
    payload["latency_budget_ms"] = 600_000
    payload["max_tokens"] = 4
    ok = httpx.post(f"{base_url}/v1/chat/completions", json=payload, timeout=60)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in FINISH_REASONS
