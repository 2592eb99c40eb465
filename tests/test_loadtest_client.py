"""The SSE client, the load runner and the CLI against a scripted fake OpenAI server.

The fake runs in a thread on 127.0.0.1 on a free port. Its behaviour is chosen
by the request's model name, so each test scripts exactly what the stream holds:
timed content chunks, keep-alive comments, usage, error events, HTTP errors.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from loadtest.__main__ import main
from loadtest.client import ClientConfig, RequestSpec, send_request
from loadtest.metrics import compute_metrics
from loadtest.runner import LoadSpec, run_load
from loadtest.workloads import WorkloadOptions, build_sessions

pytestmark = pytest.mark.slow  # starts a (fake) server

FIRST_DELAY = 0.20  # seconds before the first content chunk
GAP = 0.10  # seconds between content chunks
WORDS = ["Hello", " there", ",", " friend", "."]


def fake_app(received: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": "fake-1.0"}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        body = await request.json()
        received.append({**body, "_host": request.headers["host"].split(":")[0]})
        mode = body["model"]
        chat = "messages" in body
        if mode == "http500":
            return JSONResponse({"error": {"message": "kaput"}}, status_code=500)
        if mode == "busy":
            return JSONResponse({"error": {"message": "busy"}}, status_code=429)

        def chunk(text: str | None, finish: str | None = None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish}
            return "data: " + json.dumps({"id": "x", "choices": [choice]}) + "\n\n"

        async def stream() -> AsyncIterator[str]:
            if chat:
                # A role-only first chunk carries no content: it must not set TTFT.
                yield (
                    "data: "
                    + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    + "\n\n"
                )
            await asyncio.sleep(FIRST_DELAY)
            yield ": keep-alive\n\n"
            n_prompt = sum(len(m["content"]) for m in body.get("messages", [])) or len(
                body.get("prompt", "")
            )
            for i, w in enumerate(WORDS):
                if i:
                    await asyncio.sleep(GAP)
                yield chunk(w)
                if mode == "midstream-error" and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "engine died"}}) + "\n\n"
                    return
            yield chunk(None, "stop")
            if mode == "truncated":
                return
            if mode != "no-usage":
                usage = {"prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": 0}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(fake_app(received), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.should_exit = True
        thread.join(timeout=10)


async def _send(url: str, model: str, endpoint: str = "chat") -> Any:
    cfg = ClientConfig(base_url=url, endpoint=endpoint, model=model)  # type: ignore[arg-type]
    spec = RequestSpec(
        messages=[{"role": "user", "content": "hi"}] if endpoint == "chat" else None,
        prompt="hi" if endpoint == "completions" else None,
        max_tokens=16,
        ignore_eos=True,
    )
    async with httpx.AsyncClient(trust_env=False) as client:
        return await send_request(client, cfg, spec)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_timings_and_usage_are_picked_up(
    fake_server: tuple[str, list[dict[str, Any]]], endpoint: str
) -> None:
    url, received = fake_server
    r = asyncio.run(_send(url, "ok", endpoint))
    assert r.success, r.error
    assert r.generated_text == "".join(WORDS)
    assert r.output_tokens == 7  # from usage, not from counting chunks (5)
    assert r.prompt_tokens == 2
    assert r.finish_reason == "stop"
    assert FIRST_DELAY - 0.02 <= r.ttft_s < FIRST_DELAY + 0.25
    assert len(r.itl_s) == len(WORDS) - 1
    assert all(GAP - 0.02 <= g < GAP + 0.2 for g in r.itl_s)
    assert r.latency_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / 6)
    body = received[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 16 and body["temperature"] == 0


@pytest.mark.parametrize(
    ("model", "status", "needle"),
    [
        ("http500", 500, "HTTP 500"),
        ("busy", 429, "HTTP 429"),
        ("midstream-error", 200, "engine died"),
        ("no-usage", 200, "no usage"),
        ("truncated", 200, "[DONE]"),
    ],
)
def test_failures_are_reported(
    fake_server: tuple[str, list[dict[str, Any]]], model: str, status: int, needle: str
) -> None:
    r = asyncio.run(_send(fake_server[0], model))
    assert not r.success
    assert r.status_code == status
    assert needle in r.error


def test_connection_error_is_a_failure() -> None:
    r = asyncio.run(_send(f"http://127.0.0.1:{_free_port()}", "ok"))
    assert not r.success and r.status_code is None and "ConnectError" in r.error


def test_closed_loop_counts_and_concurrency(fake_server: tuple[str, list[dict[str, Any]]]) -> None:
    url = fake_server[0]
    cfg = ClientConfig(base_url=url, endpoint="chat", model="ok")
    sessions = build_sessions("questions", 8, WorkloadOptions())

    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False) as c:
            return await run_load(
                c, cfg, sessions, LoadSpec(num_requests=6, max_duration_s=30, concurrency=3), False
            )

    res = asyncio.run(go())
    assert len(res.results) == 6 and all(r.success for r in res.results)
    # One request takes ~0.6 s; 6 at concurrency 3 take two rounds, not six.
    assert 1.0 < res.duration_s < 3.0
    m = compute_metrics(res.results, res.duration_s)
    assert m.completed == 6 and m.total_output_tokens == 42


def test_deadline_cancels_in_flight(fake_server: tuple[str, list[dict[str, Any]]]) -> None:
    cfg = ClientConfig(base_url=fake_server[0], endpoint="chat", model="ok")
    sessions = build_sessions("questions", 10, WorkloadOptions())

    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False) as c:
            spec = LoadSpec(num_requests=10, max_duration_s=0.9, concurrency=2)
            return await run_load(c, cfg, sessions, spec, False)

    res = asyncio.run(go())
    assert res.hit_deadline and res.cancelled == 2 and len(res.results) == 2
    assert res.duration_s < 1.5


def test_open_loop_and_multi_turn(fake_server: tuple[str, list[dict[str, Any]]]) -> None:
    url, received = fake_server
    cfg = ClientConfig(base_url=url, endpoint="chat", model="ok")
    sessions = build_sessions("multi-turn", 4, WorkloadOptions(num_turns=2))

    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False) as c:
            spec = LoadSpec(
                num_requests=4, max_duration_s=30, concurrency=None, request_rate=20.0, seed=1
            )
            return await run_load(c, cfg, sessions, spec, False)

    n_before = len(received)
    res = asyncio.run(go())
    assert len(res.results) == 4 and all(r.success for r in res.results)
    assert len(res.arrivals_s) == 2
    # Both conversations overlap (arrivals ~50 ms apart, each turn ~0.6 s).
    assert res.duration_s < 2.0
    second_turns = [b for b in received[n_before:] if len(b["messages"]) == 3]
    assert len(second_turns) == 2
    assert all(b["messages"][1]["content"] == "".join(WORDS) for b in second_turns)


def test_cli_run_writes_record_and_plot(
    fake_server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url = fake_server[0]
    rc = main(
        [
            "run", "--base-url", url, "--model", "ok", "--workload", "shared-prefix",
            "--concurrency", "1,2", "--num-requests", "2", "--num-warmup", "1",
            "--goodput", "ttft:5000", "--result-dir", str(tmp_path), "--plot", "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    records = sorted(tmp_path.glob("*.json"))
    assert len(records) == 2 and len(list(tmp_path.glob("*.png"))) == 1
    rec = json.loads(records[0].read_text())
    assert rec["metrics"]["completed"] == 2 and rec["metrics"]["goodput"] > 0
    assert rec["server"]["version"] == {"version": "fake-1.0"}
    assert rec["server"]["models"]["data"][0]["id"] == "fake-model"
    assert rec["machine"]["logical_cores"] >= 1 and "git" in rec
    assert "--concurrency 1,2" in rec["command_line"]
    assert len(rec["requests"]) == 2 and rec["requests"][0]["ttft_s"] > 0


def test_cli_counts_failures_and_refuses_remote(
    fake_server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    args = ["run", "--base-url", fake_server[0], "--model", "http500", "--num-requests", "3",
            "--result-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(args) == 1  # nothing completed
    rec = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert rec["metrics"]["failed"] == 3 and rec["metrics"]["failures_by_status"] == {"500": 3}
    assert main(["run", "--base-url", "http://10.1.2.3:8000", "--no-progress"]) == 2


def test_compare_alternates_and_writes_markdown(
    fake_server: tuple[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    url, received = fake_server
    out = tmp_path / "cpu.md"
    n_before = len(received)
    rc = main(
        [
            "compare", "--ours-url", url, "--peer-url", url.replace("127.0.0.1", "localhost"),
            "--model", "ok", "--grid", "questions:1,2;shared-prefix:1", "--repeats", "2",
            "--num-requests", "2", "--output", str(out), "--result-dir", str(tmp_path),
            "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    # 3 cells x 2 repeats x 2 sides x 2 requests, alternating ours (127.0.0.1), peer.
    hosts = [b["_host"] for b in received[n_before:]]
    assert len(hosts) == 24
    assert (
        hosts[:8] == ["127.0.0.1"] * 2 + ["localhost"] * 2 + ["127.0.0.1"] * 2 + ["localhost"] * 2
    )
    md = out.read_text()
    assert "| questions | 2 | output tok/s |" in md
    assert "| shared-prefix | 1 | TTFT p50 (ms) |" in md
    assert "Git commit" in md and "Machine" in md and "## Targets" in md
    assert "one stream: TPOT p50 <= 1.0x the Q4_1 peer" in md
    rec = json.loads(next(tmp_path.glob("*-compare.json")).read_text())
    assert [c["concurrency"] for c in rec["cells"]] == [1, 2, 1]
    assert len(rec["cells"][0]["ours"]["requests"]) == 4  # two repeats pooled
    assert len(rec["cells"][0]["peer"]["per_repeat"]) == 2  # and each kept for the spread


def test_random_workload_with_the_default_models_tokenizer() -> None:
    from loadtest.workloads import load_tokenizer

    tok = load_tokenizer(None)  # the default GGUF's tokenizer (tens of seconds)
    opts = WorkloadOptions(input_len=200, output_len=16, seed=5)
    sessions = build_sessions("random", 4, opts, tok)
    for s in sessions:
        n = len(tok.encode(s.turns[0], add_special_tokens=False))
        # Decoding random ids and re-encoding merges or splits a few tokens.
        assert 150 <= n <= 250, n
        assert s.max_tokens == [16] and s.ignore_eos
    long = build_sessions("long-prompt", 2, WorkloadOptions(input_len=1000), tok)
    for s in long:
        assert 950 <= len(tok.encode(s.turns[0], add_special_tokens=False)) <= 1100


def test_chunk_counting_only_when_asked(fake_server: tuple[str, list[dict[str, Any]]]) -> None:
    cfg = ClientConfig(
        base_url=fake_server[0], endpoint="chat", model="no-usage", count_chunks_without_usage=True
    )

    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False) as c:
            return await send_request(
                c, cfg, RequestSpec(messages=[{"role": "user", "content": "x"}])
            )

    r = asyncio.run(go())
    assert r.success and not r.usage_from_server and r.output_tokens == len(WORDS)


def test_open_loop_deadline_cancels_in_flight(
    fake_server: tuple[str, list[dict[str, Any]]],
) -> None:
    cfg = ClientConfig(base_url=fake_server[0], endpoint="chat", model="ok")
    sessions = build_sessions("questions", 6, WorkloadOptions())

    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False) as c:
            spec = LoadSpec(
                num_requests=6, max_duration_s=0.4, concurrency=None, request_rate=100.0
            )
            return await run_load(c, cfg, sessions, spec, False)

    res = asyncio.run(go())
    # Every request takes ~0.6 s and all arrive within ~0.1 s: all are cut off.
    assert res.hit_deadline and res.results == [] and res.cancelled == 6
    assert res.duration_s < 1.0


def test_conversations_share_the_system_prompt_and_keep_their_history() -> None:
    from loadtest.workloads import load_system_prompt

    sessions = build_sessions("conversations", 6, WorkloadOptions(num_turns=3, seed=4))
    assert len(sessions) == 2 and all(len(s.turns) == 3 for s in sessions)
    first = [s.request(0, "chat").messages for s in sessions]
    assert all(
        m is not None and m[0] == {"role": "system", "content": load_system_prompt()} for m in first
    )
    assert first[0] != first[1]  # each conversation has its own opening question
    sessions[0].record_answer(0, "an answer")
    second = sessions[0].request(1, "chat").messages
    assert second is not None and second[:3] == [
        *first[0][:2],
        {"role": "assistant", "content": "an answer"},
    ]


def test_compare_passes_peer_args_to_llama_server(tmp_path: Path) -> None:
    """--peer-arg reaches llama-server's command line, after the harness's own flags."""
    import argparse

    from loadtest.compare import add_compare_args, peer_spec

    p = argparse.ArgumentParser()
    add_compare_args(p)
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    a = p.parse_args(["--peer-bin", str(fake), "--peer-arg=--no-repack", "--peer-arg=-fa"])
    spec = peer_spec(a, tmp_path / "m.gguf")
    assert spec.argv[0] == str(fake) and spec.argv[-2:] == ["--no-repack", "-fa"]
    assert spec.argv[spec.argv.index("-np") + 1] == "32"
