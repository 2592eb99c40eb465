"""No request body yields a 5xx: hypothesis posts generated bodies to the app (real engine).

Bodies mix well-formed and hostile values for every field the APIs take:
deeply nested and recursive schemas (tools, ``response_format``), huge enums,
pathological ``pattern``s, huge and tiny numbers, strings with lone surrogates
and control characters. Every answer is a 2xx that follows OpenAI's schema, or
a 4xx in OpenAI's error envelope; and the server stays healthy after each.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from server.app import build_app
from server.config import ServerConfig
from tests.real_engine import SharedEngine
from tests.server_fakes import assert_completion_schema, assert_schema

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.fixture(scope="module")
def client(tiny_server_engine: SharedEngine) -> Iterator[TestClient]:
    app = build_app(tiny_server_engine, ServerConfig())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 2, 0.5, 1e-320, 1e308, -1e308, 2**63, 2**64]),
)
texts = st.one_of(
    st.text(max_size=20),
    st.text(alphabet=st.characters(codec=None, categories=["Cs", "Cc", "Co", "So"]), max_size=8),
    st.sampled_from(["", "<|im_end|>", "<tool_call>", "\ud800", "a\x00b", "🙂" * 5]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


schemas = st.one_of(
    json_values,
    st.sampled_from(
        [
            _nested(40),  # deeper ones are raw bodies below (hypothesis prints examples)
            _nested(11),
            {"type": "string", "enum": [f"v{i}" for i in range(20_000)]},
            {"type": "string", "pattern": "(a+)+$"},
            {"type": "string", "pattern": "a{1000000}"},
            {"type": "string", "pattern": "(["},
            {"type": "string", "maxLength": 10**12},
            {"$ref": "#"},
            {"type": "object", "properties": {"x": {"$ref": "#"}}},
            {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
            {"type": "integer", "minimum": 1e308, "maximum": -1e308},
            {"type": ["string", "null"], "const": "\ud800"},
            {"anyOf": [{"type": "number"}] * 200},
        ]
    ),
)
tool_lists = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "retrieval"])},
        optional={
            "function": st.fixed_dictionaries(
                {"name": st.one_of(st.sampled_from(["f", "get_weather"]), texts)},
                optional={"parameters": schemas, "description": texts, "strict": st.booleans()},
            )
        },
    ),
    max_size=3,
)
tool_choices = st.one_of(
    st.sampled_from(["auto", "none", "required", "any"]),
    st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": texts})}
    ),
    json_values,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "x"]),
            "content": st.one_of(texts, json_values),
        },
        optional={"tool_call_id": texts, "name": texts},
    ),
    max_size=3,
)
# max_tokens is always drawn (small, so that valid bodies answer fast); hostile values
# for it come from the raw-body cases and from ``max_completion_tokens``.
common = {
    "max_completion_tokens": st.one_of(numbers, json_values),
    "temperature": st.one_of(numbers, json_values),
    "top_p": numbers,
    "top_k": numbers,
    "min_p": numbers,
    "n": st.one_of(st.integers(1, 3), numbers),
    "seed": numbers,
    "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
    "stop_token_ids": st.lists(numbers, max_size=3),
    "logit_bias": st.dictionaries(st.one_of(texts, st.just("5")), numbers, max_size=3),
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "min_tokens": numbers,
    "priority": numbers,
    "latency_budget_ms": numbers,
    "ttft_budget_ms": numbers,
    "cache_salt": texts,
    "stream": st.booleans(),
    "stream_options": json_values,
    "prompt_logprobs": numbers,
    "response_format": st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries({"name": st.just("x"), "schema": schemas}),
            }
        ),
        json_values,
    ),
    "user": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": st.integers(1, 3)},
    optional={
        **common,
        "tools": tool_lists,
        "tool_choice": tool_choices,
        "parallel_tool_calls": json_values,
        "logprobs": json_values,
        "top_logprobs": numbers,
        "chat_template_kwargs": json_values,
        "echo": st.booleans(),
    },
)
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": st.one_of(texts, st.lists(numbers, max_size=4), json_values),
        "max_tokens": st.integers(1, 3),
    },
    optional={**common, "echo": st.booleans(), "logprobs": numbers, "suffix": json_values},
)


def _check(client: TestClient, path: str, body: Any) -> None:
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:500], json.dumps(body)[:500])
    if r.status_code >= 400:
        assert_schema(r.json(), "ErrorResponse")
    elif r.headers["content-type"].startswith("text/event-stream"):
        for block in r.text.split("\n\n")[:-2]:
            event = json.loads(block[len("data: ") :])
            assert "error" not in event or event["error"]["type"] != "server_error", event
    elif path == CHAT:
        assert_schema(r.json(), "CreateChatCompletionResponse")
    else:
        assert_completion_schema(r.json())


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@SETTINGS
@given(body=chat_bodies)
@example(body={"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2})
def test_chat_bodies_never_5xx(client: TestClient, body: dict[str, Any]) -> None:
    _check(client, CHAT, body)


@SETTINGS
@given(body=completion_bodies)
@example(body={"prompt": "\udfff x", "max_tokens": 1, "echo": True, "logprobs": 1})
def test_completion_bodies_never_5xx(client: TestClient, body: dict[str, Any]) -> None:
    _check(client, COMP, body)


@pytest.mark.parametrize(
    "raw",
    [
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
        '{"prompt": "hi", "max_tokens": 1, "temperature": 1e400}',
        '{"prompt": "hi", "max_tokens": 1, "logit_bias": {"1": -1e400}}',
        "[" * 100_000 + "]" * 100_000,
        '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}",
        '{"prompt": "\\ud800", "max_tokens": 1}',
        *(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "tools": [
                        {"type": "function", "function": {"name": "f", "parameters": _nested(300)}}
                    ],
                    "tool_choice": choice,
                }
            )
            for choice in ("required", "auto", "none")
        ),
    ],
)
def test_raw_bodies_never_5xx(client: TestClient, raw: str) -> None:
    r = client.post(CHAT if "messages" in raw else COMP, content=raw)
    assert r.status_code < 500, r.text[:300]
    assert client.get("/health").status_code == 200
