"""The HTTP app on a real engine over a tiny random checkpoint (fast, exact).

Expected values come from an independent reference: transformers on the same
weights (greedy tokens, logprobs of every token), OpenAI's published schema
(every response), and what the model generated (the raw text of the sampled
tokens, from logprobs) for tool calls, so a test tells the grammar stopping
from the server truncating. The fake engine (tests/server_fakes.py) is kept
only for faults a real engine cannot produce on demand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient

from engine.client import EngineClient
from server.app import build_app
from server.config import ServerConfig
from server.tool_parsers import get_tool_parser
from tests.real_engine import Reference, SharedEngine
from tests.server_fakes import OPENAPI_PATH, assert_completion_schema, assert_schema

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
TOL = 2e-4  # logprobs: float32 engine vs float32 transformers, different kernels


@pytest.fixture(scope="module")
def model_dir(tiny_server_dir: Path) -> Path:
    return tiny_server_dir


@pytest.fixture(scope="module")
def shared(tiny_server_engine: SharedEngine) -> SharedEngine:
    return tiny_server_engine


@pytest.fixture(scope="module")
def ref(model_dir: Path) -> Reference:
    return Reference(model_dir)


def app_client(engine: SharedEngine, **cfg: Any) -> TestClient:
    return TestClient(build_app(engine, ServerConfig(**cfg)))


@pytest.fixture(scope="module")
def client(shared: SharedEngine) -> Iterator[TestClient]:
    with app_client(shared) as c:
        yield c


def sse(raw: str) -> list[Any]:
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    out = [json.loads(b[len("data: ") :]) for b in raw.split("\n\n")[:-2]]
    assert all("error" not in e for e in out), out
    return out


def chat_prompt_ids(client: TestClient, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    r = client.post("/tokenize", json={"messages": messages, **kw})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_async_engine_is_an_engine_client(shared: SharedEngine) -> None:
    assert isinstance(shared.inner, EngineClient)
    assert isinstance(shared, EngineClient)


# --------------------------------------------------------------- exact numbers


def test_completion_tokens_and_logprobs_match_transformers(
    client: TestClient, shared: SharedEngine, ref: Reference
) -> None:
    prompt = [1, 504, 3458, 314, 260, 2369, 28, 6601]
    n = 6
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "ignore_eos": True,
    }
    r = client.post(COMP, json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert_completion_schema(answer)
    generated = ref.greedy(prompt, n)
    ids = prompt + generated
    lp = answer["choices"][0]["logprobs"]
    tok = shared.tokenizer
    assert lp["tokens"] == [tok.token_to_text(i) for i in ids]
    dist = ref.log_softmax(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for pos in range(1, len(ids)):
        want = float(dist[pos - 1, ids[pos]])
        assert abs(lp["token_logprobs"][pos] - want) < TOL, (pos, lp["token_logprobs"][pos], want)
        top = dist[pos - 1].topk(2)
        expected_top = {
            tok.token_to_text(int(i)): float(v) for v, i in zip(top.values, top.indices)
        }
        got_top = lp["top_logprobs"][pos]
        assert set(got_top) == set(expected_top), pos
        for key, value in expected_top.items():
            assert abs(got_top[key] - value) < TOL
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert answer["usage"]["completion_tokens"] == n
    assert answer["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs_and_prompt_logprobs_match_transformers(
    client: TestClient, shared: SharedEngine, ref: Reference
) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = chat_prompt_ids(client, messages)
    n = 5
    r = client.post(
        CHAT,
        json={
            "messages": messages,
            "max_tokens": n,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 1,
            "prompt_logprobs": 1,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert_schema(answer, "CreateChatCompletionResponse")
    generated = ref.greedy(prompt, n)
    ids = prompt + generated
    dist = ref.log_softmax(ids)
    content = answer["choices"][0]["logprobs"]["content"]
    tok = shared.tokenizer
    assert [e["bytes"] for e in content] == [tok.token_bytes(i) for i in generated]
    for k, entry in enumerate(content):
        pos = len(prompt) + k
        assert abs(entry["logprob"] - float(dist[pos - 1, ids[pos]])) < TOL
    # vLLM's prompt_logprobs: None for the first token, then {id: {logprob, rank, ...}}.
    plp = answer["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        entry = plp[pos][str(prompt[pos])]
        assert abs(entry["logprob"] - float(dist[pos - 1, prompt[pos]])) < TOL
        best = int(dist[pos - 1].argmax())
        assert plp[pos][str(best)]["rank"] == 1


def test_stream_equals_answer_and_follows_the_schema(client: TestClient) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "n": 2, "ignore_eos": True}
    answer = client.post(CHAT, json=body).json()
    assert_schema(answer, "CreateChatCompletionResponse")
    with client.stream(
        "POST", CHAT, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        events = sse("".join(r.iter_text()))
    texts = {0: "", 1: ""}
    for ev in events:
        assert_schema(ev, "CreateChatCompletionStreamResponse")
        for ch in ev["choices"]:
            texts[ch["index"]] += ch["delta"].get("content") or ""
    want = [c["message"]["content"] for c in answer["choices"]]
    assert [texts[0], texts[1]] == want and want[0] == want[1]
    # The same usage, except that the streamed request (sent second) may find more
    # of its prompt cached: a partial hit on the block the first answer filled.
    usage, first = dict(events[-1]["usage"]), dict(answer["usage"])
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert cached >= first.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == first and cached < usage["prompt_tokens"]

    comp = {"prompt": "Once upon", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    whole = client.post(COMP, json=comp).json()
    assert_completion_schema(whole)
    with client.stream(
        "POST", COMP, json={**comp, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        chunks = sse("".join(r.iter_text()))
    for ev in chunks:
        assert_completion_schema(ev)
        assert ("usage" in ev) == (ev is chunks[-1])  # only the usage chunk has the key
    assert "".join(c["text"] for ev in chunks for c in ev["choices"]) == whole["choices"][0]["text"]


# ------------------------------------------------------------------ tool calls

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": CITY}},
]
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _generated(answer: dict[str, Any]) -> str:
    """The raw text of every sampled token (from logprobs): what the model generated.

    A final end-of-turn token (``<|im_end|>``) is the grammar letting the turn end.
    """
    content = answer["choices"][0]["logprobs"]["content"]
    raw = bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace")
    return raw.removesuffix("<|im_end|>")


def _parsed_raw(answer: dict[str, Any], parser: str = "hermes") -> list[tuple[str, str]]:
    """The calls in the raw generated text; it holds nothing else (no content, no half call)."""
    parsed = get_tool_parser(parser, TOOLS).parse(_generated(answer))
    assert not (parsed.content or "").strip(), parsed.content
    return [(t.name, t.arguments) for t in parsed.tool_calls]


def _returned(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _forced(client: TestClient, choice: Any, **kw: Any) -> dict[str, Any]:
    body = {
        "messages": WEATHER_Q,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 230,
        "temperature": 1.0,
        "logprobs": True,
        **kw,
    }
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    assert_schema(answer, "CreateChatCompletionResponse")
    return answer


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_one_or_more_calls_then_the_turn_ends(client: TestClient, seed: int) -> None:
    answer = _forced(client, "required", seed=seed)
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert 1 <= len(calls) <= 8 and choice["message"]["content"] is None
    # The model generated exactly these calls and then ended the turn: nothing was cut.
    assert _parsed_raw(answer) == _returned(calls)
    assert answer["choices"][0]["logprobs"]["content"][-1]["token"] == "<|im_end|>"
    for c in calls:
        assert json.loads(c["function"]["arguments"])["city"] in ("Paris", "Oslo", "Rome")


@pytest.mark.parametrize(
    "choice",
    [{"type": "function", "function": {"name": "get_time"}}, "required"],
    ids=["named", "required-not-parallel"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_exactly_one_call_is_the_grammars_doing(
    client: TestClient, choice: Any, stream: bool
) -> None:
    answer = _forced(client, choice, seed=7, parallel_tool_calls=False)
    (call,) = answer["choices"][0]["message"]["tool_calls"]
    # The model generated exactly one block: the grammar stopped it, nothing was dropped.
    assert _parsed_raw(answer) == _returned([call])
    if isinstance(choice, dict):
        assert call["function"]["name"] == "get_time"
    if stream:
        assert _streamed_calls(client, choice, seed=7) == _returned([call])


def _streamed_calls(client: TestClient, choice: Any, seed: int) -> list[tuple[str, str]]:
    """The same forced request streamed: the calls its deltas assemble to (no content)."""
    body = {
        "messages": WEATHER_Q,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
        "max_tokens": 230,
        "seed": seed,
        "stream": True,
    }
    with client.stream("POST", CHAT, json=body) as r:
        events = sse("".join(r.iter_text()))
    calls: list[list[str]] = []
    content, finish = "", None
    for ev in events:
        assert_schema(ev, "CreateChatCompletionStreamResponse")
        for ch in ev["choices"]:
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or []:
                if "name" in tc["function"]:
                    calls.append([tc["function"]["name"], ""])
                calls[tc["index"]][1] += tc["function"].get("arguments", "")
            finish = ch["finish_reason"] or finish
    assert content == "" and finish == "tool_calls"
    return [(name, args) for name, args in calls]


def test_forced_call_cut_by_max_tokens_says_length_without_half_a_call(
    client: TestClient,
) -> None:
    answer = _forced(
        client, {"type": "function", "function": {"name": "get_weather"}}, seed=3, max_tokens=6
    )
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] is None and "tool_calls" not in choice["message"]
    assert _generated(answer).startswith("<tool_call")  # it was cut inside the call


@pytest.mark.parametrize("parser", ["llama3_json", "mistral"])
def test_every_parser_supports_forced_calls(shared: SharedEngine, parser: str) -> None:
    with app_client(shared, tool_call_parser=parser) as c:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            answer = _forced(c, choice, seed=11, parallel_tool_calls=False)
            ch = answer["choices"][0]
            assert ch["finish_reason"] == "tool_calls", ch
            (call,) = ch["message"]["tool_calls"]
            assert _parsed_raw(answer, parser) == _returned([call])
            assert _streamed_calls(c, choice, seed=11) == _returned([call])


def test_auto_tool_choice_on_by_default(client: TestClient) -> None:
    """No flags: the default template's format is known (hermes), so auto is accepted."""
    r = client.post(CHAT, json={"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 8, "seed": 1})
    assert r.status_code == 200, r.text
    with app_client(shared_engine_of(client), enable_auto_tool_choice=False) as c:
        r = c.post(CHAT, json={"messages": WEATHER_Q, "tools": TOOLS, "max_tokens": 8})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def shared_engine_of(client: TestClient) -> SharedEngine:
    engine = client.app.state.fuel.engine  # type: ignore[attr-defined]
    assert isinstance(engine, SharedEngine)
    return engine


# ------------------------------------------------ every request field, decided


def _request_fields(schema_name: str) -> dict[str, Any]:
    with OPENAPI_PATH.open() as f:
        schemas = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["components"][
            "schemas"
        ]

    def walk(node: dict[str, Any], out: dict[str, Any]) -> None:
        if "$ref" in node:
            walk(schemas[node["$ref"].rsplit("/", 1)[-1]], out)
        for part in node.get("allOf", []):
            walk(part, out)
        out.update(node.get("properties", {}))

    fields: dict[str, Any] = {}
    walk(schemas[schema_name], fields)
    return fields


# What a client sends to use each field this server honours (with what it needs).
HONOURED: dict[str, dict[str, Any]] = {
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"50": 1.0}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 2},
    "max_tokens": {"max_tokens": 2},
    "messages": {"messages": WEATHER_Q},
    "model": {},  # the served name is the default
    "n": {"n": 2},
    "parallel_tool_calls": {"parallel_tool_calls": False, "tools": TOOLS},
    "presence_penalty": {"presence_penalty": 0.5},
    "response_format": {"response_format": {"type": "json_object"}},
    "seed": {"seed": 3},
    "stop": {"stop": ["\n\n"]},
    "stream": {"stream": False},
    "stream_options": {},  # needs stream: true (covered by the streaming tests)
    "temperature": {"temperature": 0.5},
    "tool_choice": {"tool_choice": "none", "tools": TOOLS},
    "tools": {"tools": TOOLS, "tool_choice": "none"},
    "top_logprobs": {"top_logprobs": 2, "logprobs": True},
    "top_p": {"top_p": 0.9},
    "user": {"user": "u-1"},
    "best_of": {"best_of": 1},
    "echo": {"echo": True},
    "prompt": {"prompt": "Hello"},
    "suffix": {},  # only null is accepted (no model here supports insertion)
}
# Fields OpenAI has and this server refuses (a 400 naming the field), with a sample value.
REFUSED_SAMPLE: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "function_call": "auto",
    "functions": [{"name": "f"}],
    "metadata": {"k": "v"},
    "modalities": ["text"],
    "moderation": {"type": "x"},
    "prediction": {"type": "content", "content": "x"},
    "prompt_cache_key": "k",
    "prompt_cache_options": {},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "safety_identifier": "s",
    "service_tier": "auto",
    "store": True,
    "verbosity": "low",
    "web_search_options": {},
}


