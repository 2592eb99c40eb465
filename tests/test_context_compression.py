"""Context compression of over-long chats (issue 17): ``truncation`` / ``--context-compression``.

Server tests run the real tiny exact-mode engine (SmolLM2's tokenizer and ChatML
template, a 512-token context) behind the app, through the openai SDK where a
client would use it. The reference for what the engine must be sent is
transformers' own chat template rendering of the messages expected to be kept;
the expected keep-sets are derived by hand from per-message token counts.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from server.app import build_app
from server.config import ServerConfig
from server.context_compression import bm25_scores, compress, rank_units, turn_units
from server.prompts import ChatPrompt
from tests.real_engine import MAX_LEN, SharedEngine
from tests.server_fakes import assert_schema

CHAT = "/v1/chat/completions"
NAME = "tiny"
SYSTEM = {"role": "system", "content": "You answer in one word."}
FILLER_USER = "Tell me more."
FILLER_REPLY = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 6


@pytest.fixture(scope="module")
def engine(tiny_server_engine: SharedEngine) -> SharedEngine:
    return tiny_server_engine


def make_client(engine: SharedEngine, **cfg: Any) -> TestClient:
    return TestClient(build_app(engine, ServerConfig(served_model_name=[NAME], **cfg)))


@pytest.fixture(scope="module")
def client(engine: SharedEngine) -> Iterator[TestClient]:
    with make_client(engine) as c:
        yield c


def sdk(client: TestClient) -> openai.OpenAI:
    """The real SDK, speaking HTTP to the app in-process (TestClient is an httpx.Client)."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)


def hf_prompt(engine: SharedEngine, messages: list[dict[str, Any]]) -> list[int]:
    hf = engine.inner.engine.tokenizer.hf_tokenizer
    ids = hf.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    return list(ids)


def block_len(engine: SharedEngine, role: str, content: str) -> int:
    """Tokens of one ChatML block (blocks start at a special token, so they add up)."""
    hf = engine.inner.engine.tokenizer.hf_tokenizer
    return len(hf.encode(f"<|im_start|>{role}\n{content}<|im_end|>\n", add_special_tokens=False))


def filler_turns(k: int) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for _ in range(k):
        turns += [
            {"role": "user", "content": FILLER_USER},
            {"role": "assistant", "content": FILLER_REPLY},
        ]
    return turns


def last_prompt(engine: SharedEngine) -> list[int]:
    return engine.calls[-1][0]


# ------------------------------------------------------------ selection units


def test_turn_units_keep_calls_with_results() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "assistant", "content": "Hi, I am here."},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
        {"role": "tool", "content": "r", "tool_call_id": "x"},
        {"role": "assistant", "content": "a1"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u2"},
        {"role": "user", "content": "u3"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "y"}]},
        {"role": "tool", "content": "r2", "tool_call_id": "y"},
    ]
    units, newest = turn_units(msgs)
    assert units == [[0], [2, 3, 4, 5], [7], [8, 9, 10]]
    assert newest == 3


def test_bm25_hand_computed() -> None:
    docs = [["a", "b"], ["b", "c", "c"], ["d"]]
    # n = 3, avg length 2; "c" is in one doc: idf = ln((3 - 1 + .5) / (1 + .5) + 1).
    idf = math.log(2.5 / 1.5 + 1)
    norm = 1.2 * (1 - 0.75 + 0.75 * 3 / 2)
    expected = [0.0, idf * 2 * 2.2 / (2 + norm), 0.0]
    assert bm25_scores(["c", "c", "zz"], docs) == pytest.approx(expected, rel=1e-12)
    assert bm25_scores(["c"], []) == []


def test_rank_relevance_then_recency() -> None:
    msgs = [
        {"role": "user", "content": "the vault code is 7481"},  # relevant, oldest
        {"role": "user", "content": "rivers and lakes"},
        {"role": "user", "content": "mountains"},  # newest candidate
    ]
    # Relevance 1.0 + recency 0.5/3 beats recency 0.5 (newest) beats 0.5*2/3.
    assert rank_units(msgs, [[0], [1], [2]], "what is the vault code?") == [0, 2, 1]
    # No overlap: pure recency, newest first.
    assert rank_units(msgs, [[0], [1], [2]], "zebra") == [2, 1, 0]


# ------------------------------------------------------------ over HTTP


