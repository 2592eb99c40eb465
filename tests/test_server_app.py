"""The HTTP app on a real engine over a tiny random checkpoint (fast): routes, mapping, errors.

One exact-mode engine (tests/real_engine.py) serves the module; it records
what the server asked of it, so the mapping from request fields to
``SamplingParams`` / ``RequestOptions`` is checked on the real path. Token
counts come from the tokenizer (``/tokenize``, or transformers' tokenizer as
the independent reference); exact tokens and logprobs against transformers
are in tests/test_server_real.py; faults a real engine cannot produce on
demand are in tests/test_server_faults.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from tests.real_engine import MAX_LEN, SharedEngine
from tests.server_fakes import assert_completion_schema, assert_error, assert_schema, sse_events

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
NAME = "tiny"


@pytest.fixture(scope="module")
def engine(tiny_server_engine: SharedEngine) -> SharedEngine:
    return tiny_server_engine


def make_client(engine: SharedEngine, **cfg: Any) -> TestClient:
    cfg.setdefault("served_model_name", [NAME])
    return TestClient(build_app(engine, ServerConfig(**cfg)))


@pytest.fixture(scope="module")
def client(engine: SharedEngine) -> Iterator[TestClient]:
    with make_client(engine) as c:
        yield c


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], **kw}


def assert_healthy(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    r = client.post(CHAT, json=chat_body(max_tokens=2))
    assert r.status_code == 200, r.text


def prompt_len(client: TestClient, messages: list[dict[str, Any]]) -> int:
    return int(client.post("/tokenize", json={"messages": messages}).json()["count"])


def hf_tokenizer(engine: SharedEngine) -> Any:
    """transformers' own tokenizer behind the engine's (the reference for token ids)."""
    return engine.inner.engine.tokenizer.hf_tokenizer


# ------------------------------------------------------------------ happy paths


def test_models_and_health(client: TestClient, engine: SharedEngine) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert_schema(body, "ListModelsResponse")
    assert [m["id"] for m in body["data"]] == [NAME]
    assert body["data"][0]["max_model_len"] == MAX_LEN
    # Our extension field (the Model schema allows extra properties): the execution path.
    assert body["data"][0]["fuel"] == dict(engine.execution_info)
    assert body["data"][0]["fuel"]["cpu_linear"] == "onednn"  # the exact test engine
    assert body["data"][0]["root"] == engine.model_name
    assert client.get(f"/v1/models/{NAME}").json()["id"] == NAME
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert "content-type" not in health.headers  # as /openapi.json declares it
    declared = client.get("/openapi.json").json()["paths"]["/health"]["get"]["responses"]
    assert "content" not in declared["200"] and "application/json" in declared["503"]["content"]
    assert client.get("/version").json() == {"version": "0.1.0"}
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text


def test_served_model_name_override(engine: SharedEngine) -> None:
    with make_client(engine, served_model_name=["alias", "other"]) as c:
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["alias", "other"]
        assert c.post(CHAT, json=chat_body(model="other", max_tokens=1)).json()["model"] == "other"
        assert_error(c.post(CHAT, json=chat_body()), 404, code="model_not_found")


def test_chat_completion(client: TestClient, engine: SharedEngine) -> None:
    body = chat_body(n=2, temperature=0, seed=7, stop=["zz"], top_k=5, max_tokens=4)
    r = client.post(CHAT, json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert_schema(answer, "CreateChatCompletionResponse")
    assert answer["id"].startswith("chatcmpl-") and answer["object"] == "chat.completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    # Greedy: both choices are the same four tokens, cut by max_tokens.
    assert answer["choices"][0]["message"] == answer["choices"][1]["message"]
    assert [c["finish_reason"] for c in answer["choices"]] == ["length", "length"]
    n_prompt = prompt_len(client, body["messages"])
    assert answer["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": 8,
        "total_tokens": n_prompt + 8,
        "prompt_tokens_details": {
            "cached_tokens": answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        },
    }
    prompt, p, _, _ = engine.calls[-1]
    assert len(prompt) == n_prompt
    assert (p.n, p.temperature, p.seed, p.stop, p.top_k, p.max_tokens) == (2, 0.0, 7, ["zz"], 5, 4)
    # Sent again, the prompt comes from the prefix cache: whole blocks of 4 tokens,
    # then a partial hit on the block the first answer filled, up to the last
    # prompt token (which is always computed).
    again = client.post(CHAT, json={**body, "ignore_eos": True}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt - 1
    assert again["choices"] == answer["choices"]
    # No max_tokens: the room left in the window (vLLM's default).
    client.post(CHAT, json=chat_body(temperature=0, stop_token_ids=[0]))
    assert engine.calls[-1][1].max_tokens == MAX_LEN - n_prompt


def test_chat_vllm_extensions_are_mapped(client: TestClient, engine: SharedEngine) -> None:
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
            latency_budget_ms=60_000,
            ttft_budget_ms=60_000,
            logit_bias={"50": 5.0},
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            user="u1",
            response_format={"type": "json_object"},
        ),
    )
    assert r.status_code == 200, r.text
    _, p, _, options = engine.calls[-1]
    assert p.max_tokens == 5  # max_completion_tokens wins
    assert p.logit_bias == {50: 5.0} and p.stop_token_ids == [5] and p.ignore_eos
    assert (p.min_p, p.repetition_penalty, p.min_tokens) == (0.1, 1.1, 1)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert not p.skip_special_tokens and p.include_stop_str_in_output
    assert p.structured is not None and p.structured.json_object
    assert options is not None
    assert (options.priority, options.cache_salt) == (-3, "s")
    assert (options.latency_budget_ms, options.ttft_budget_ms) == (60_000, 60_000)
    # json_object: a JSON object, unless max_tokens cut it first. With
    # include_stop_str_in_output and special tokens kept, the EOS text that
    # stopped it is part of the content (as vLLM does).
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        content = choice["message"]["content"].removesuffix("<|im_end|>")
        assert isinstance(json.loads(content), dict)


def test_chat_echo(client: TestClient) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: "}]
    body = {"messages": msgs, "echo": True, "add_generation_prompt": False, "max_tokens": 2}
    echoed = client.post(CHAT, json={**body, "temperature": 0}).json()
    plain = client.post(CHAT, json={**body, "temperature": 0, "echo": False}).json()
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == "Sure: " + text


def test_chat_stream_framing(client: TestClient) -> None:
    body = chat_body(
        n=2,
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
        stream=True,
        stream_options={"include_usage": True},
    )
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
    assert texts[0] == texts[1] and finishes == {0: "length", 1: "length"}
    whole = client.post(CHAT, json={**body, "stream": False, "stream_options": None}).json()
    assert whole["choices"][0]["message"]["content"] == texts[0]


def test_stream_without_usage_has_no_usage_key(client: TestClient) -> None:
    with client.stream("POST", CHAT, json=chat_body(max_tokens=2, stream=True)) as r:
        events = sse_events("".join(r.iter_text()))
    assert all("usage" not in ev for ev in events)


def test_completions_prompt_kinds(client: TestClient, engine: SharedEngine) -> None:
    hf = hf_tokenizer(engine)
    r = client.post(COMP, json={"prompt": "abc", "max_tokens": 4, "ignore_eos": True})
    body = r.json()
    assert_completion_schema(body)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    # Text prompts get the tokenizer's special tokens, as transformers adds them.
    assert engine.calls[-1][0] == hf("abc")["input_ids"]
    assert body["usage"]["prompt_tokens"] == len(hf("abc")["input_ids"])
    assert body["usage"]["completion_tokens"] == 4

    r = client.post(COMP, json={"prompt": [[20, 21], [22, 23, 24]], "n": 2, "max_tokens": 1})
    body = r.json()
    assert_completion_schema(body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4
    assert sorted(c[0] for c in engine.calls[-2:]) == [[20, 21], [22, 23, 24]]

    r = client.post(COMP, json={"prompt": ["a", "a"], "max_tokens": 2, "temperature": 0})
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 2 and texts[0] == texts[1]
    r = client.post(COMP, json={"prompt": [20, 21], "max_tokens": 1})
    assert r.status_code == 200 and engine.calls[-1][0] == [20, 21]


def test_completions_stream(client: TestClient) -> None:
    body = {
        "prompt": ["x", "y"],
        "n": 2,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", COMP, json=body) as r:
        events = sse_events("".join(r.iter_text()))
    texts: dict[int, str] = {}
    for ev in events[:-1]:
        # Validated as published: no usage key before the usage chunk (issue 22, defect 5);
        # the only deviation is OpenAI's own null finish_reason until a choice ends.
        assert "usage" not in ev
        assert_completion_schema(ev)
        (choice,) = ev["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert_completion_schema(events[-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    whole = client.post(COMP, json={**body, "stream": False, "stream_options": None}).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_tokenize_detokenize(client: TestClient, engine: SharedEngine) -> None:
    hf = hf_tokenizer(engine)
    ids = hf("ab cd", add_special_tokens=False)["input_ids"]
    r = client.post("/tokenize", json={"prompt": "ab cd", "add_special_tokens": False})
    assert r.json() == {
        "count": len(ids),
        "max_model_len": MAX_LEN,
        "tokens": ids,
        "token_strs": None,
    }
    strs = client.post("/tokenize", json={"prompt": "ab cd", "return_token_strs": True}).json()
    assert "".join(strs["token_strs"]) == hf.decode(strs["tokens"])
    msgs = [{"role": "user", "content": "a"}]
    want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if hasattr(want, "keys"):  # a BatchEncoding in recent transformers
        want = want["input_ids"]
    assert client.post("/tokenize", json={"messages": msgs}).json()["tokens"] == list(want)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": "ab cd"}
    assert_error(client.post("/detokenize", json={"tokens": [99999]}), 400, contains="out of range")
    assert_error(client.post("/tokenize", json={}), 400, contains="exactly one")


def test_request_id_echoed_and_prefixes_engine_id(client: TestClient, engine: SharedEngine) -> None:
    r = client.post(CHAT, json=chat_body(max_tokens=1), headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    assert engine.calls[-1][2].startswith("abc-123-")
    r = client.post(CHAT, json=chat_body(max_tokens=1), headers={"X-Request-Id": "bad\tid"})
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
    ("logit_bias vocab", chat_body(logit_bias={"99999": 1.0}), "out of range", None),
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
    ("tool_choice w/o tools", chat_body(tool_choice="required"), "requires tools", "tool_choice"),
    ("bad tool", chat_body(tools=[{"type": "retrieval"}]), "function tools", "tools.0.type"),
    (
        "template kwargs",
        chat_body(chat_template_kwargs={"evil": 1}),
        "evil",
        "chat_template_kwargs",
    ),
    ("stop_token_ids vocab", chat_body(stop_token_ids=[99999]), "out of range", None),
    (
        "prompt_logprobs streamed",
        chat_body(prompt_logprobs=1, stream=True),
        "not available when stream",
        "prompt_logprobs",
    ),
    (
        "lone surrogate",
        chat_body(messages=[{"role": "user", "content": "\ud800"}]),
        "valid Unicode",
        None,
    ),
    (
        "schema too deep",
        chat_body(
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": json.loads(
                            '{"type": "object", "properties": {"a": ' * 12
                            + '{"type": "string"}'
                            + "}}" * 12
                        ),
                    },
                }
            ]
        ),
        "nested deeper than 10 levels",
        "tools.0.function.parameters",
    ),
]


@pytest.mark.parametrize(
    ("name", "body", "contains", "param"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES]
)
def test_chat_invalid_bodies(
    client: TestClient, name: str, body: dict[str, Any], contains: str, param: str | None
) -> None:
    # json.dumps escapes what UTF-8 cannot carry (a lone surrogate travels as \\ud800).
    r = client.post(CHAT, content=json.dumps(body), headers={"content-type": "application/json"})
    assert_error(r, 400, contains=contains, param=param)
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


def test_context_length_exceeded(client: TestClient, engine: SharedEngine) -> None:
    messages = [{"role": "user", "content": "x " * 300}]
    n_prompt = prompt_len(client, messages)
    r = client.post(CHAT, json=chat_body(messages=messages, max_tokens=400))
    err = assert_error(r, 400, code="context_length_exceeded", param="messages")
    assert err["message"] == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{n_prompt + 400} tokens ({n_prompt} in the messages, 400 in the completion). "
        "Please reduce the length of the messages or completion."
    )
    # Without max_tokens only a prompt that does not fit at all is rejected.
    r = client.post(COMP, json={"prompt": [5] * MAX_LEN})
    assert_error(r, 400, code="context_length_exceeded", contains=f"{MAX_LEN} in your prompt")
    r = client.post(COMP, json={"prompt": [5] * (MAX_LEN - 1)})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
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


def test_api_key(engine: SharedEngine) -> None:
    with make_client(engine, api_key="sekret") as c:
        before = len(engine.calls)
        assert_error(c.post(CHAT, json=chat_body()), 401, code="invalid_api_key")
        assert_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(c.get("/v1/models", headers={"Authorization": "Basic sekret"}), 401)
        # No Host header or route trick gets around it.
        assert_error(c.get("/v1/models", headers={"Host": "localhost"}), 401)
        assert_error(c.get("/metrics"), 401)
        assert_error(c.get("/nope"), 401)
        assert c.get("/health").status_code == 200
        ok = c.post(CHAT, json=chat_body(max_tokens=1), headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert len(engine.calls) == before + 1  # only the authorised request reached it


def test_body_too_large(engine: SharedEngine) -> None:
    with make_client(engine, max_body_bytes=1000) as c:
        before = len(engine.calls)
        big = chat_body(messages=[{"role": "user", "content": "x" * 2000}])
        assert_error(c.post(CHAT, json=big), 413, code="request_too_large")

        def chunks() -> Iterator[bytes]:  # no Content-Length: streamed body
            data = json.dumps(big).encode()
            for i in range(0, len(data), 100):
                yield data[i : i + 100]

        r = c.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
        assert_error(r, 413, code="request_too_large")
        assert len(engine.calls) == before
        assert_healthy(c)


def test_draining(engine: SharedEngine) -> None:
    app = build_app(engine, ServerConfig(served_model_name=[NAME]))
    with TestClient(app) as c:
        app.state.fuel.front.draining = True
        assert c.get("/health").status_code == 503
        r = c.post(CHAT, json=chat_body())
        assert_error(r, 503, contains="shutting down")
        assert r.headers["retry-after"]
        app.state.fuel.front.draining = False
        assert_healthy(c)


def test_debug_endpoint_only_with_flag(engine: SharedEngine) -> None:
    with make_client(engine) as c:
        assert c.get("/debug/engine").status_code == 404
    with make_client(engine, enable_debug_endpoints=True) as c:
        body = c.get("/debug/engine").json()
        stats = engine.get_stats()
        assert body["num_running"] == 0 and body["num_total_blocks"] == stats.num_total_blocks
        assert body["num_unfinished_requests"] == 0
        assert body["num_free_blocks"] == stats.num_total_blocks  # every block came back
