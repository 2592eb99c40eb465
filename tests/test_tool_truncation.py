"""Tool calls cut off by ``max_tokens``: the decided behaviour, parser and HTTP level.

Decision (OpenAI semantics, issue 22): an incomplete call is no call and the choice
finishes with ``"length"``, never ``"tool_calls"``; its raw markup is not content
either (streamed or not). Calls whose block was complete before the cut stand as
``tool_calls``: the streaming path has already sent them when the cut happens, and
both paths give the same message. Text before the cut-off block stays content.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from server.tool_parsers import HermesToolParser, sequential_ids
from tests.server_fakes import FakeEngine

CHAT = "/v1/chat/completions"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}},
        },
    },
]
FIRST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SECOND = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
TWO_CALLS = FIRST + "\n" + SECOND


def test_parser_unclosed_end_tag_is_content() -> None:
    text = FIRST[:-1]  # ends in "</tool_call": the block never closed
    parsed = HermesToolParser(TOOLS).parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


@pytest.mark.parametrize("cut", [1, 5, 20, len(SECOND) - 1])
def test_parser_complete_call_stands_cut_call_is_content(cut: int) -> None:
    text = FIRST + "\n" + SECOND[:cut]
    parser = HermesToolParser(TOOLS, id_generator=sequential_ids())
    parsed = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parsed.content == "\n" + SECOND[:cut]
    # Streaming token by token gives the same message.
    stream = parser.stream(sequential_ids())
    deltas = [stream.feed(ch) for ch in text] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    names = [c.name for d in deltas for c in d.tool_calls if c.name]
    assert content == parsed.content and names == ["get_weather"]


def _client(reply: str) -> TestClient:
    engine = FakeEngine(reply=reply, max_model_len=1024)
    config = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    return TestClient(build_app(engine, config))


def _body(max_tokens: int, **kw: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "weather and time?"}],
        "tools": TOOLS,
        "max_tokens": max_tokens,
        **kw,
    }


def _stream(c: TestClient, body: dict[str, Any]) -> tuple[str, list[tuple[str, str]], str]:
    content, calls, finish = "", [], ""
    with c.stream("POST", CHAT, json={**body, "stream": True}) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                content += ch["delta"].get("content") or ""
                for tc in ch["delta"].get("tool_calls", []):
                    if tc["function"].get("name"):
                        calls.append((tc["function"]["name"], ""))
                    name, args = calls[tc["index"]]
                    calls[tc["index"]] = (name, args + tc["function"].get("arguments", ""))
                finish = ch["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize(
    ("max_tokens", "n_calls"),
    [(len(FIRST) - 1, 0), (len(FIRST) + 12, 1), (len(TWO_CALLS) - 1, 1)],
    ids=["single-unclosed", "second-cut-early", "second-unclosed"],
)
def test_http_cut_off_call_finishes_length(max_tokens: int, n_calls: int) -> None:
    # The fake engine emits one character per token, so max_tokens cuts the text.
    expected_text = TWO_CALLS[:max_tokens]
    with _client(TWO_CALLS) as c:
        choice = c.post(CHAT, json=_body(max_tokens)).json()["choices"][0]
        assert choice["finish_reason"] == "length"
        message = choice["message"]
        calls = message.get("tool_calls") or []
        assert [call["function"]["name"] for call in calls] == ["get_weather"][:n_calls]
        for call in calls:
            assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        # The cut-off block (and the separator before it) is neither a call nor content.
        assert message["content"] is None
        assert "get_time" not in [call["function"]["name"] for call in calls]
        assert len(expected_text) == max_tokens  # what was generated, one char per token

        content, streamed, finish = _stream(c, _body(max_tokens))
        assert finish == "length" and content == ""
        assert [(n, json.loads(a)) for n, a in streamed] == [
            (call["function"]["name"], json.loads(call["function"]["arguments"])) for call in calls
        ]


def test_http_complete_calls_finish_tool_calls() -> None:
    with _client(TWO_CALLS) as c:
        choice = c.post(CHAT, json=_body(len(TWO_CALLS) + 5)).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        assert [t["function"]["name"] for t in choice["message"]["tool_calls"]] == [
            "get_weather",
            "get_time",
        ]


def test_http_parallel_tool_calls_false_returns_the_first_call_under_auto() -> None:
    """``auto`` has no grammar, so two generated calls become one returned call,
    streamed or not; with the default (parallel allowed) both come back."""
    with _client(TWO_CALLS) as c:
        body = _body(len(TWO_CALLS) + 5, parallel_tool_calls=False)
        choice = c.post(CHAT, json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert [t["function"]["name"] for t in choice["message"]["tool_calls"]] == ["get_weather"]
        content, streamed, finish = _stream(c, body)
        assert finish == "tool_calls" and content == ""
        assert [(n, json.loads(a)) for n, a in streamed] == [("get_weather", {"city": "Paris"})]
        _, both, _ = _stream(c, _body(len(TWO_CALLS) + 5))
        assert [n for n, _ in both] == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    ("parameters", "needle"),
    [
        ({"type": "object", "required": 3}, "not a valid JSON Schema"),
        ({"type": "nonsense"}, "not a valid JSON Schema"),
        (["not", "an", "object"], "must be a JSON Schema object"),
    ],
)
def test_http_invalid_tool_schema_is_400(parameters: Any, needle: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with _client("hi") as c:
        for choice in ("auto", "none"):
            r = c.post(CHAT, json=_body(5, tools=tools, tool_choice=choice))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert needle in err["message"] and err["param"] == "tools.0.function.parameters"
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_invalid_arguments_returned_and_logged(
    stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>'
    with _client(reply) as c, caplog.at_level("WARNING", logger="fuel_serve.server"):
        if stream:
            _, calls, finish = _stream(c, _body(200))
            assert calls == [("get_weather", '{"city":3}')]
        else:
            choice = c.post(CHAT, json=_body(200)).json()["choices"][0]
            finish = choice["finish_reason"]
            assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city":3}'
    assert finish == "tool_calls"
    warnings = [r.getMessage() for r in caplog.records if "does not validate" in r.getMessage()]
    assert len(warnings) == 1 and "3 is not of type 'string'" in warnings[0], warnings