def long_convo() -> list[dict[str, Any]]:
    return [SYSTEM, *filler_turns(12), {"role": "user", "content": "Which colour is the sky?"}]


def expected_recency_keep(engine: SharedEngine, msgs: list[dict[str, Any]], room: int) -> int:
    """How many of the newest filler turns fit (all have zero relevance: pure recency)."""
    fixed = (
        block_len(engine, "system", SYSTEM["content"])
        + block_len(engine, "user", msgs[-1]["content"])
        + len(engine.inner.engine.tokenizer.hf_tokenizer.encode("<|im_start|>assistant\n"))
    )
    turn = block_len(engine, "user", FILLER_USER) + block_len(engine, "assistant", FILLER_REPLY)
    return (room - fixed) // turn


def test_twice_the_context_is_answered_keeping_system_and_newest(
    client: TestClient, engine: SharedEngine
) -> None:
    msgs = long_convo()
    n_full = len(hf_prompt(engine, msgs))
    assert n_full > 2 * MAX_LEN
    raw = sdk(client).chat.completions.with_raw_response.create(
        model=NAME, messages=msgs, max_tokens=4, extra_body={"truncation": "auto"}
    )
    completion = raw.parse()
    body = raw.http_response.json()
    assert_schema(body, "CreateChatCompletionResponse")
    keep = expected_recency_keep(engine, msgs, MAX_LEN - 4)
    assert 0 < keep < 12
    # Filler turn t (0-based) is messages 1 + 2t and 2 + 2t; the oldest 12 - keep go.
    dropped = list(range(1, 1 + 2 * (12 - keep)))
    kept_msgs = [SYSTEM, *filler_turns(keep), msgs[-1]]
    expected_ids = hf_prompt(engine, kept_msgs)
    assert last_prompt(engine) == expected_ids
    assert body["usage"]["context_compression"] == {
        "dropped_messages": dropped,
        "dropped_tokens": n_full - len(expected_ids),
    }
    assert completion.usage is not None and completion.usage.prompt_tokens == len(expected_ids)
    assert raw.headers["x-fuel-context-dropped-messages"] == ",".join(map(str, dropped))
    assert raw.headers["x-fuel-context-dropped-tokens"] == str(n_full - len(expected_ids))
    # The engine got the kept prompt's segments, turns indexing the request's messages.
    segments = engine.calls[-1][3].segments  # type: ignore[union-attr]
    assert [s.turn for s in segments] == [0, *range(dropped[-1] + 1, len(msgs))]
    assert segments[0].kind == "system" and segments[-1].kind == "user"
    gen_prompt = engine.inner.engine.tokenizer.hf_tokenizer.encode("<|im_start|>assistant\n")
    assert segments[-1].end == len(expected_ids) - len(gen_prompt)


def test_template_that_does_not_add_up_still_fits(engine: SharedEngine) -> None:
    """No system message: SmolLM2's template puts its default system prompt in front of
    whichever message comes first, so dropping the first turn saves less than its span
    says. For every budget over one turn's range the result is the longest newest
    suffix of turns whose transformers rendering fits, and some budgets need the
    re-render check to drop one more turn."""
    tok = engine.inner.engine.tokenizer
    question: dict[str, Any] = {"role": "user", "content": "Which colour is the sky?"}
    msgs = [*filler_turns(12), question]
    renders = 0

    async def render(subset: list[Any]) -> ChatPrompt:
        nonlocal renders
        renders += 1
        return ChatPrompt(*tok.apply_chat_template_segments(subset))

    full = ChatPrompt(*tok.apply_chat_template_segments(msgs))
    lengths = [len(hf_prompt(engine, [*filler_turns(j), question])) for j in range(13)]
    turn = lengths[2] - lengths[1]
    needed_second_render = 0
    for budget in range(lengths[3], lengths[3] + turn):
        renders = 0
        result = asyncio.run(compress(msgs, full, budget, render, tok.encode))
        assert result is not None
        best = max(j for j in range(13) if lengths[j] <= budget)
        assert result.prompt.token_ids == hf_prompt(engine, [*filler_turns(best), question])
        assert result.dropped == list(range(2 * (12 - best)))
        needed_second_render += renders == 2
        assert renders <= 2
    assert needed_second_render > 0


