"""The one generation pipeline chat and completions share.

build params (``sampling_params``, ``output_budget``, ``request_options``) ->
submit (``Generation``: one engine request per prompt, ``n`` choices each) ->
either stream SSE deltas (``Generation.stream``) or assemble the final answer
(``Generation.answer``). What differs between the two APIs, the shape of a
choice, is a ``ChoiceFormat`` (routes/chat.py, routes/completions.py).

Contracts:
- Engine validation and admission errors surface from each request's first
  output, which ``Generation.start`` pulls before any header is sent, so they
  get a real status; if one prompt of several is refused, all are aborted.
- Choice ``i`` of prompt ``k`` has the response index ``k * n + i``.
- Every engine request is closed however the HTTP request ends (answered,
  failed, client gone): an unfinished one is aborted in the engine, which
  frees its KV blocks; metrics and the per-request log line are recorded once.
- A client that disconnects gets its requests aborted at once, streaming
  (``SSEResponse``) or not (``run_until_disconnect``).
- An error after the headers went out ends the stream with one OpenAI error
  event and ``[DONE]``; it never leaks internal detail.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from engine.client import EngineClient, JsonObject, JsonValue
from engine.errors import EngineUnavailableError
from engine.outputs import CompletionDelta, PositionLogprobs, RequestOutput
from engine.request import KVPolicyRequest, RequestOptions
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from server import __version__
from server.errors import ApiError, api_error_body, error_from_exception, retry_after
from server.metrics import Metrics
from server.protocol import SamplingFields
from server.schema_limits import check_schema_limits

logger = logging.getLogger("fuel_serve.server")

SYSTEM_FINGERPRINT = f"fuel-serve-{__version__}"

_T = TypeVar("_T")


# ---------------------------------------------------------------------------
# Build params
# ---------------------------------------------------------------------------


def request_options(body: SamplingFields) -> RequestOptions:
    """The request's options beyond sampling (vLLM's ``priority``, ``cache_salt``, ours)."""
    return RequestOptions(
        priority=body.priority,
        cache_salt=body.cache_salt,
        latency_budget_ms=body.latency_budget_ms,
        ttft_budget_ms=body.ttft_budget_ms,
        kv_policy=(
            KVPolicyRequest(
                type=body.kv_policy.type,
                budget_tokens=body.kv_policy.budget_tokens,
                sink_tokens=body.kv_policy.sink_tokens,
            )
            if body.kv_policy is not None
            else None
        ),
    )


def windowed(body: SamplingFields, engine: EngineClient) -> bool:
    """Whether the request runs under a KV policy (its own ``kv_policy`` or the
    server's ``--kv-policy``): its cache stays within the context whatever the
    lengths, so the context-length check does not apply (the engine refuses a
    policy that widens the server's)."""
    asked = body.kv_policy.type if body.kv_policy is not None else None
    if asked is not None:
        return asked != "full"
    return engine.execution_info.get("kv_policy", "full") != "full"


def request_budget(
    body: SamplingFields, requested: int | None, prompt_len: int, engine: EngineClient, where: str
) -> int:
    """``output_budget``, except under a KV policy: as asked, else one context's worth."""
    if windowed(body, engine):
        return requested if requested is not None else engine.max_model_len
    return output_budget(requested, prompt_len, engine.max_model_len, where)


def _context_error(max_len: int, prompt_len: int, budget: int, where: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt_len + budget} tokens ({prompt_len} in {where}, {budget} in the completion). "
        "Please reduce the length of the messages or completion.",
        param="messages" if where == "the messages" else "prompt",
        code="context_length_exceeded",
    )


def output_budget(requested: int | None, prompt_len: int, max_model_len: int, where: str) -> int:
    """Max new tokens: as asked (if it fits), else the room left in the window (vLLM)."""
    if requested is None:
        room = max_model_len - prompt_len
        if room < 1:
            raise _context_error(max_model_len, prompt_len, 0, where)
        return room
    if prompt_len + requested > max_model_len:
        raise _context_error(max_model_len, prompt_len, requested, where)
    return requested


def structured_from_response_format(body: SamplingFields) -> StructuredOutputSpec | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputSpec(json_object=True)
    assert rf.json_schema is not None  # the model validator guarantees it
    schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
    check_schema_limits(schema, "response_format.json_schema.schema")
    return StructuredOutputSpec(json_schema=schema)


def sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    structured: StructuredOutputSpec | None = None,
) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``body`` (400 naming a field it cannot take)."""
    if body.prompt_logprobs is not None and body.stream:
        # As vLLM: prompt logprobs come with the whole answer, not in a stream.
        raise ApiError(
            400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs"
        )
    params = SamplingParams(
        n=body.n,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=list(body.stop_token_ids or []),
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        structured=structured or structured_from_response_format(body),
    )
    if params.min_tokens > max_tokens:
        raise ApiError(
            400,
            f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens}).",
            param="min_tokens",
        )
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        text = str(exc)
        param = text.split(" ", 1)[0] if text else None
        raise ApiError(400, text, param=param) from None
    return params


# ---------------------------------------------------------------------------
# One engine request
# ---------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons -> OpenAI's. ``abort``/``error`` are not answers: raise."""
    if reason is None or reason in ("stop", "length"):
        return reason
    if reason == "abort":
        raise ApiError(503, "The request was aborted by the server.", headers=retry_after(5))
    raise ApiError(500, "The server had an error while generating the response.")


