"""End to end: the real server (uvicorn subprocess, default model) driven by the openai SDK.

One server per module (model load dominates). The SIGTERM test runs last: it
stops that server.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_server import live_server

import engine.async_engine  # noqa: F401  (an engine import error must fail, not skip)

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
API_KEY = "e2e-key"


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
        self.proc = proc
        self.base = base
        self.log = log

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}
        )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = [
        "--api-key",
        API_KEY,
        "--enable-debug-endpoints",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "64MiB",
        "--shutdown-timeout",
        "30",
        "--served-model-name",
        "smol",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    log = tmp_path_factory.mktemp("server") / "server.log"
    with live_server(flags, log) as (proc, base):
        yield Server(proc, base, log)


@pytest.fixture
def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture
def async_sdk(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)


def test_models_and_auth(server: Server, sdk: openai.OpenAI) -> None:
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["smol"]
    bad = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_sync(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is 2+2?"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 8


def test_chat_n_and_logprobs(sdk: openai.OpenAI) -> None:
    r = sdk.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=5,
        n=2,
        logprobs=True,
        top_logprobs=3,
        seed=1,
    )
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content
    assert len(lp.content[0].top_logprobs) == 3
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content


def test_seed_reproducible(sdk: openai.OpenAI) -> None:
    def once() -> str:
        r = sdk.completions.create(
            model="smol", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234
        )
        return r.choices[0].text

    assert once() == once()


def test_completions_stop_and_prompts(sdk: openai.OpenAI) -> None:
    r = sdk.completions.create(
        model="smol", prompt=["1, 2, 3,", "a, b, c,"], max_tokens=10, temperature=0, n=2, stop=[","]
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        assert "," not in c.text
    r = sdk.completions.create(
        model="smol", prompt="Hello", max_tokens=3, temperature=0, logprobs=2, echo=True
    )
    c = r.choices[0]
    assert c.text.startswith("Hello") and c.logprobs is not None
    assert c.logprobs.text_offset is not None and c.logprobs.text_offset[0] == 0


def test_context_length_error(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model="smol", prompt="hi " * 2000, max_tokens=5)
    assert "maximum context length is 1024 tokens" in str(info.value)


async def test_async_streaming(async_sdk: openai.AsyncOpenAI) -> None:
    stream = await async_sdk.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        n=2,
        temperature=0.7,
        seed=3,
    )
    texts = {0: "", 1: ""}
    finish = {}
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert set(finish) == {0, 1} and all(texts.values())
    assert usage is not None and usage.completion_tokens > 0

    comp = await async_sdk.completions.create(
        model="smol", prompt="The sky is", max_tokens=5, stream=True, temperature=0
    )
    parts = [c.choices[0].text async for c in comp if c.choices]
    assert "".join(parts)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call(sdk: openai.OpenAI, stream: bool) -> None:
    """A named tool_choice is enforced by the engine's grammar and parsed into tool_calls."""
    kwargs = dict(
        model="smol",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=100,
        temperature=0,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    if not stream:
        r = sdk.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls"
        assert calls and calls[0].function.name == "get_weather"
        assert "city" in json.loads(calls[0].function.arguments)
        return
    name, args, finish = None, "", None
    for chunk in sdk.chat.completions.create(stream=True, **kwargs):  # type: ignore[call-overload]
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert name == "get_weather" and "city" in json.loads(args) and finish == "tool_calls"


def _debug(client: httpx.Client) -> dict[str, int]:
    return client.get("/debug/engine").json()  # type: ignore[no-any-return]


def test_disconnect_frees_engine(server: Server) -> None:
    with server.client() as client:
        body = {
            "model": "smol",
            "prompt": "Write a long story.",
            "max_tokens": 500,
            "stream": True,
            "ignore_eos": True,
        }
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: "):
                    seen += 1
                if seen >= 2:
                    break
        t0 = time.monotonic()
        while True:
            stats = _debug(client)
            if (
                stats["num_running"] == 0
                and stats["num_unfinished_requests"] == 0
                and stats["num_free_blocks"] == stats["num_total_blocks"]
            ):
                break
            assert time.monotonic() - t0 < 1.0, stats
            time.sleep(0.05)


def test_sigterm_during_stream(server: Server) -> None:
    """Runs last: the stream completes, new requests get 503, the process exits 0."""
    with server.client() as client:
        body = {
            "model": "smol",
            "prompt": "Tell me about the sea.",
            # Long enough that the drain outlasts the checks below: with the fast
            # CPU defaults 40 tokens finished (and the server exited) within 0.5 s.
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
        }
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with server.client() as other:
                assert other.get("/health").status_code == 503
                rej = other.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
                assert rej.status_code == 503 and "retry-after" in rej.headers
            rest = [line for line in lines if line.startswith("data: ")]
        events = [first, *rest]
        assert events[-1] == "data: [DONE]"
        finals = [json.loads(e[6:]) for e in events[:-1]]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in finals)
    assert server.proc.wait(timeout=60) == 0
