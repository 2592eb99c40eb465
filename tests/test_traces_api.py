"""``GET /v1/traces/{id}`` and the per-request log line, on a real engine (tiny checkpoint).

The engine records its own traces (``--enable-request-traces``) under the
engine request ids the app chooses; the route maps response ids back to them,
answers 404s in the envelope, decodes content only with ``--log-prompts`` and
strips it for publication.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from server.traces import engine_id_candidates
from tests.real_engine import SharedEngine, exact_engine
from tests.server_fakes import assert_schema

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MARKER = "zebra-quokka-7731"


def _engine(model_dir: Path, **kw: Any) -> Iterator[SharedEngine]:
    shared = SharedEngine(exact_engine(model_dir, **kw))
    yield shared
    asyncio.run(shared.inner.shutdown())


@pytest.fixture(scope="module")
def traced(tiny_server_engine: SharedEngine) -> SharedEngine:
    return tiny_server_engine  # the shared engine records traces


@pytest.fixture(scope="module")
def traced_with_prompts(tiny_server_dir: Path) -> Iterator[SharedEngine]:
    yield from _engine(tiny_server_dir, enable_request_traces=True, log_prompts=True)


@pytest.fixture(scope="module")
def untraced(tiny_server_dir: Path) -> Iterator[SharedEngine]:
    yield from _engine(tiny_server_dir)


def client_of(engine: SharedEngine) -> TestClient:
    return TestClient(build_app(engine, ServerConfig(served_model_name=["tiny"])))


def chat(client: TestClient, content: str = "hi", **kw: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}
    r = client.post(CHAT, json={"ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def assert_not_found(resp: Any) -> None:
    assert resp.status_code == 404, resp.text
    body = resp.json()
    assert_schema(body, "ErrorResponse")
    assert body["error"]["code"] == "trace_not_found"


def test_candidates_strip_prefix() -> None:
    assert engine_id_candidates("chatcmpl-a-b") == ["a-b", "a-b-0", "a-b-0-0"]
    assert engine_id_candidates("cmpl-x") == ["x", "x-0", "x-0-0"]
    assert engine_id_candidates("raw") == ["raw", "raw-0", "raw-0-0"]


def test_traces_off_is_404(untraced: SharedEngine) -> None:
    with client_of(untraced) as client:
        reply = chat(client)
        assert_not_found(client.get(f"/v1/traces/{reply['id']}"))


def test_chat_trace_by_response_id(traced: SharedEngine) -> None:
    with client_of(traced) as client:
        reply = chat(client, content=MARKER)
        r = client.get(f"/v1/traces/{reply['id']}")
        assert r.status_code == 200, r.text
        trace = r.json()
        engine_id = traced.calls[-1][2]
        # The response id is the engine id behind the OpenAI prefix.
        assert reply["id"] == f"chatcmpl-{engine_id}" and trace["request_id"] == engine_id
        kinds = [e["kind"] for e in trace["events"] if e["kind"] not in ("kv_blocks", "prefix_hit")]
        # A short prompt: one prefill chunk (which samples token 1), then 3 decodes.
        assert kinds == ["queue_wait", "prefill_chunk"] + ["decode_step"] * 3 + ["finished"]
        # The shared engine may hold the template's opening in its prefix cache.
        hits = [e["num_tokens"] for e in trace["events"] if e["kind"] == "prefix_hit"]
        assert sum(hits) == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert trace["finished"] and trace["timings"]["consistent"]
        # Metadata only without log_prompts: no content keys at all.
        assert MARKER not in r.text
        assert not {"prompt_text", "output_text", "prompt_token_ids"} & set(trace)
        assert_not_found(client.get("/v1/traces/chatcmpl-nope"))


def test_trace_is_a_copy(traced: SharedEngine) -> None:
    with client_of(traced) as client:
        reply = chat(client)
        rid = reply["id"].removeprefix("chatcmpl-")
        first = asyncio.run(traced.get_trace([rid]))
        assert first is not None and first.request_id == rid
        events = list(first.events)
        first.events.clear()  # the copy is the caller's: the stored trace is untouched
        again = asyncio.run(traced.get_trace(["unknown", rid]))
        assert again is not None and again.events == events


def test_n_choices_and_prompts_addressed_by_suffix(traced: SharedEngine) -> None:
    with client_of(traced) as client:
        reply = chat(client, n=2)
        base = traced.calls[-1][2]
        assert client.get(f"/v1/traces/{reply['id']}").json()["request_id"] == f"{base}-0"
        assert client.get(f"/v1/traces/{reply['id']}-1").json()["request_id"] == f"{base}-1"
        r = client.post(COMP, json={"prompt": ["one", "two"], "max_tokens": 2})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        engine_ids = [c[2] for c in traced.calls[-2:]]
        assert client.get(f"/v1/traces/{cid}").json()["request_id"] == engine_ids[0]
        assert client.get(f"/v1/traces/{cid}-1").json()["request_id"] == engine_ids[1]


def test_log_prompts_text_in_trace_stripped_when_published(
    traced_with_prompts: SharedEngine,
) -> None:
    with client_of(traced_with_prompts) as client:
        reply = chat(client, content=MARKER)
        full = client.get(f"/v1/traces/{reply['id']}").json()
        prompt_ids, params, _, _ = traced_with_prompts.calls[-1]
        tok = traced_with_prompts.tokenizer
        assert MARKER in full["prompt_text"] and full["prompt_token_ids"] == prompt_ids
        assert len(full["output_token_ids"]) == params.max_tokens == 4
        assert full["output_text"] == tok.decode(
            full["output_token_ids"], skip_special_tokens=False
        )
        r = client.get(f"/v1/traces/{reply['id']}", params={"publish": "true"})
        assert r.status_code == 200
        assert MARKER not in r.text
        published = r.json()
        assert set(published["redacted"]) == {"prompt_token_ids", "output_token_ids"}
        assert published["publishable"] and published["issues"] == []
        assert "prompt_token_ids" not in published and "prompt_text" not in published


def test_finished_log_line_has_request_id_and_no_text(
    untraced: SharedEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with client_of(untraced) as client:
        caplog.set_level(logging.INFO, logger="fuel_serve.server")
        body = {"messages": [{"role": "user", "content": MARKER}], "max_tokens": 3}
        r = client.post(CHAT, json={**body, "ignore_eos": True}, headers={"X-Request-Id": "abc123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc123"
        r = client.post(CHAT, json={**body, "model": "nope"}, headers={"X-Request-Id": "e404"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "e404"
    finished = [rec for rec in caplog.records if getattr(rec, "request_id", None) == "abc123"]
    assert len(finished) == 1
    rec: Any = finished[0]
    assert rec.completion_tokens == 3 and rec.finish_reason == "length"
    assert rec.engine_request_id.startswith("abc123-")
    errors: list[Any] = [r for r in caplog.records if getattr(r, "request_id", None) == "e404"]
    assert [(e.status, e.code) for e in errors] == [(404, "model_not_found")]
    logged = "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)
    assert MARKER not in logged
