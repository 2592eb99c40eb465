"""The extension fields routers add, and the endpoints they poll (fast, fake engine).

vllm-router re-serialises every body with SGLang-style fields at their neutral
values; tests/test_scaleout_e2e.py sends real requests through the real router.
Here each rule is pinned field by field: a neutral value changes nothing, a
non-neutral value is honoured (``no_stop_trim``, ``continue_final_message``,
``separate_reasoning``/``stream_reasoning`` with no reasoning parser) or refused
with a 400 naming the field (``return_hidden_states``, ``include_reasoning``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from tests.server_fakes import FakeEngine, FakeTokenizer, assert_schema

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
CHAT_NEUTRAL = {
    "no_stop_trim": False,
    "continue_final_message": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "include_reasoning": True,
    "return_hidden_states": False,
    "logprobs": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
}
COMP_NEUTRAL = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(reply="Hello world")


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(build_app(engine, ServerConfig())) as c:
        yield c


def post(client: TestClient, path: str, body: dict[str, Any]) -> Any:
    r = client.post(path, json={"model": "fake-model", "max_tokens": 4, **body})
    return r


def assert_400(r: Any, param: str, contains: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert_schema(r.json(), "ErrorResponse")
    assert err["param"] == param, err
    assert param in err["message"] and contains in err["message"], err


def test_neutral_values_change_nothing(client: TestClient, engine: FakeEngine) -> None:
    for path, base, neutral in (
        (CHAT, {"messages": MESSAGES}, CHAT_NEUTRAL),
        (COMP, {"prompt": "hi"}, COMP_NEUTRAL),
    ):
        plain = post(client, path, base)
        routed = post(client, path, {**base, **neutral})
        assert plain.status_code == routed.status_code == 200, routed.text
        a, b = engine.calls[-2], engine.calls[-1]
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.params == b.params and a.kwargs == b.kwargs
        assert plain.json()["choices"] == routed.json()["choices"]


def test_no_stop_trim_is_include_stop_str_in_output(client: TestClient, engine: FakeEngine) -> None:
    # The fake replies "Hello world": stop at "o w" with and without the stop string.
    for path, base in ((CHAT, {"messages": MESSAGES}), (COMP, {"prompt": "hi"})):
        trimmed = post(client, path, {**base, "stop": ["o w"], "max_tokens": 20})
        kept = post(client, path, {**base, "stop": ["o w"], "max_tokens": 20, "no_stop_trim": True})
        assert engine.calls[-1].params.include_stop_str_in_output
        assert not engine.calls[-2].params.include_stop_str_in_output
        assert trimmed.status_code == kept.status_code == 200


@pytest.mark.parametrize(
    ("path", "field", "value", "contains"),
    [
        (CHAT, "return_hidden_states", True, "hidden states"),
        (COMP, "return_hidden_states", True, "hidden states"),
        (CHAT, "include_reasoning", False, "reasoning"),
    ],
)
def test_unhonourable_values_are_refused_by_name(
    client: TestClient, engine: FakeEngine, path: str, field: str, value: bool, contains: str
) -> None:
    base = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    assert_400(post(client, path, {**base, field: value}), field, contains)
    assert engine.calls == []


def test_reasoning_presentation_flags_without_a_parser(
    client: TestClient, engine: FakeEngine
) -> None:
    """No reasoning parser: nothing is split out, so both values are what we do."""
    neutral = post(client, CHAT, {"messages": MESSAGES})
    other = post(
        client, CHAT, {"messages": MESSAGES, "separate_reasoning": False, "stream_reasoning": False}
    )
    assert neutral.status_code == other.status_code == 200
    assert engine.calls[-1].params == engine.calls[-2].params
    message = other.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "Hell"


CONTINUED = [
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello, my name"},
]


def test_continue_final_message(client: TestClient, engine: FakeEngine) -> None:
    tok = FakeTokenizer()
    r = post(
        client,
        CHAT,
        {"messages": CONTINUED, "continue_final_message": True, "add_generation_prompt": False},
    )
    assert r.status_code == 200, r.text
    # The final message stays open: no end of turn after it, no new assistant prompt.
    assert engine.calls[-1].prompt_token_ids == tok.encode(
        "user:Say hello.\nassistant:Hello, my name"
    )
    assert r.json()["choices"][0]["message"]["content"] == "Hell"
    # echo puts the continued message in front of the continuation, as vLLM does.
    r = post(
        client,
        CHAT,
        {
            "messages": CONTINUED,
            "continue_final_message": True,
            "add_generation_prompt": False,
            "echo": True,
        },
    )
    assert r.json()["choices"][0]["message"]["content"] == "Hello, my nameHell"
    # Without it, the same messages end the turn and open a new one.
    post(client, CHAT, {"messages": CONTINUED})
    assert engine.calls[-1].prompt_token_ids == tok.encode(
        "user:Say hello.\nassistant:Hello, my name\nassistant:"
    )


@pytest.mark.parametrize(
    ("body", "contains"),
    [
        ({"messages": CONTINUED, "continue_final_message": True}, "add_generation_prompt"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            "assistant",
        ),
        (
            {
                "messages": [*CONTINUED[:1], {"role": "assistant", "content": "  "}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            "content",
        ),
    ],
)
def test_continue_final_message_misuse(
    client: TestClient, engine: FakeEngine, body: dict[str, Any], contains: str
) -> None:
    r = post(client, CHAT, body)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "continue_final_message" in msg and contains in msg
    assert engine.calls == []


def test_tokenize_takes_the_routers_body(client: TestClient) -> None:
    """The cache-aware policy's fallback: POST /tokenize with continue_final_message."""
    tok = FakeTokenizer()
    plain = client.post("/tokenize", json={"model": "fake-model", "messages": MESSAGES})
    routed = client.post(
        "/tokenize",
        json={"model": "fake-model", "continue_final_message": False, "messages": MESSAGES},
    )
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["tokens"] == plain.json()["tokens"] == tok.encode("user:hi\nassistant:")
    cont = client.post(
        "/tokenize",
        json={
            "messages": CONTINUED,
            "continue_final_message": True,
            "add_generation_prompt": False,
        },
    )
    assert cont.json()["tokens"] == tok.encode("user:Say hello.\nassistant:Hello, my name")
    bad = client.post("/tokenize", json={"prompt": "hi", "continue_final_message": True})
    assert bad.status_code == 400 and "continue_final_message" in bad.json()["error"]["message"]


