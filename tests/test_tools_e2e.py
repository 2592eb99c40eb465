"""End to end: tool calls and structured outputs against the real server and model.

The live server (uvicorn subprocess, default SmolLM2 model, ``--enable-auto-tool-choice
--tool-call-parser hermes``) comes from ``test_server_e2e``'s module-scoped fixture, so
this module gets its own server. Every response goes through the real ``openai`` SDK,
whose typed objects must parse it.

What is checked: grammar-constrained answers always parse and validate (json_schema,
json_object, forced tool calls), batched with each other and with an unconstrained
request; streaming tool calls assemble to the non-streaming answer of the same seed;
``auto`` never returns a malformed mix; an agent-style round trip; and hostile or
invalid inputs answer 400 quickly while the server stays healthy.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageToolCall

from server.tool_parsers import HermesToolParser
from tests.test_server_e2e import API_KEY, Server
from tests.test_server_e2e import server as server

pytestmark = pytest.mark.slow

MODEL = "smol"

# A few typed fields; strings are bounded so a small model cannot ramble past
# max_tokens (finish_reason must be "stop").
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "count": {"type": "integer", "minimum": 1, "maximum": 1000},
        "category": {"type": "string", "enum": ["place", "food", "animal", "thing", "idea"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "recommended": {"type": "boolean"},
    },
    "required": ["title", "count", "category", "tags", "recommended"],
    "additionalProperties": False,
}

PROMPTS = [
    "Describe a city.",
    "Give a recipe.",
    "Describe your favourite animal.",
    "Tell me about a famous painting.",
    "Recommend a book.",
    "Describe a mountain.",
    "Suggest a board game.",
    "Describe the ocean.",
    "Give me a travel tip.",
    "Describe a kitchen tool.",
    "Tell me about a planet.",
    "Describe a sport.",
    "Recommend a movie.",
    "Describe a tree.",
    "Suggest a hobby.",
    "Describe a musical instrument.",
    "Tell me about a bird.",
    "Describe a dessert.",
    "Describe a river.",
    "Suggest a name for a cat.",
]

JSON_OBJECT_PROMPTS = [
    'Reply with a JSON object with the keys "name" and "age" of a fictional person.',
    'Reply with a JSON object {"city": ..., "country": ...} for one European city.',
    'Reply with a JSON object with the key "colour" set to your favourite colour.',
    'Reply with a JSON object with the keys "title" and "year" of one film.',
]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 40}},
            "required": ["timezone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
TOOL_PROMPTS = [
    "What is the weather in Paris?",
    "What time is it in Tokyo?",
    "Is it cold in Oslo right now, and what time is it there?",
]
REJECT_WITHIN_S = 15.0


@pytest.fixture
def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def async_sdk(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=600
    )


def _user(text: str) -> Any:
    return [{"role": "user", "content": text}]


def _check_calls(calls: list[ChatCompletionMessageToolCall] | None) -> list[tuple[str, Any]]:
    """Every call names a declared tool and its arguments validate; (name, args) pairs."""
    assert calls, "expected at least one tool call"
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        name = call.function.name
        assert name in PARAMS, name
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, PARAMS[name])
        out.append((name, args))
    return out


def _assert_no_markup(content: str | None) -> None:
    """Content never carries a complete, valid call the parser should have taken."""
    if content:
        leftover = HermesToolParser(TOOLS).parse(content)
        assert leftover.tool_calls == [], content


# --------------------------------------------------------------------- structured


async def test_json_schema_batched_with_unconstrained(async_sdk: openai.AsyncOpenAI) -> None:
    """20 strict json_schema + 4 json_object answers, 10 at a time, next to a free request."""
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
    }
    gate = asyncio.Semaphore(10)

    async def constrained(i: int, prompt: str, rf: Any, max_tokens: int = 200) -> ChatCompletion:
        async with gate:
            return await async_sdk.chat.completions.create(
                model=MODEL,
                messages=_user(prompt),
                response_format=rf,
                max_tokens=max_tokens,
                temperature=0.7,
                seed=100 + i,
            )

    # The unconstrained request runs for the whole batch: its rows share every
    # decode step with constrained rows, so a mask applied to the wrong row shows.
    free = asyncio.create_task(
        async_sdk.chat.completions.create(
            model=MODEL,
            messages=_user("Tell me a long story about a dragon."),
            max_tokens=120,
            temperature=0.7,
            seed=7,
            extra_body={"ignore_eos": True},
        )
    )
    await asyncio.sleep(0.5)  # let it get admitted first
    tasks = [constrained(i, p, response_format) for i, p in enumerate(PROMPTS)]
    # json_object bounds nothing, so these prompts ask for small objects.
    tasks += [
        constrained(50 + i, p, {"type": "json_object"}, max_tokens=400)
        for i, p in enumerate(JSON_OBJECT_PROMPTS)
    ]
    results = await asyncio.gather(*tasks)
    for prompt, r in zip(PROMPTS, results[: len(PROMPTS)], strict=True):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice.message.content)
        value = json.loads(choice.message.content or "")
        jsonschema.validate(value, ANSWER_SCHEMA)
    for r in results[len(PROMPTS) :]:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)
    story = await free
    assert story.usage is not None and story.usage.completion_tokens == 120
    text = story.choices[0].message.content or ""
    assert story.choices[0].finish_reason == "length"
    # A JSON mask leaking onto this row would have forced it to open with "{".
    assert text and not text.lstrip().startswith("{"), text


# ---------------------------------------------------------------------- tool calls


def _forced_kwargs(prompt: str, choice: Any, seed: int) -> dict[str, Any]:
    return dict(
        model=MODEL,
        messages=_user(prompt),
        tools=TOOLS,
        tool_choice=choice,
        max_tokens=200,
        temperature=0.7,
        seed=seed,
    )


def _assemble_stream(sdk: openai.OpenAI, kwargs: dict[str, Any]) -> tuple[Any, Any, str | None]:
    """Fold the deltas the way an SDK user does: by index, the first delta names the call."""
    calls: dict[int, dict[str, str]] = {}
    content = ""
    finish: str | None = None
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    # The first delta of a call carries its id, type and name.
                    assert tc.id and tc.type == "function", tc
                    assert tc.function is not None and tc.function.name, tc
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    assert tc.id is None and (tc.function is None or not tc.function.name)
                if tc.function is not None and tc.function.arguments:
                    calls[tc.index]["arguments"] += tc.function.arguments
            finish = c.finish_reason or finish
    assert sorted(calls) == list(range(len(calls)))
    ordered = [calls[i] for i in range(len(calls))]
    return content or None, ordered, finish


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls(sdk: openai.OpenAI, choice: Any) -> None:
    """Always at least one valid call; streaming assembles to the same answer per seed."""
    for seed, prompt in enumerate(TOOL_PROMPTS):
        kwargs = _forced_kwargs(prompt, choice, seed)
        r = sdk.chat.completions.create(**kwargs)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        assert not msg.content, msg.content  # the grammar allows call blocks only
        pairs = _check_calls(msg.tool_calls)
        if isinstance(choice, dict):
            assert [name for name, _ in pairs] == ["get_weather"]
        content, streamed, finish = _assemble_stream(sdk, kwargs)
        assert finish == "tool_calls" and content is None
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == pairs
        # Arguments are streamed byte-identically, not just equal as JSON.
        assert [c["arguments"] for c in streamed] == [
            c.function.arguments for c in msg.tool_calls or []
        ]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_with_one_tool_ends_the_turn(sdk: openai.OpenAI, parallel: bool) -> None:
    """Issue 22's case: one weather tool, a weather question, a generous max_tokens.

    The turn ends with complete calls (``tool_calls``), never ``length`` with a third
    call's raw markup in content; judged on what the model generated (logprobs)."""
    r = sdk.chat.completions.create(
        model=MODEL,
        messages=_user("What is the weather in Paris?"),
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=700,  # generous: the window is 1024 and the prompt about 230
        temperature=0,
        logprobs=True,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    calls = _check_calls(choice.message.tool_calls)
    assert 1 <= len(calls) <= (8 if parallel else 1)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    raw = bytes(b for t in choice.logprobs.content for b in (t.bytes or [])).decode()
    parsed = HermesToolParser([WEATHER]).parse(raw.removesuffix("<|im_end|>"))
    assert not (parsed.content or "").strip() and len(parsed.tool_calls) == len(calls), raw


def test_parallel_tool_calls_false_gives_one_call(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        parallel_tool_calls=False,
        logprobs=True,
        **_forced_kwargs(TOOL_PROMPTS[2], "required", 11),
    )
    # One block is all the grammar let the model generate (no call was dropped).
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    raw = bytes(b for t in r.choices[0].logprobs.content for b in (t.bytes or [])).decode()
    assert len(HermesToolParser(TOOLS).parse(raw.removesuffix("<|im_end|>")).tool_calls) == 1
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(_check_calls(r.choices[0].message.tool_calls)) == 1


def test_auto_and_none(sdk: openai.OpenAI) -> None:
    """``auto``: content or valid calls, never a malformed mix; ``none``: content only."""
    prompts = [*TOOL_PROMPTS[:2], "Write a haiku about autumn.", "Hello! Who are you?"]
    for seed, prompt in enumerate(prompts):
        r = sdk.chat.completions.create(
            **{**_forced_kwargs(prompt, "auto", seed), "max_tokens": 120}
        )
        choice = r.choices[0]
        if choice.message.tool_calls:
            _check_calls(choice.message.tool_calls)
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.message.content and choice.finish_reason in ("stop", "length")
        if choice.finish_reason != "length":  # a cut-off block is content, by design
            _assert_no_markup(choice.message.content)
            assert "<tool_call>" not in (choice.message.content or "")

        r = sdk.chat.completions.create(
            **{**_forced_kwargs(prompt, "none", seed), "max_tokens": 60}
        )
        choice = r.choices[0]
        assert choice.message.tool_calls is None and choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_agent_round_trip(sdk: openai.OpenAI) -> None:
    """Call (required), send back the call and its result, get a final text answer."""
    messages: list[Any] = _user("What is the weather in Paris?")
    first = sdk.chat.completions.create(
        **{**_forced_kwargs("", "required", 5), "messages": messages}
    )
    assert first.choices[0].finish_reason == "tool_calls"
    calls = first.choices[0].message.tool_calls or []
    _check_calls(calls)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in calls:
        messages.append(
            {
                "role": "tool",
                "tool_call_id": call.id,
                "content": json.dumps({"temperature": 21, "condition": "sunny"}),
            }
        )
    extras: list[dict[str, Any]] = [{"tools": TOOLS, "tool_choice": "auto"}, {}]
    for extra in extras:
        final = sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=200, temperature=0, seed=5, **extra
        )
        choice = final.choices[0]
        assert choice.finish_reason == "stop", choice.message
        assert choice.message.content and not choice.message.tool_calls