async def _shielded(coro: Awaitable[None]) -> None:
    """Run cleanup even inside a cancelled scope (a client disconnect cancels us)."""
    with anyio.CancelScope(shield=True):
        try:
            await coro
        except Exception:  # cleanup must not mask the original outcome
            logger.exception("cleanup failed")


class EngineStream:
    """One engine request: its output iterator, its first output (pulled before headers).

    Owns the engine request until ``close``: ``close`` aborts it if unfinished,
    records its metrics and logs one metadata-only line (never prompt or text).
    """

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        gen: AsyncIterator[RequestOutput],
        *,
        params: SamplingParams,
        metrics: Metrics | None,
        client_request_id: str,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.client_request_id = client_request_id  # the HTTP request's X-Request-Id
        self.gen = gen
        self.params = params
        self.metrics = metrics
        self.first: RequestOutput | None = None
        self.last: RequestOutput | None = None
        self.finished = False
        self.closed = False
        self.num_generated = 0
        self.token_times: list[float] = []
        self.finish_reason: str | None = None

    def _record(self, out: RequestOutput) -> None:
        self.last = out
        self.finished = out.finished
        new_tokens = sum(len(d.delta_token_ids) for d in out.outputs)
        if new_tokens:
            self.num_generated += new_tokens
            self.token_times.append(time.monotonic())
        for d in out.outputs:
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason

    async def start(self) -> None:
        """Pull the first output: raises what the engine refused the request with."""
        self.first = await self.gen.__anext__()
        self._record(self.first)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        assert self.first is not None, "start() first"
        yield self.first
        while not self.finished:
            out = await self.gen.__anext__()
            self._record(out)
            yield out

    def _observe(self, reason: str) -> None:
        if self.metrics is None or self.last is None:
            return
        try:
            self.metrics.observe_finished(
                self.last.metrics,
                len(self.last.prompt_token_ids),
                self.num_generated,
                reason,
                self.params.n,
                self.params.max_tokens,
                self.token_times,
            )
        except Exception:  # metrics must never fail a request
            logger.exception("observe_finished failed")

    def _log_finished(self, reason: str) -> None:
        if self.last is None:
            return
        m = self.last.metrics
        end = m.finished_time if m.finished_time is not None else time.monotonic()
        logger.info(
            "request %s finished",
            self.request_id,
            extra={
                "request_id": self.client_request_id,
                "engine_request_id": self.request_id,
                "prompt_tokens": len(self.last.prompt_token_ids),
                "completion_tokens": self.num_generated,
                "finish_reason": reason,
                "e2e_s": round(end - m.arrival_time, 6),
            },
        )

    async def close(self) -> None:
        """Abort in the engine if unfinished, record the request once, close the iterator."""
        if self.closed:
            return
        self.closed = True
        aborted = not self.finished
        reason = "abort" if aborted else (self.finish_reason or "stop")
        self._observe(reason)
        self._log_finished(reason)
        if aborted:
            self.finished = True
            await _shielded(self.engine.abort(self.request_id))
        if isinstance(self.gen, AsyncGenerator):
            await _shielded(self.gen.aclose())