def test_get_load_counts_requests_and_needs_no_key(engine: FakeEngine) -> None:
    with TestClient(build_app(engine, ServerConfig(api_key="k"))) as c:
        r = c.get("/get_load")
        assert r.status_code == 200
        assert r.json() == {
            "load": 0,
            "num_requests_running": 0,
            "num_requests_waiting": 0,
            "kv_cache_usage_perc": 0.0,
        }
        engine.running.update({"a", "b"})  # two requests the engine holds
        assert c.get("/get_load").json()["load"] == 2
        # Everything else still needs the key.
        assert c.post("/tokenize", json={"prompt": "hi"}).status_code == 401


def test_get_load_while_loading() -> None:
    started: list[int] = []

    def never() -> FakeEngine:
        started.append(1)
        raise RuntimeError("no model")

    with TestClient(build_app(None, ServerConfig(), engine_factory=never)) as c:
        r = c.get("/get_load")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert_schema(r.json(), "ErrorResponse")


def test_an_answer_sent_back_as_it_came_is_accepted(client: TestClient) -> None:
    """Clients append the assistant message they got (with ``refusal: null``)."""
    first = post(client, CHAT, {"messages": MESSAGES}).json()["choices"][0]["message"]
    assert first["refusal"] is None
    r = post(client, CHAT, {"messages": [*MESSAGES, first, {"role": "user", "content": "more"}]})
    assert r.status_code == 200, r.text
    bad = {**first, "refusal": "I cannot"}
    r = post(client, CHAT, {"messages": [*MESSAGES, bad, {"role": "user", "content": "more"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.1.refusal", r.text
