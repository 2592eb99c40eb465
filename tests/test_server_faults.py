"""The HTTP app against a scripted fake engine: only what a real engine cannot do on demand.

Refusals and failures at chosen moments (admission errors, an internal error,
a failure mid-stream), a slow load, a request that outlives its client (to
see the abort), and scripted model text (to drive the tool-call parser). The
rest of the app is tested on a real engine: tests/test_server_app.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from tests.server_fakes import (
    FakeEngine,
    assert_error,
    assert_schema,
    invalid,
    rejected,
    sse_events,
    unavailable,
)

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def make_client(engine: FakeEngine | None = None, **cfg: Any) -> TestClient:
    return TestClient(build_app(engine or FakeEngine(), ServerConfig(**cfg)))


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **kw}


def assert_healthy(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    r = client.post(CHAT, json=chat_body(max_tokens=2))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("exc", "status", "retry_after"),
    [(rejected(), 429, "3"), (unavailable(), 503, "7"), (invalid(), 400, None)],
)
def test_engine_errors(exc: Exception, status: int, retry_after: str | None) -> None:
    engine = FakeEngine(fail_first=exc)
    with make_client(engine) as c:
        for stream in (False, True):
            r = c.post(CHAT, json=chat_body(stream=stream))
            err = assert_error(r, status, contains=str(exc))
            assert r.headers.get("retry-after") == retry_after
            if status == 400:
                assert err["param"] == "stop_token_ids" and err["code"] == "invalid_value"
        engine.fail_first = None
        assert_healthy(c)


def test_internal_error_does_not_leak() -> None:
    engine = FakeEngine(fail_first=RuntimeError("secret internal failure detail"))
    # Starlette's TestClient re-raises server errors by default; we want the response.
    with TestClient(build_app(engine, ServerConfig()), raise_server_exceptions=False) as c:
        err = assert_error(c.post(CHAT, json=chat_body()), 500)
        assert "secret" not in err["message"]
        engine.fail_first = None
        assert_healthy(c)


def test_error_mid_stream() -> None:
    engine = FakeEngine(fail_after=2)
    with make_client(engine) as c:
        with c.stream("POST", CHAT, json=chat_body(stream=True)) as r:
            assert r.status_code == 200
            events = sse_events("".join(r.iter_text()))
        assert "error" in events[-1] and "secret" not in events[-1]["error"]["message"]
        assert_schema(events[-1], "ErrorResponse")
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "He"
        engine.fail_after = None
        assert_healthy(c)


def test_health_503_while_loading() -> None:
    import threading

    gate = threading.Event()
    engine = FakeEngine()

    def factory() -> FakeEngine:
        gate.wait(10)
        return engine

    app = build_app(None, ServerConfig(), engine_factory=factory)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 503
        assert_error(c.post(CHAT, json=chat_body()), 503, contains="loading")
        gate.set()
        for _ in range(100):
            if c.get("/health").status_code == 200:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert c.get("/health").status_code == 200
        assert engine.started


async def _drive(
    app: Any, body: dict[str, Any], path: str, chunks_before_leaving: int
) -> list[bytes]:
    """Drive the ASGI app by hand: send the body, read N body chunks, then disconnect."""
    got: list[bytes] = []
    leave = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            got.append(message["body"])
            if len(got) >= chunks_before_leaving:
                leave.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
    if chunks_before_leaving == 0:
        asyncio.get_running_loop().call_later(0.1, leave.set)
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    return got


@pytest.mark.parametrize("path", [CHAT, COMP])
async def test_stream_disconnect_aborts(path: str) -> None:
    engine = FakeEngine(step_delay=0.02, reply="x" * 100)
    app = build_app(engine, ServerConfig())
    async with app.router.lifespan_context(app):
        body = (
            {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "hi"}
        )
        got = await _drive(app, {**body, "stream": True, "max_tokens": 100}, path, 2)
    assert len(got) >= 2
    assert engine.aborted and engine.aborted[0] == engine.calls[0].request_id
    assert not engine.running


async def test_non_stream_disconnect_aborts() -> None:
    engine = FakeEngine(step_delay=0.05, reply="x" * 100)
    app = build_app(engine, ServerConfig())
    async with app.router.lifespan_context(app):
        await _drive(app, chat_body(max_tokens=100), CHAT, 0)
    assert engine.aborted == [engine.calls[0].request_id]
    assert not engine.running


# ------------------------------------------------------------------ tool calls

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_TEXT = (
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


# ------------------------------------------------------------------ tool calls

WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL_TEXT = (
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_tool_calls_parsed() -> None:
    engine = FakeEngine(reply=CALL_TEXT, max_model_len=512)
    with make_client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as c:
        r = c.post(CHAT, json=chat_body(tools=WEATHER))
        body = r.json()
        assert_schema(body, "CreateChatCompletionResponse")
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert choice["message"]["content"] == "Sure."

        with c.stream("POST", CHAT, json=chat_body(tools=WEATHER, stream=True)) as resp:
            events = sse_events("".join(resp.iter_text()))
        content, args, names, finish = "", "", [], None
        for ev in events:
            assert_schema(ev, "CreateChatCompletionStreamResponse")
            (ch,) = ev["choices"]
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls", []):
                assert tc["index"] == 0
                if "name" in tc["function"]:
                    names.append(tc["function"]["name"])
                args += tc["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
        assert content == "Sure." and names == ["get_weather"]
        assert json.loads(args) == {"city": "Paris"} and finish == "tool_calls"

        # tool_choice "none": tools are not offered and nothing is parsed.
        r = c.post(CHAT, json=chat_body(tools=WEATHER, tool_choice="none"))
        assert r.json()["choices"][0]["message"]["content"] == CALL_TEXT
        # A forced call needs the engine's grammar compiler, which the fake lacks.
        r = c.post(CHAT, json=chat_body(tools=WEATHER, tool_choice="required"))
        assert_error(r, 400, param="tool_choice")


def test_metrics_observe_finished_and_rejections() -> None:
    engine = FakeEngine()
    with make_client(engine) as c:
        assert c.post(CHAT, json=chat_body(max_tokens=3)).status_code == 200
        engine.fail_first = rejected()
        assert c.post(CHAT, json=chat_body()).status_code == 429
        text = c.get("/metrics").text
    success = [
        ln
        for ln in text.splitlines()
        if ln.startswith("vllm:request_success_total") and 'finished_reason="length"' in ln
    ]
    assert success and float(success[0].rsplit(" ", 1)[1]) == 1.0
    assert any(
        ln.startswith("fuel:admission_rejections_total")
        and "queue_full" in ln
        and ln.endswith(" 1.0")
        for ln in text.splitlines()
    )


def test_fake_engine_implements_the_client_protocol() -> None:
    from engine.client import EngineClient

    assert isinstance(FakeEngine(), EngineClient)
    assert not isinstance(object(), EngineClient)