def test_needle_in_an_early_turn_survives(client: TestClient, engine: SharedEngine) -> None:
    needle = [
        {"role": "user", "content": "Remember this: the vault code is 7481."},
        {"role": "assistant", "content": "Noted."},
    ]
    question = {"role": "user", "content": "What is the vault code?"}
    msgs = [SYSTEM, *needle, *filler_turns(12), question]
    r = client.post(
        CHAT, json={"model": NAME, "messages": msgs, "max_tokens": 2, "truncation": "auto"}
    )
    assert r.status_code == 200, r.text
    dropped = r.json()["usage"]["context_compression"]["dropped_messages"]
    assert 1 not in dropped and 2 not in dropped
    # The needle outranks the filler turns right after it: recency alone would drop it.
    assert 3 in dropped and 4 in dropped
    keep = [m for i, m in enumerate(msgs) if i not in dropped]
    assert last_prompt(engine) == hf_prompt(engine, keep)
    assert "7481" in engine.inner.engine.tokenizer.decode(last_prompt(engine))


def tool_turn(call_id: str, user: str, name: str, args: str, result: str) -> list[dict[str, Any]]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
        {"role": "assistant", "content": f"It is {result}."},
    ]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}},
        },
    }
    for name, arg in (("get_weather", "city"), ("get_time", "timezone"))
]


@pytest.mark.parametrize("relevant", [True, False])
def test_tool_calls_and_results_go_together(
    client: TestClient, engine: SharedEngine, relevant: bool
) -> None:
    """An old tool turn is dropped or kept whole; the newest turn keeps its pending result.

    The old turn shares words with the newest ("weather", "get_weather", "city") or
    none at all; the filler turns between share none either way.
    """
    old = (
        tool_turn("call_1", "Weather at Oslo?", "get_weather", '{"city": "Oslo"}', "snowy")
        if relevant
        else tool_turn(
            "call_1", "Current time for Tokyo?", "get_time", '{"timezone": "Asia/Tokyo"}', "10:00"
        )
    )
    newest = tool_turn(
        "call_2", "Lima weather, please?", "get_weather", '{"city": "Lima"}', "sunny"
    )
    msgs = [SYSTEM, *old, *filler_turns(10), *newest[:3]]  # the newest answer is pending
    r = client.post(
        CHAT,
        json={
            "model": NAME,
            "messages": msgs,
            "tools": TOOLS,
            "max_tokens": 2,
            "truncation": "auto",
        },
    )
    assert r.status_code == 200, r.text
    dropped = set(r.json()["usage"]["context_compression"]["dropped_messages"])
    n = len(msgs)
    assert not dropped & {0, n - 3, n - 2, n - 1}  # system and the newest turn, tool result too
    old_turn = {1, 2, 3, 4}
    assert (old_turn & dropped) == (set() if relevant else old_turn)
    keep = [m for i, m in enumerate(msgs) if i not in dropped]
    expected = engine.inner.engine.tokenizer.apply_chat_template(keep, tools=TOOLS)
    assert last_prompt(engine) == expected


def test_streamed_reports_in_header_and_final_usage(
    client: TestClient, engine: SharedEngine
) -> None:
    msgs = long_convo()
    with sdk(client).chat.completions.with_streaming_response.create(
        model=NAME,
        messages=msgs,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"truncation": "auto"},
    ) as response:
        header = response.headers["x-fuel-context-dropped-messages"]
        chunks = list(response.parse())
    for chunk in chunks:
        assert_schema(
            chunk.model_dump(mode="json", exclude_unset=True), "CreateChatCompletionStreamResponse"
        )
    usage = chunks[-1].usage
    assert usage is not None and usage.model_extra is not None
    report = usage.model_extra["context_compression"]
    assert ",".join(map(str, report["dropped_messages"])) == header
    assert usage.prompt_tokens == len(last_prompt(engine))
    assert all(c.usage is None for c in chunks[:-1])


def context_error(n_prompt: int, budget: int) -> str:
    return (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{n_prompt + budget} tokens ({n_prompt} in the messages, {budget} in the completion). "
        "Please reduce the length of the messages or completion."
    )


def assert_context_400(r: Any, n_prompt: int, budget: int) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert_schema(body, "ErrorResponse")
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "messages"
    assert body["error"]["message"] == context_error(n_prompt, budget)


