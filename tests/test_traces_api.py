"""``GET /v1/traces/{id}`` and the per-request log line, against a fake engine (fast).

The fake records real ``engine.trace`` traces (one prefill chunk, one decode
step per later token) under the engine request ids the app chooses, and answers
``get_trace`` as ``AsyncEngine`` does, so the route's id mapping, 404s, content
decoding and publication review are exercised without a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.outputs import RequestOutput
from engine.request import RequestOptions
from engine.sampling.params import SamplingParams
from engine.trace import RequestTrace, TraceRecorder, TraceStore
from server.app import build_app
from server.config import ServerConfig
from server.traces import engine_id_candidates
from tests.server_fakes import FakeEngine, assert_schema

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MARKER = "zebra-quokka-7731"


@dataclass
class TracingFakeEngine(FakeEngine):
    """FakeEngine that records traces like LLMEngine does (n > 1 under ``<id>-<i>``)."""

    log_prompts: bool = False
    traces: TraceStore = field(default_factory=lambda: TraceStore(max_traces=100))

    def __post_init__(self) -> None:
        self.tracer = TraceRecorder(self.traces, log_prompts=self.log_prompts)

    async def get_trace(self, request_ids: Sequence[str]) -> RequestTrace | None:
        for rid in request_ids:
            trace = self.traces.get(rid)
            if trace is not None:
                return dataclasses.replace(trace, events=list(trace.events))
        return None

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        rids = [f"{request_id}-{i}" for i in range(params.n)] if params.n > 1 else [request_id]
        t = time.monotonic()
        for rid in rids:
            self.tracer.on_arrival(rid, t)
            self.tracer.on_scheduled(rid, t)
        outputs: dict[int, list[int]] = {i: [] for i in range(params.n)}
        first = True
        async for out in super().generate(prompt_token_ids, params, request_id, options):
            for d in out.outputs:
                rid = rids[d.index]
                if first:
                    self.tracer.on_prefill_chunk(rid, len(prompt_token_ids), 0, 0.01)
                else:
                    self.tracer.on_decode_step(rid, 0.01, params.n)
                outputs[d.index].extend(d.delta_token_ids)
                if d.finish_reason is not None:
                    self.tracer.on_finished(rid, time.monotonic(), d.finish_reason)
                    self.tracer.on_content(
                        rid,
                        prompt_token_ids=list(prompt_token_ids),
                        output_token_ids=outputs[d.index],
                    )
            first = False
            yield out


def make_client(
    engine: FakeEngine,
    *,
    enable_request_traces: bool = False,
    log_prompts: bool = False,
    **cfg: Any,
) -> TestClient:
    # Traces and prompt logging are engine settings: the server asks its engine.
    engine.traces_enabled = enable_request_traces
    engine.log_prompts = log_prompts
    if isinstance(engine, TracingFakeEngine):
        engine.tracer = TraceRecorder(engine.traces, log_prompts=log_prompts)
    return TestClient(build_app(engine, ServerConfig(**cfg)))


def chat(client: TestClient, content: str = "hi", **kw: Any) -> dict[str, Any]:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": content}], **kw}
    r = client.post(CHAT, json=body)
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


def test_trace_is_a_copy() -> None:
    engine = TracingFakeEngine()
    engine.tracer.on_arrival("r", 1.0)
    snap = asyncio.run(engine.get_trace(["x", "r"]))
    assert isinstance(snap, RequestTrace) and snap.request_id == "r"
    engine.tracer.on_scheduled("r", 2.0)
    assert snap.events == [] and len(engine.traces.get("r").events) == 1  # type: ignore[union-attr]


def test_traces_off_is_404() -> None:
    with make_client(TracingFakeEngine()) as client:
        reply = chat(client)
        assert_not_found(client.get(f"/v1/traces/{reply['id']}"))


def test_engine_without_traces_is_404() -> None:
    with make_client(FakeEngine(), enable_request_traces=True) as client:
        reply = chat(client)
        assert_not_found(client.get(f"/v1/traces/{reply['id']}"))


def test_chat_trace_by_response_id() -> None:
    engine = TracingFakeEngine(reply="abcd")
    with make_client(engine, enable_request_traces=True) as client:
        reply = chat(client, content=MARKER)
        r = client.get(f"/v1/traces/{reply['id']}")
        assert r.status_code == 200, r.text
        trace = r.json()
        # The response id is the engine id behind the OpenAI prefix.
        assert reply["id"] == f"chatcmpl-{engine.calls[-1].request_id}"
        assert trace["request_id"] == engine.calls[-1].request_id
        kinds = [e["kind"] for e in trace["events"]]
        assert kinds == ["queue_wait", "prefill_chunk"] + ["decode_step"] * 3 + ["finished"]
        assert trace["finished"] and trace["timings"]["consistent"]
        # Metadata only without log_prompts: no content keys at all.
        assert MARKER not in r.text
        assert not {"prompt_text", "output_text", "prompt_token_ids"} & set(trace)
        assert_not_found(client.get("/v1/traces/chatcmpl-nope"))


def test_n_choices_and_prompts_addressed_by_suffix() -> None:
    engine = TracingFakeEngine(reply="xy")
    with make_client(engine, enable_request_traces=True) as client:
        reply = chat(client, n=2)
        base = engine.calls[-1].request_id
        assert client.get(f"/v1/traces/{reply['id']}").json()["request_id"] == f"{base}-0"
        assert client.get(f"/v1/traces/{reply['id']}-1").json()["request_id"] == f"{base}-1"
        r = client.post(COMP, json={"model": "fake-model", "prompt": ["one", "two"]})
        assert r.status_code == 200, r.text
        cid = r.json()["id"]
        engine_ids = [c.request_id for c in engine.calls[-2:]]
        assert client.get(f"/v1/traces/{cid}").json()["request_id"] == engine_ids[0]
        assert client.get(f"/v1/traces/{cid}-1").json()["request_id"] == engine_ids[1]


def test_log_prompts_text_in_trace_stripped_when_published() -> None:
    engine = TracingFakeEngine(reply="ok", log_prompts=True)
    with make_client(engine, enable_request_traces=True, log_prompts=True) as client:
        reply = chat(client, content=MARKER)
        full = client.get(f"/v1/traces/{reply['id']}").json()
        assert MARKER in full["prompt_text"] and full["output_text"] == "ok"
        assert full["prompt_token_ids"]
        r = client.get(f"/v1/traces/{reply['id']}", params={"publish": "true"})
        assert r.status_code == 200
        assert MARKER not in r.text
        published = r.json()
        assert set(published["redacted"]) == {"prompt_token_ids", "output_token_ids"}
        assert published["publishable"] and published["issues"] == []
        assert "prompt_token_ids" not in published and "prompt_text" not in published


def test_finished_log_line_has_request_id_and_no_text(caplog: pytest.LogCaptureFixture) -> None:
    with make_client(TracingFakeEngine(reply="secretreply")) as client:
        caplog.set_level(logging.INFO, logger="fuel_serve.server")
        body = {"model": "fake-model", "messages": [{"role": "user", "content": MARKER}]}
        r = client.post(CHAT, json=body, headers={"X-Request-Id": "abc123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc123"
        r = client.post(CHAT, json={**body, "model": "nope"}, headers={"X-Request-Id": "e404"})
        assert r.status_code == 404 and r.headers["x-request-id"] == "e404"
    finished = [rec for rec in caplog.records if getattr(rec, "request_id", None) == "abc123"]
    assert len(finished) == 1
    rec: Any = finished[0]
    assert rec.completion_tokens == len("secretreply") and rec.finish_reason == "stop"
    assert rec.engine_request_id.startswith("abc123-")
    errors: list[Any] = [r for r in caplog.records if getattr(r, "request_id", None) == "e404"]
    assert [(e.status, e.code) for e in errors] == [(404, "model_not_found")]
    text = "\n".join(f"{r.getMessage()} {vars(r)}" for r in caplog.records)
    assert MARKER not in text and "secretreply" not in text
