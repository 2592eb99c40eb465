"""Unit tests of the HTTP app against a scripted fake engine (fast, no model)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from tests.server_fakes import FakeEngine, assert_schema, invalid, rejected, unavailable

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def make_client(engine: FakeEngine | None = None, **cfg: Any) -> TestClient:
    return TestClient(build_app(engine or FakeEngine(), ServerConfig(**cfg)))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with make_client(engine) as c:
        yield c


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **kw}


def assert_error(
    resp: Any, status: int, *, contains: str = "", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert_schema(body, "ErrorResponse")
    err = body["error"]
    assert contains.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_healthy(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    r = client.post(CHAT, json=chat_body(max_tokens=2))
    assert r.status_code == 200, r.text


def sse_events(raw: str) -> list[Any]:
    """Split raw SSE text strictly: every event is ``data: ...\\n\\n``."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


# ------------------------------------------------------------------ happy paths


def test_models_and_health(client: TestClient) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert_schema(body, "ListModelsResponse")
    assert body["data"][0]["id"] == "fake-model"
    assert body["data"][0]["max_model_len"] == 128
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/metrics").status_code == 200


def test_served_model_name_override(engine: FakeEngine) -> None:
    with make_client(engine, served_model_name=["alias", "other"]) as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["alias", "other"]
        assert c.post(CHAT, json=chat_body(model="other")).json()["model"] == "other"
        assert_error(c.post(CHAT, json=chat_body()), 404, code="model_not_found")


def test_chat_completion(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(CHAT, json=chat_body(n=2, temperature=0.5, seed=7, stop=["zz"], top_k=5))
    assert r.status_code == 200, r.text
    body = r.json()
    assert_schema(body, "CreateChatCompletionResponse")
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["content"] == "Hello world" for c in body["choices"])
    assert body["choices"][0]["finish_reason"] == "stop"
    prompt_len = len("user:hi\nassistant:")
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "completion_tokens": 22,
        "total_tokens": prompt_len + 22,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    p = engine.calls[-1].params
    assert (p.n, p.temperature, p.seed, p.stop, p.top_k) == (2, 0.5, 7, ["zz"], 5)
    # No max_tokens: the room left in the window (vLLM's default).
    assert p.max_tokens == 128 - prompt_len