def test_default_and_disabled_keep_todays_400(client: TestClient, engine: SharedEngine) -> None:
    msgs = long_convo()
    n = len(hf_prompt(engine, msgs))
    calls = len(engine.calls)
    for extra in ({}, {"truncation": "disabled"}):
        r = client.post(CHAT, json={"model": NAME, "messages": msgs, "max_tokens": 4, **extra})
        assert_context_400(r, n, 4)
        assert "x-fuel-context-dropped-messages" not in r.headers
    # A conversation that fits is untouched, even when compression is asked for.
    short = [SYSTEM, {"role": "user", "content": "Hi"}]
    r = client.post(
        CHAT, json={"model": NAME, "messages": short, "max_tokens": 2, "truncation": "auto"}
    )
    assert r.status_code == 200 and "context_compression" not in r.json()["usage"]
    assert "x-fuel-context-dropped-messages" not in r.headers
    assert len(engine.calls) == calls + 1 and last_prompt(engine) == hf_prompt(engine, short)


def test_server_default_auto_and_request_opt_out(engine: SharedEngine) -> None:
    msgs = long_convo()
    n = len(hf_prompt(engine, msgs))
    with make_client(engine, context_compression="auto") as c:
        r = c.post(CHAT, json={"model": NAME, "messages": msgs, "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["context_compression"]["dropped_messages"]
        r = c.post(
            CHAT,
            json={"model": NAME, "messages": msgs, "max_tokens": 4, "truncation": "disabled"},
        )
        assert_context_400(r, n, 4)


def test_without_max_tokens_the_reserve_is_left(engine: SharedEngine) -> None:
    msgs = long_convo()
    with make_client(engine, context_compression="auto", context_compression_reserve=100) as c:
        r = c.post(CHAT, json={"model": NAME, "messages": msgs})
        assert r.status_code == 200, r.text
    keep = expected_recency_keep(engine, msgs, MAX_LEN - 100)
    assert last_prompt(engine) == hf_prompt(engine, [SYSTEM, *filler_turns(keep), msgs[-1]])


def test_pinned_messages_that_do_not_fit_get_todays_400(
    client: TestClient, engine: SharedEngine
) -> None:
    big = {"role": "user", "content": "zeta " * 600}
    msgs = [SYSTEM, *filler_turns(2), big]
    n = len(hf_prompt(engine, msgs))
    r = client.post(
        CHAT, json={"model": NAME, "messages": msgs, "max_tokens": 4, "truncation": "auto"}
    )
    assert_context_400(r, n, 4)


@pytest.mark.parametrize("value", ["sometimes", True, 3])
def test_unknown_truncation_is_a_400_naming_it(client: TestClient, value: Any) -> None:
    r = client.post(
        CHAT,
        json={"model": NAME, "messages": [{"role": "user", "content": "hi"}], "truncation": value},
    )
    assert r.status_code == 400, r.text
    body = r.json()
    assert_schema(body, "ErrorResponse")
    assert body["error"]["param"] == "truncation"
    assert "'auto' or 'disabled'" in body["error"]["message"]


def test_segments_reach_the_engine_only_for_turn_evicting_policies(
    client: TestClient, engine: SharedEngine
) -> None:
    """Spans cost a render per message prefix: a plain request sends none; a request
    under a policy that evicts whole turns (segmented, vote) sends one per message."""
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name a colour."},
    ]
    body = {"model": NAME, "messages": msgs, "max_tokens": 2}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert engine.calls[-1][3].segments == ()  # type: ignore[union-attr]
    for policy in ("segmented", "vote"):
        kv = {"type": policy, "budget_tokens": 96, "sink_tokens": 4}
        r = client.post(CHAT, json={**body, "kv_policy": kv})
        assert r.status_code == 200, r.text
        segments = engine.calls[-1][3].segments  # type: ignore[union-attr]
        assert [(s.turn, s.kind) for s in segments] == [
            (0, "system"),
            (1, "user"),
            (2, "assistant"),
            (3, "user"),
        ]
        assert segments[-1].end <= len(last_prompt(engine))
    # The engine decides which policies read turns (the default vote has a segment
    # weight); the token-level ones get none.
    assert engine.segment_policies == frozenset({"segmented", "vote"})
    for policy in ("streaming", "h2o", "rkv"):
        kv = {"type": policy, "budget_tokens": 96, "sink_tokens": 4}
        r = client.post(CHAT, json={**body, "kv_policy": kv})
        assert r.status_code == 200, r.text
        assert engine.calls[-1][3].segments == ()  # type: ignore[union-attr]
