"""ITL of running streams while a long prompt arrives: chunked prefill on vs off.

For each server configuration (started here, on a free loopback port, and
stopped afterwards): open ``--streams`` streaming chat requests (``--max-tokens``
each, ``ignore_eos``), wait until every stream has produced ``--warm-tokens``
tokens, then send one ~``--long-tokens``-token prompt (max_tokens 1). The
*window* runs from sending the long prompt until its response arrives (its
prefill is done). Reported per configuration: inter-token latency p50 / p99 /
max of the streams' gaps that end inside the window, the same over the whole
run, and the long prompt's latency.

Usage (from the repository root, venv active)::

    python -m loadtest.itl_long_prompt --output loadtest/results/itl_long_prompt.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.compare import ours_spec, running
from loadtest.metrics import percentile
from loadtest.report import bench_record, write_json
from loadtest.workloads import default_gguf, load_questions, load_system_prompt

# (name, extra server flags). Without chunking the budget must hold the whole
# prompt: the scheduler never splits a prompt then, and a prompt larger than
# the budget only runs in a step of its own, which never comes while decodes run.
DEFAULT_CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("chunked-512", ("--max-num-batched-tokens", "512")),
    ("unchunked", ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192")),
)


@dataclass
class StreamTimes:
    """Arrival times (perf_counter seconds) of one stream's content chunks."""

    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def long_text(approx_tokens: int) -> str:
    """About ``approx_tokens`` tokens of real text (bundled data, ~4 characters a token)."""
    parts = [load_system_prompt(), *load_questions()]
    text = ""
    i = 0
    while len(text) < approx_tokens * 4:
        text += parts[i % len(parts)] + "\n\n"
        i += 1
    return text[: approx_tokens * 4]


async def stream_chat(
    client: httpx.AsyncClient, payload: dict[str, Any], times: StreamTimes
) -> None:
    """Send a streaming chat request, appending each content chunk's arrival time to ``times``."""
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content"):
                    times.token_times.append(time.perf_counter())
                if c.get("finish_reason"):
                    times.finish_reason = c["finish_reason"]


def _stats_ms(gaps: Sequence[float]) -> dict[str, float | int | None]:
    if not gaps:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "n": len(gaps),
        "p50_ms": round(percentile(gaps, 50) * 1000, 1),
        "p99_ms": round(percentile(gaps, 99) * 1000, 1),
        "max_ms": round(max(gaps) * 1000, 1),
    }


async def measure(base: str, a: argparse.Namespace) -> dict[str, Any]:
    """One configuration: the streams, the long prompt, the ITL statistics."""
    limits = httpx.Limits(max_connections=a.streams + 4)
    async with httpx.AsyncClient(base_url=base, timeout=a.timeout, limits=limits) as client:
        questions = load_questions()
        streams = [StreamTimes() for _ in range(a.streams)]
        tasks = [
            asyncio.create_task(
                stream_chat(
                    client,
                    {
                        "model": a.model,
                        "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                        "max_tokens": a.max_tokens,
                        "ignore_eos": True,
                        "temperature": 0,
                        "stream": True,
                    },
                    s,
                )
            )
            for i, s in enumerate(streams)
        ]
        while min(len(s.token_times) for s in streams) < a.warm_tokens:
            if any(t.done() for t in tasks):
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
            await asyncio.sleep(0.01)
        t_send = time.perf_counter()
        r = await client.post(
            "/v1/chat/completions",
            json={
                "model": a.model,
                "messages": [{"role": "user", "content": long_text(a.long_tokens)}],
                "max_tokens": 1,
                "temperature": 0,
            },
        )
        t_done = time.perf_counter()
        r.raise_for_status()
        long_prompt_tokens = r.json()["usage"]["prompt_tokens"]
        await asyncio.gather(*tasks)
    window: list[float] = []
    every: list[float] = []
    for s in streams:
        for prev, cur in zip(s.token_times, s.token_times[1:], strict=False):
            every.append(cur - prev)
            if t_send < cur <= t_done:
                window.append(cur - prev)
    return {
        "long_prompt_tokens": long_prompt_tokens,
        "long_prompt_latency_s": round(t_done - t_send, 2),
        "itl_window": _stats_ms(window),
        "itl_all": _stats_ms(every),
        "stream_tokens": [len(s.token_times) for s in streams],
        "finish_reasons": sorted({str(s.finish_reason) for s in streams}),
    }


def parse_config(text: str) -> tuple[str, tuple[str, ...]]:
    """``name=--flag value --flag2`` -> (name, flags)."""
    name, _, flags = text.partition("=")
    return name, tuple(flags.split())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument(
        "--warm-tokens", type=int, default=5, help="tokens per stream before the long prompt"
    )
    p.add_argument("--long-tokens", type=int, default=6000, help="approximate long-prompt length")
    p.add_argument("--model-len", type=int, default=8192, help="--max-model-len of the servers")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument(
        "--config",
        action="append",
        type=parse_config,
        help="NAME=FLAGS (repeatable); default: chunked-512 and unchunked",
    )
    p.add_argument("--output", type=Path, help="write the JSON record here")
    p.add_argument("--log-dir", type=Path, default=Path("loadtest/results/logs"))
    a = p.parse_args(argv)
    a.model = "smol"
    configs = a.config or list(DEFAULT_CONFIGS)
    results: dict[str, Any] = {}
    for name, flags in configs:
        extra = ["--served-model-name", a.model, "--max-model-len", str(a.model_len), *flags]
        spec = ours_spec(default_gguf(), extra)
        with running(spec, a.log_dir / f"itl-{name}.log", timeout_s=300) as base:
            res = asyncio.run(measure(base, a))
        res["server_flags"] = list(flags)
        results[name] = res
        print(f"{name}: {json.dumps(res)}", flush=True)
    record = bench_record("itl_long_prompt", a, {"config", "output", "log_dir"}, results=results)
    if a.output:
        write_json(a.output, record)
    return 0


__all__ = ["StreamTimes", "long_text", "main", "measure", "stream_chat"]

if __name__ == "__main__":
    raise SystemExit(main())