def test_chat_vllm_extensions_are_mapped(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(
        CHAT,
        json=chat_body(
            max_completion_tokens=5,
            max_tokens=50,
            min_p=0.1,
            repetition_penalty=1.1,
            min_tokens=1,
            ignore_eos=True,
            stop_token_ids=[5],
            skip_special_tokens=False,
            include_stop_str_in_output=True,
            priority=-3,
            cache_salt="s",
            latency_budget_ms=500,
            ttft_budget_ms=100,
            logit_bias={"50": 5.0},
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            user="u1",
            response_format={"type": "json_object"},
        ),
    )
    assert r.status_code == 200, r.text
    call = engine.calls[-1]
    p = call.params
    assert p.max_tokens == 5  # max_completion_tokens wins
    assert p.logit_bias == {50: 5.0} and p.stop_token_ids == [5] and p.ignore_eos
    assert p.structured is not None and p.structured.json_object
    assert call.kwargs == {
        "priority": -3,
        "cache_salt": "s",
        "latency_budget_ms": 500,
        "ttft_budget_ms": 100,
    }
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(client: TestClient) -> None:
    r = client.post(CHAT, json=chat_body(logprobs=True, top_logprobs=2, max_tokens=3))
    body = r.json()
    assert_schema(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["H", "e", "l"]
    assert content[0]["bytes"] == [72] and len(content[0]["top_logprobs"]) == 2


def test_chat_echo(client: TestClient) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    r = client.post(
        CHAT, json={"messages": msgs, "echo": True, "add_generation_prompt": False, "max_tokens": 2}
    )
    assert r.json()["choices"][0]["message"]["content"] == "Sure: He"


def test_chat_stream_framing(client: TestClient) -> None:
    body = chat_body(n=2, max_tokens=3, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", CHAT, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in r.headers  # a stream has no declared length
        raw = "".join(r.iter_text())
    events = sse_events(raw)
    for ev in events:
        assert_schema(ev, "CreateChatCompletionStreamResponse")
        assert "usage" in ev
    chunks, final = events[:-1], events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert all(ev["usage"] is None for ev in chunks)
    assert len({ev["id"] for ev in events}) == 1
    texts: dict[int, str] = {0: "", 1: ""}
    seen_role: set[int] = set()
    finishes: dict[int, str] = {}
    for ev in chunks:
        (choice,) = ev["choices"]
        i = choice["index"]
        if "role" in choice["delta"]:
            assert i not in seen_role and not texts[i]
            seen_role.add(i)
        else:
            assert i in seen_role  # role comes first
        assert i not in finishes  # nothing after a choice's finish
        texts[i] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[i] = choice["finish_reason"]
    assert texts == {0: "Hel", 1: "Hel"} and finishes == {0: "length", 1: "length"}


def test_stream_without_usage_has_no_usage_key(client: TestClient) -> None:
    with client.stream("POST", CHAT, json=chat_body(max_tokens=2, stream=True)) as r:
        events = sse_events("".join(r.iter_text()))
    assert all("usage" not in ev for ev in events)


def test_completions_prompt_kinds(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(COMP, json={"prompt": "abc", "max_tokens": 4})
    body = r.json()
    assert_schema(body, "CreateCompletionResponse")
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "Hell"
    assert body["usage"]["prompt_tokens"] == 3

    r = client.post(COMP, json={"prompt": [[20, 21], [22, 23, 24]], "n": 2, "max_tokens": 1})
    body = r.json()
    assert_schema(body, "CreateCompletionResponse")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4
    assert sorted(c.prompt_token_ids for c in engine.calls[-2:]) == [[20, 21], [22, 23, 24]]

    r = client.post(COMP, json={"prompt": ["a", "b"], "max_tokens": 1})
    assert [c["text"] for c in r.json()["choices"]] == ["H", "H"]
    r = client.post(COMP, json={"prompt": [20, 21], "max_tokens": 1})
    assert r.status_code == 200


def test_completions_echo_logprobs(client: TestClient) -> None:
    r = client.post(COMP, json={"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == "abHe"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "H", "e"]
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"][0] is None and lp["token_logprobs"][1:] == [-0.5, -0.5, -0.5]
    assert len(lp["top_logprobs"][2]) == 1


def test_completions_stream(client: TestClient) -> None:
    body = {
        "prompt": ["x", "y"],
        "n": 2,
        "max_tokens": 2,
        "stream": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", COMP, json=body) as r:
        events = sse_events("".join(r.iter_text()))
    texts: dict[int, str] = {}
    for ev in events[:-1]:
        # OpenAI streams finish_reason null until a choice ends (the SDK expects it), which
        # the shared response schema does not allow; check the rest of the shape.
        (choice,) = ev["choices"]
        # Likewise ``usage: null`` on every chunk with include_usage.
        assert ev["usage"] is None
        patched = {k: v for k, v in ev.items() if k != "usage"}
        patched["choices"] = [{**choice, "finish_reason": choice["finish_reason"] or "stop"}]
        assert_schema(patched, "CreateCompletionResponse")
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "He", 1: "He", 2: "He", 3: "He"}
    assert events[-1]["usage"]["completion_tokens"] == 8


def test_tokenize_detokenize(client: TestClient) -> None:
    r = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})
    assert r.json() == {
        "count": 2,
        "max_model_len": 128,
        "tokens": [107, 108],
        "token_strs": ["a", "b"],
    }
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "a"}]})
    assert r.json()["count"] == len("user:a\nassistant:")
    assert client.post("/detokenize", json={"tokens": [107, 108]}).json() == {"prompt": "ab"}
    assert_error(client.post("/detokenize", json={"tokens": [5000]}), 400, contains="out of range")
    assert_error(client.post("/tokenize", json={}), 400, contains="exactly one")