# ---------------------------------------------------------------------- bad inputs


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        }
    }


BAD_REQUESTS: dict[str, tuple[dict[str, Any], str]] = {
    "uncompilable_ref": (
        _schema_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
        "cannot compile",
    ),
    "unknown_type": (_schema_format({"type": "strng"}), "strng"),
    "depth_100": (_schema_format(_nested(100)), "nested deeper"),
    "enum_20000": (
        _schema_format({"type": "string", "enum": [f"value-{i}" for i in range(20_000)]}),
        "",
    ),
    "bad_regex": (
        _schema_format(
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}
        ),
        "regex",
    ),
    "named_tool_not_in_tools": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "nope",
    ),
    "invalid_tool_schema_auto": (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "required": 3}},
                }
            ],
            "tool_choice": "auto",
        },
        "parameters",
    ),
    "invalid_tool_schema_required": (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "nonsense"}},
                }
            ],
            "tool_choice": "required",
        },
        "nonsense",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_inputs_rejected_quickly(server: Server, sdk: openai.OpenAI, case: str) -> None:
    extra, needle = BAD_REQUESTS[case]
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(
            model=MODEL,
            messages=_user("Hi"),
            max_tokens=20,
            **extra,
        )
    assert time.monotonic() - t0 < REJECT_WITHIN_S
    message = info.value.message
    assert needle.lower() in message.lower(), message
    body = info.value.body
    assert isinstance(body, dict)
    # The error names the offending field (tools.N.function.parameters and the like).
    assert str(body.get("param")).split(".")[0] in ("response_format", "tools", "tool_choice")
    assert httpx.get(f"{server.base}/health", timeout=10).status_code == 200