@pytest.mark.parametrize(
    ("schema_name", "path", "base"),
    [
        ("CreateChatCompletionRequest", CHAT, {"messages": WEATHER_Q, "max_tokens": 2}),
        ("CreateCompletionRequest", COMP, {"prompt": "Hello", "max_tokens": 2}),
    ],
)
def test_every_request_field_is_honoured_or_refused_by_name(
    client: TestClient, schema_name: str, path: str, base: dict[str, Any]
) -> None:
    fields = _request_fields(schema_name)  # read from the document, not a copy
    assert fields
    for name in fields:
        if name in HONOURED:
            body = {**base, **HONOURED[name]}
            if path == COMP and name == "logprobs":
                body[name] = 2
            r = client.post(path, json=body)
            assert r.status_code == 200, (name, r.text)
        else:
            assert name in REFUSED_SAMPLE, f"{name}: decide whether it is honoured or refused"
            r = client.post(path, json={**base, name: REFUSED_SAMPLE[name]})
            assert r.status_code == 400, (name, r.text)
            err = r.json()["error"]
            assert err["param"] == name and name in err["message"], (name, err)


def test_the_schema_copy_is_the_published_document() -> None:
    """tests/data's copy must be OpenAI's document as shared (when shared/ is beside us)."""
    copy = Path(__file__).parent / "data" / "openai_openapi.yaml"
    shared_doc = Path(__file__).resolve().parents[2] / "shared" / "openai" / "openapi.yaml"
    if not shared_doc.exists():
        pytest.skip("shared/openai/openapi.yaml is not beside this checkout")
    assert copy.read_bytes() == shared_doc.read_bytes()
