"""Streaming OpenAI client: sends one request, timestamps its SSE events.

Every request asks for ``stream_options.include_usage`` so output tokens come
from the server's own ``usage`` count. A stream without usage, an HTTP error, a
``data: {"error": ...}`` event, a connection error or a stream that ends
without ``data: [DONE]`` all produce a failed RequestResult with the reason;
nothing is dropped. (``ClientConfig.count_chunks_without_usage`` is the one,
explicit, exception for servers that never send usage.)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from loadtest.metrics import RequestResult

Endpoint = Literal["chat", "completions"]
ENDPOINT_PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}


@dataclass
class RequestSpec:
    """One request: ``messages`` for chat, ``prompt`` for completions.

    ``max_tokens`` is None to leave the limit to the server. ``ignore_eos`` is
    sent only when True (it is an extension that vLLM, llama.cpp and Fuel Serve
    accept).
    """

    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    extra_body: dict[str, Any] | None = None  # more body fields (e.g. cache_salt)


@dataclass
class ClientConfig:
    """Where and how to send requests. ``base_url`` has no trailing slash."""

    base_url: str
    endpoint: Endpoint
    model: str
    api_key: str | None = None
    # Servers that ignore stream_options (llama-cpp-python's) send no usage. Only
    # when this is set is such a stream accepted, counting one token per content
    # chunk; the result then says usage_from_server=False.
    count_chunks_without_usage: bool = False

    def headers(self) -> dict[str, str]:
        h = {"Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


def build_payload(cfg: ClientConfig, spec: RequestSpec) -> dict[str, Any]:
    """The JSON body for ``spec``; raises ValueError if it lacks the endpoint's input."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": spec.temperature,
    }
    if cfg.endpoint == "chat":
        if spec.messages is None:
            raise ValueError("the chat endpoint needs messages")
        body["messages"] = spec.messages
    else:
        if spec.prompt is None:
            raise ValueError("the completions endpoint needs a prompt")
        body["prompt"] = spec.prompt
    if spec.max_tokens is not None:
        body["max_tokens"] = spec.max_tokens
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.extra_body:
        body.update(spec.extra_body)
    return body


def _chunk_text(endpoint: str, choice: dict[str, Any]) -> str:
    """The generated text a streamed choice carries ('' for role-only/usage chunks)."""
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        # Reasoning models stream thoughts separately; they are generated tokens too.
        return str(delta.get("content") or "") + str(delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


async def send_request(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    spec: RequestSpec,
    start_offset_s: float = 0.0,
) -> RequestResult:
    """Send ``spec`` as a streaming request and time it.

    TTFT is measured to the first chunk carrying generated text; ITL entries are
    the gaps between successive such chunks; E2E latency ends when ``[DONE]``
    arrives. ``start_offset_s`` is stored as the request's start relative to the
    benchmark start. Never raises for server or network errors: they become a
    failed result. Cancellation (asyncio.CancelledError) propagates.
    """
    url = cfg.base_url + ENDPOINT_PATHS[cfg.endpoint]
    result = RequestResult(success=False, start_s=start_offset_s)
    body = build_payload(cfg, spec)
    text_parts: list[str] = []
    usage: dict[str, Any] | None = None
    done = False
    first_t: float | None = None
    last_t: float | None = None
    st = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=cfg.headers()) as resp:
            result.status_code = resp.status_code
            if resp.status_code != 200:
                raw = await resp.aread()
                result.error = f"HTTP {resp.status_code}: {raw.decode(errors='replace')[:300]}"
                result.latency_s = time.perf_counter() - st
                return result
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                line = line.strip()
                # Blank lines end events; ':' lines are SSE comments (keep-alives).
                if not line or line.startswith(":"):
                    continue
                if not line.startswith("data:"):
                    continue  # "event:", "id:", "retry:" fields carry no payload here
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    done = True
                    result.latency_s = now - st
                    break
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    result.error = f"malformed SSE data: {data[:200]}"
                    result.latency_s = now - st
                    return result
                if not isinstance(event, dict):
                    result.error = f"unexpected SSE data: {data[:200]}"
                    result.latency_s = now - st
                    return result
                if "error" in event:
                    result.error = "stream error: " + _error_message(event["error"])
                    result.latency_s = now - st
                    return result
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    if choice.get("finish_reason"):
                        result.finish_reason = str(choice["finish_reason"])
                    text = _chunk_text(cfg.endpoint, choice)
                    if not text:
                        continue
                    if first_t is None:
                        first_t = now
                        result.ttft_s = now - st
                    else:
                        assert last_t is not None
                        result.itl_s.append(now - last_t)
                    last_t = now
                    text_parts.append(text)
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        result.latency_s = time.perf_counter() - st
        return result
    result.generated_text = "".join(text_parts)
    if not done:
        result.error = "stream ended without data: [DONE]"
        result.latency_s = time.perf_counter() - st
        return result
    if usage is None:
        if not cfg.count_chunks_without_usage:
            result.error = "the stream carried no usage (stream_options.include_usage ignored?)"
            return result
        result.usage_from_server = False
        result.output_tokens = len(text_parts)
    else:
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        result.output_tokens = int(usage.get("completion_tokens") or 0)
    if first_t is None:
        # No TTFT exists; counting it as 0 would flatter the latency statistics.
        result.error = f"no content chunk arrived (usage: {result.output_tokens} tokens)"
        return result
    result.success = True
    return result
