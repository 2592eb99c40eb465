"""Request traces, request ids and JSON logs against the real server (default model).

Two servers, one per test: ``--enable-request-traces --log-json`` (metadata
only: the prompt's marker must appear in no trace and no log line) and the
same plus ``--log-prompts`` (the marker is in the trace, ``?publish=true``
strips it). Prefill is chunked small (``--max-num-batched-tokens``) so chunk
counting is meaningful.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import live_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 16  # --max-num-batched-tokens: a ~60-token prompt takes several prefill steps
MARKER = "pelican-marmalade-4417"
SYSTEM = (
    "You are a careful assistant for a lighthouse keeper. Answer briefly, mention the tide "
    "tables when relevant, and never invent ship names. "
)


@dataclass
class Live:
    base: str
    log: Path

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


@contextlib.contextmanager
def running(log: Path, *flags: str) -> Iterator[Live]:
    """A live server (tests/live_server.py) with ``flags``, as a Live handle."""
    with live_server(["--host", "127.0.0.1", *flags], log) as (_, base):
        yield Live(base, log)


def chat_body(question: str, max_tokens: int = 6, **kw: Any) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **kw,
    }


def check_trace(trace: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> int:
    """Assert the trace's shape against the response's usage; returns prefix-cached tokens."""
    events = trace["events"]
    kinds = [e["kind"] for e in events]
    assert trace["finished"] and kinds[-1] == "finished", kinds
    assert events[-1]["reason"] == "length"
    assert kinds.count("queue_wait") == 1 and "preempted" not in kinds
    hits = [e["num_tokens"] for e in events if e["kind"] == "prefix_hit"]
    cached = hits[0] if hits else 0
    # Prefill: contiguous chunks from the cached prefix to the prompt's end, <= CHUNK each.
    chunks = [e for e in events if e["kind"] == "prefill_chunk"]
    offsets = [c["start_offset"] for c in chunks]
    sizes = [c["num_tokens"] for c in chunks]
    assert offsets[0] == cached and sum(sizes) == prompt_tokens - cached, (offsets, sizes)
    assert all(o + s == nxt for o, s, nxt in zip(offsets, sizes, offsets[1:])), (offsets, sizes)
    assert max(sizes) <= CHUNK and len(chunks) == math.ceil((prompt_tokens - cached) / CHUNK)
    # The last prefill chunk samples the first token; every other token is one decode step.
    decodes = [e for e in events if e["kind"] == "decode_step"]
    assert len(decodes) == completion_tokens - 1
    assert all(d["batch_size"] >= 1 and d["duration_ms"] > 0 for d in decodes)
    # Timings add up: disjoint spans within the end-to-end time.
    t = trace["timings"]
    assert t["consistent"], t
    queue = sum(e["wait_ms"] for e in events if e["kind"] == "queue_wait")
    prefill = sum(c["duration_ms"] for c in chunks)
    decode = sum(d["duration_ms"] for d in decodes)
    assert math.isclose(t["queue_ms"], queue) and math.isclose(t["prefill_ms"], prefill)
    assert math.isclose(t["decode_ms"], decode)
    assert prefill > 0 and queue + prefill + decode <= t["e2e_ms"] + 1.0
    return int(cached)


def sse_payloads(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            out.append(json.loads(block[len("data: ") :]))
    return out


def test_traces_ids_and_logs_metadata_only(tmp_path: Path) -> None:
    flags = ["--enable-request-traces", "--log-json", "--max-num-batched-tokens", str(CHUNK)]
    with running(tmp_path / "server.log", *flags) as srv, httpx.Client(timeout=120) as c:
        # Non-streaming chat with a client request id.
        t0 = time.monotonic()
        r = c.post(
            f"{srv.base}/v1/chat/completions",
            json=chat_body(f"What is {MARKER}?"),
            headers={"X-Request-Id": "abc123"},
        )
        wall_ms = (time.monotonic() - t0) * 1000
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "abc123"
        reply = r.json()
        usage = reply["usage"]
        tr = c.get(f"{srv.base}/v1/traces/{reply['id']}")
        assert tr.status_code == 200, tr.text
        assert tr.headers["x-request-id"]
        trace = tr.json()
        assert trace["request_id"].startswith("abc123-")
        assert check_trace(trace, usage["prompt_tokens"], usage["completion_tokens"]) == 0
        assert trace["timings"]["e2e_ms"] <= wall_ms
        assert MARKER not in tr.text and "prompt_text" not in trace

        # Same system prompt again: served partly from the prefix cache.
        r = c.post(f"{srv.base}/v1/chat/completions", json=chat_body("And the tide?"))
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        trace = c.get(f"{srv.base}/v1/traces/{r.json()['id']}").json()
        cached = check_trace(trace, usage["prompt_tokens"], usage["completion_tokens"])
        assert cached > 0 and cached == usage["prompt_tokens_details"]["cached_tokens"]

        # Streaming completion: the id is echoed on the stream, the trace is found by its id.
        body = {"prompt": f"Tell me about {MARKER}.", "max_tokens": 5, "ignore_eos": True}
        r = c.post(
            f"{srv.base}/v1/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
            headers={"X-Request-Id": "stream-42"},
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "stream-42"
        chunks = sse_payloads(r.text)
        usage = chunks[-1]["usage"]
        trace = c.get(f"{srv.base}/v1/traces/{chunks[0]['id']}").json()
        check_trace(trace, usage["prompt_tokens"], usage["completion_tokens"])

        # n = 2: choice k under "<id>-k".
        r = c.post(f"{srv.base}/v1/chat/completions", json=chat_body("Hi", max_tokens=3, n=2))
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        first = c.get(f"{srv.base}/v1/traces/{rid}").json()
        second = c.get(f"{srv.base}/v1/traces/{rid}-1").json()
        assert first["request_id"].endswith("-0") and second["request_id"].endswith("-1")

        published = c.get(f"{srv.base}/v1/traces/{rid}", params={"publish": "true"}).json()
        assert published["publishable"] and published["redacted"] == []

        missing = c.get(f"{srv.base}/v1/traces/chatcmpl-does-not-exist")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "trace_not_found"

    lines = srv.log_lines()
    assert not any(MARKER in line for line in lines), "prompt text leaked into the logs"
    records = [json.loads(line) for line in lines if line.startswith("{")]
    tagged = [rec for rec in records if rec.get("request_id") == "abc123"]
    assert tagged and tagged[0]["logger"] == "fuel_serve.server", tagged
    assert tagged[0]["completion_tokens"] == 6 and tagged[0]["finish_reason"] == "length"
    assert any(rec.get("request_id") == "stream-42" for rec in records)


def test_log_prompts_trace_has_text_publish_strips_it(tmp_path: Path) -> None:
    flags = ["--enable-request-traces", "--log-prompts", "--max-num-batched-tokens", str(CHUNK)]
    with running(tmp_path / "server.log", *flags) as srv, httpx.Client(timeout=120) as c:
        r = c.post(f"{srv.base}/v1/chat/completions", json=chat_body(f"Who is {MARKER}?"))
        assert r.status_code == 200, r.text
        reply = r.json()
        full = c.get(f"{srv.base}/v1/traces/{reply['id']}").json()
        assert MARKER in full["prompt_text"]
        assert len(full["prompt_token_ids"]) == reply["usage"]["prompt_tokens"]
        assert len(full["output_token_ids"]) == reply["usage"]["completion_tokens"]
        assert isinstance(full["output_text"], str)
        pub = c.get(f"{srv.base}/v1/traces/{reply['id']}", params={"publish": "true"})
        assert pub.status_code == 200
        assert MARKER not in pub.text
        published = pub.json()
        assert "prompt_token_ids" in published["redacted"]
        assert not {"prompt_text", "output_text", "prompt_token_ids"} & set(published)
        assert published["timings"]["consistent"]
    # --log-prompts is the operator's explicit choice to log content.
    assert any(MARKER in line for line in srv.log_lines())