def test_request_id_echoed_and_prefixes_engine_id(client: TestClient, engine: FakeEngine) -> None:
    r = client.post(CHAT, json=chat_body(), headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert engine.calls[-1].request_id.startswith("abc-123")
    r = client.post(CHAT, json=chat_body(), headers={"X-Request-Id": "bad\tid"})
    assert r.headers["x-request-id"] != "bad\tid"
    assert client.get("/health").headers["x-request-id"]


# ----------------------------------------------------------------------- errors

BAD_BODIES: list[tuple[str, dict[str, Any], str, str | None]] = [
    (
        "unknown field",
        chat_body(frobnicate=1),
        "Unrecognized request argument supplied: frobnicate",
        "frobnicate",
    ),
    ("modalities", chat_body(modalities=["audio"]), "modalities", "modalities"),
    ("functions", chat_body(functions=[{"name": "f"}]), "functions", "functions"),
    (
        "image part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        },
        "image_url",
        None,
    ),
    ("empty messages", {"messages": []}, "messages", "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "role", "messages.0.role"),
    ("n too big", chat_body(n=17), "n", "n"),
    ("top_logprobs w/o logprobs", chat_body(top_logprobs=2), "requires logprobs", None),
    (
        "top_logprobs too big",
        chat_body(logprobs=True, top_logprobs=21),
        "top_logprobs",
        "top_logprobs",
    ),
    ("too many stops", chat_body(stop=[str(i) for i in range(17)]), "at most 16", "stop"),
    ("empty stop", chat_body(stop=[""]), "must not be empty", "stop"),
    (
        "logit_bias size",
        chat_body(logit_bias={str(i): 1.0 for i in range(301)}),
        "300",
        "logit_bias",
    ),
    ("logit_bias vocab", chat_body(logit_bias={"5000": 1.0}), "out of range", None),
    ("logit_bias key", chat_body(logit_bias={"abc": 1.0}), "token ids", "logit_bias"),
    ("temperature", chat_body(temperature=5), "temperature", "temperature"),
    ("max_tokens 0", chat_body(max_tokens=0), "max_tokens", "max_tokens"),
    (
        "stream_options w/o stream",
        chat_body(stream_options={"include_usage": True}),
        "stream",
        None,
    ),
    ("tool message w/o id", {"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id", None),
    (
        "tools auto w/o flag",
        chat_body(tools=[{"type": "function", "function": {"name": "f"}}]),
        "--enable-auto-tool-choice",
        "tool_choice",
    ),
    ("tool_choice w/o tools", chat_body(tool_choice="required"), "requires tools", "tool_choice"),
    ("bad tool", chat_body(tools=[{"type": "retrieval"}]), "function tools", "tools.0.type"),
    (
        "template kwargs",
        chat_body(chat_template_kwargs={"evil": 1}),
        "evil",
        "chat_template_kwargs",
    ),
    ("stop_token_ids vocab", chat_body(stop_token_ids=[99999]), "out of range", None),
]


@pytest.mark.parametrize(
    ("name", "body", "contains", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
def test_chat_invalid_bodies(
    client: TestClient, name: str, body: dict[str, Any], contains: str, param: str | None
) -> None:
    assert_error(client.post(CHAT, json=body), 400, contains=contains, param=param)
    assert_healthy(client)


BAD_COMPLETIONS: list[tuple[str, dict[str, Any], str]] = [
    ("empty prompt", {"prompt": ""}, "empty"),
    ("empty list", {"prompt": []}, "empty"),
    ("empty token list", {"prompt": [[1], []]}, "empty"),
    ("token out of vocab", {"prompt": [1, 99999]}, "out of range"),
    ("negative token", {"prompt": [-1]}, "out of range"),
    ("logprobs too big", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("suffix", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("missing prompt", {}, "prompt"),
]


@pytest.mark.parametrize(
    ("name", "body", "contains"), BAD_COMPLETIONS, ids=[b[0] for b in BAD_COMPLETIONS]
)
def test_completion_invalid_bodies(
    client: TestClient, name: str, body: dict[str, Any], contains: str
) -> None:
    assert_error(client.post(COMP, json=body), 400, contains=contains)
    assert_healthy(client)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_literals_rejected(client: TestClient, literal: str) -> None:
    raw = '{"messages": [{"role": "user", "content": "x"}], "temperature": ' + literal + "}"
    r = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, contains="finite", param="temperature")
    assert_healthy(client)


def test_invalid_json_and_non_object(client: TestClient) -> None:
    r = client.post(CHAT, content="{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, contains="not valid JSON")
    assert_error(client.post(CHAT, json=[1, 2]), 400, contains="JSON object")
    assert_healthy(client)


def test_context_length_exceeded(client: TestClient) -> None:
    long = "x" * 100
    r = client.post(
        CHAT, json=chat_body(messages=[{"role": "user", "content": long}], max_tokens=50)
    )
    n_prompt = len(f"user:{long}\nassistant:")
    err = assert_error(r, 400, code="context_length_exceeded")
    assert err["message"] == (
        f"This model's maximum context length is 128 tokens. However, you requested "
        f"{n_prompt + 50} tokens ({n_prompt} in the messages, 50 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    # Without max_tokens only a prompt that does not fit at all is rejected.
    r = client.post(COMP, json={"prompt": "x" * 128})
    err = assert_error(r, 400, code="context_length_exceeded", contains="128 in your prompt")
    assert client.post(COMP, json={"prompt": "x" * 127}).status_code == 200
    assert_healthy(client)


def test_unknown_model_and_route(client: TestClient) -> None:
    assert_error(
        client.post(CHAT, json=chat_body(model="gpt-9")),
        404,
        code="model_not_found",
        contains="gpt-9",
    )
    assert_error(client.get("/v1/nope"), 404, contains="/v1/nope")
    assert_error(client.get("/v1/models/nope"), 404, code="model_not_found")
    assert_error(client.get(CHAT), 405)
    assert_healthy(client)


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


def test_api_key(engine: FakeEngine) -> None:
    with make_client(engine, api_key="sekret") as c:
        assert_error(c.post(CHAT, json=chat_body()), 401, code="invalid_api_key")
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Basic sekret"}), 401)
        # No Host header or route trick gets around it.
        assert_error(c.get("/v1/models", headers={"Host": "localhost"}), 401)
        assert_error(c.get("/metrics"), 401)
        assert_error(c.get("/nope"), 401)
        assert c.get("/health").status_code == 200
        ok = c.post(CHAT, json=chat_body(), headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert engine.calls  # only the authorised request reached the engine
        assert len(engine.calls) == 1


def test_body_too_large(engine: FakeEngine) -> None:
    with make_client(engine, max_body_bytes=1000) as c:
        big = chat_body(messages=[{"role": "user", "content": "x" * 2000}])
        assert_error(c.post(CHAT, json=big), 413, code="request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: streamed body
            data = json.dumps(big).encode()
            for i in range(0, len(data), 100):
                yield data[i : i + 100]

        r = c.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        assert not engine.calls
        assert_healthy(c)


def test_draining_and_loading() -> None:
    engine = FakeEngine()
    app = build_app(engine, ServerConfig())
    with TestClient(app) as c:
        app.state.fuel.front.draining = True
        r = c.get("/health")
        assert r.status_code == 503
        r = c.post(CHAT, json=chat_body())
        assert_error(r, 503, contains="shutting down")
        assert r.headers["retry-after"]
        app.state.fuel.front.draining = False
        assert_healthy(c)
    assert engine.stopped


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


def test_debug_endpoint_only_with_flag(engine: FakeEngine) -> None:
    with make_client(engine) as c:
        assert c.get("/debug/engine").status_code == 404
    with make_client(engine, enable_debug_endpoints=True) as c:
        body = c.get("/debug/engine").json()
        assert body["num_running"] == 0 and body["num_free_blocks"] == 10


# ------------------------------------------------------------------ disconnects


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