async def merge(streams: Sequence[EngineStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: yields (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: EngineStream) -> None:
        try:
            async for out in s.outputs():
                await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# ---------------------------------------------------------------------------
# HTTP plumbing: SSE and disconnects
# ---------------------------------------------------------------------------


def sse(data: JsonValue) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class SSEResponse(Response):
    """Server-sent events that abort the engine request when the client leaves.

    Starlette's StreamingResponse may leave the body generator un-closed after a
    disconnect (until GC); here the generator is always closed, so its cleanup
    (``engine.abort``) runs at once.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncGenerator[str, None]) -> None:
        super().__init__(content=None, media_type=self.media_type)
        self.body_iterator = body
        # Response.__init__ declared the empty placeholder body's length; a stream has none.
        del self.headers["content-length"]
        self.headers["cache-control"] = "no-cache"
        self.headers["x-accel-buffering"] = "no"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status_code,
                        "headers": self.raw_headers,
                    }
                )
                async for chunk in self.body_iterator:
                    await send(
                        {"type": "http.response.body", "body": chunk.encode(), "more_body": True}
                    )
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                tg.cancel_scope.cancel()
        except OSError:
            pass  # the client went away mid-write
        finally:
            await _shielded(self.body_iterator.aclose())


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client goes away (``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(
    request: Request, work: Coroutine[None, None, _T], streams: Sequence[EngineStream]
) -> _T:
    """Await ``work``; if the client disconnects first, abort ``streams``."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    for s in streams:
        await s.close()
    logger.info("client disconnected; aborted %s", [s.request_id for s in streams])
    # Nobody reads this, but the ASGI server needs a response to finish the cycle.
    raise ApiError(499, "Client closed the request.")


# ---------------------------------------------------------------------------
# Choices: what the APIs share, and what each formats its own way
# ---------------------------------------------------------------------------


@dataclass
class ChoiceState:
    """One output choice, accumulated for the final (non-streamed) answer."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text.append(delta.delta_text)
        self.num_tokens += len(delta.delta_token_ids)
        self.token_ids.extend(delta.delta_token_ids)
        if delta.delta_logprobs:
            self.logprobs.extend(delta.delta_logprobs)
        if delta.finish_reason is not None:
            self.finish_reason = finish_reason(delta.finish_reason)
            self.stop_reason = delta.stop_reason


class ChoiceFormat(ABC):
    """How one API shapes its choices (chat: messages and deltas; completions: text).

    One instance per HTTP request; it may keep per-choice state (incremental
    tool-call parsers, text offsets). ``index`` is the response's choice index.
    """

    object_name: str  # "chat.completion" / "text_completion"
    chunk_object_name: str  # "chat.completion.chunk" / "text_completion"
    # Whether stream chunks carry ``"usage": null`` before the usage chunk
    # (include_usage): chat's chunk schema has a nullable usage, completions' none.
    null_usage_in_chunks: bool

    @abstractmethod
    def prelude(self) -> list[JsonObject]:
        """Choices streamed before anything is generated (chat's role, an echoed prompt)."""

    @abstractmethod
    def stream_choice(
        self, index: int, delta: CompletionDelta, finish: str | None
    ) -> JsonObject | None:
        """The streamed choice for ``delta`` (``finish`` already mapped); None: send nothing."""

    @abstractmethod
    def final_choice(self, choice: ChoiceState) -> JsonObject:
        """A finished choice of the non-streamed answer."""

    def final_fields(self) -> JsonObject:
        """Top-level fields of the non-streamed answer beyond OpenAI's (vLLM extensions)."""
        return {}


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> JsonObject:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class Generation:
    """The engine requests of one HTTP request: one per prompt, ``n`` choices each."""

    streams: list[EngineStream]
    n: int
    prompt_lens: list[int]
    response_id: str
    model: str
    include_usage: bool
    created: int = 0
    cached: list[int] = field(default_factory=list)  # prefix-cache hits per prompt
    # Extension fields merged into ``usage`` (e.g. ``context_compression``) and
    # headers every response of this generation carries, streamed or not.
    usage_extra: JsonObject = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def submit(
        cls,
        engine: EngineClient,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        options: RequestOptions,
        *,
        metrics: Metrics | None,
        client_request_id: str,
        response_id: str,
        model: str,
        include_usage: bool,
    ) -> Generation:
        """One engine request per ``(engine request id, prompt ids, params)``; call ``start``."""
        streams = [
            EngineStream(
                engine,
                rid,
                engine.generate(ids, params, rid, options),
                params=params,
                metrics=metrics,
                client_request_id=client_request_id,
            )
            for rid, ids, params in requests
        ]
        return cls(
            streams=streams,
            n=requests[0][2].n,
            prompt_lens=[len(ids) for _, ids, _ in requests],
            response_id=response_id,
            model=model,
            include_usage=include_usage,
            cached=[0] * len(requests),
        )

    async def start(self) -> None:
        """Pull each request's first output; on any failure abort them all and re-raise."""
        try:
            for s in self.streams:
                await s.start()
        except BaseException:
            await self.close()
            raise
        self.created = int(time.time())

    async def close(self) -> None:
        for s in self.streams:
            await s.close()

    def _envelope(self, object_name: str, choices: list[JsonObject]) -> JsonObject:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }

    def _usage(self, completion_tokens: int) -> JsonObject:
        return {
            **usage(sum(self.prompt_lens), completion_tokens, sum(self.cached)),
            **self.usage_extra,
        }

    async def _deltas(self) -> AsyncIterator[tuple[int, CompletionDelta]]:
        """Every choice's deltas as they come, with the choice's response index."""
        async for si, out in merge(self.streams):
            self.cached[si] = max(self.cached[si], out.num_cached_tokens)
            for d in out.outputs:
                yield si * self.n + d.index, d

    # ----------------------------------------------------------- streamed

    def stream(self, fmt: ChoiceFormat) -> SSEResponse:
        response = SSEResponse(self._events(fmt))
        response.headers.update(self.headers)
        return response

    def _chunk(self, fmt: ChoiceFormat, choices: list[JsonObject]) -> JsonObject:
        data = self._envelope(fmt.chunk_object_name, choices)
        if self.include_usage and fmt.null_usage_in_chunks:
            data["usage"] = None
        return data

    async def _events(self, fmt: ChoiceFormat) -> AsyncGenerator[str, None]:
        completion_tokens = 0
        try:
            for choice in fmt.prelude():
                yield sse(self._chunk(fmt, [choice]))
            async for index, d in self._deltas():
                completion_tokens += len(d.delta_token_ids)
                streamed = fmt.stream_choice(index, d, finish_reason(d.finish_reason))
                if streamed is not None:
                    yield sse(self._chunk(fmt, [streamed]))
            if self.include_usage:
                final = self._chunk(fmt, [])
                final["usage"] = self._usage(completion_tokens)
                yield sse(final)
        except Exception as exc:
            err = error_from_exception(exc)
            if err.status >= 500 and not isinstance(exc, ApiError | EngineUnavailableError):
                logger.exception("error during stream %s", self.response_id)
            yield sse(api_error_body(err))
        finally:
            await self.close()
        yield SSE_DONE

    # ------------------------------------------------------- not streamed

    async def answer(self, request: Request, fmt: ChoiceFormat) -> JSONResponse:
        """The whole answer at once (the requests are aborted if the client leaves)."""
        body = await run_until_disconnect(request, self._collect(fmt), self.streams)
        return JSONResponse(status_code=200, content=body, headers=self.headers)

    async def _collect(self, fmt: ChoiceFormat) -> JsonObject:
        choices = {i: ChoiceState(i) for i in range(self.n * len(self.streams))}
        try:
            async for index, d in self._deltas():
                choices[index].add(d)
        finally:
            await self.close()
        body = self._envelope(fmt.object_name, [fmt.final_choice(c) for c in choices.values()])
        body["usage"] = self._usage(sum(c.num_tokens for c in choices.values()))
        body.update(fmt.final_fields())
        return body
