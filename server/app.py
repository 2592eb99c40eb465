"""The OpenAI-compatible FastAPI app: ``build_app(engine, server_config) -> FastAPI``.

Contracts:
- Every failure answers OpenAI's envelope ``{"error": {message, type, param, code}}``.
- Engine validation / admission errors surface from the first ``__anext__`` of
  ``engine.generate``; we pull it before sending headers so they get a real status.
- A client that goes away (streaming or not) gets its request aborted in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import jsonschema
import jsonschema.exceptions
import jsonschema.validators
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from engine.errors import EngineUnavailableError, InvalidRequestError, RequestRejectedError
from engine.outputs import PositionLogprobs, RequestOutput
from engine.request import RequestOptions
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from server import __version__
from server.config import ServerConfig
from server.middleware import FrontDoorMiddleware, FrontDoorState
from server.protocol import (
    DEFAULT_SAFE_TEMPLATE_KWARGS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_body,
    error_type_for_status,
)
from server.router_endpoints import install_router_endpoints
from server.traces import TraceNotFound, fetch_trace

logger = logging.getLogger("fuel_serve.server")

SYSTEM_FINGERPRINT = f"fuel-serve-{__version__}"
# OpenAI reports this for tokens whose logprob is -inf (JSON has no infinity).
MIN_LOGPROB = -9999.0


class EngineClient(Protocol):
    """What the app needs from ``engine.async_engine.AsyncEngine``."""

    tokenizer: Any
    model_name: str
    max_model_len: int
    log_prompts: bool
    traces_enabled: bool

    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]: ...
    async def abort(self, request_id: str) -> None: ...
    def get_stats(self) -> Any: ...
    def num_unfinished_requests(self) -> int: ...


class ApiError(Exception):
    """An error with an HTTP status, answered in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


@dataclass
class AppState:
    """Everything the routes share, hung on ``app.state.fuel`` (no module globals)."""

    config: ServerConfig
    front: FrontDoorState
    engine: EngineClient | None = None
    load_error: str | None = None
    metrics: Any = None
    started_at: int = field(default_factory=lambda: int(time.time()))


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=body, headers=headers)


def _error_response(err: ApiError) -> JSONResponse:
    body = error_body(err.message, error_type_for_status(err.status), err.param, err.code)
    return _json_response(err.status, body, err.headers)


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def _error_from_exception(exc: BaseException) -> ApiError:
    """Map engine exceptions (and our own) onto statuses."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestRejectedError):
        return ApiError(
            429, str(exc), code=exc.reason or "rate_limited", headers=_retry_after(exc.retry_after)
        )
    if isinstance(exc, EngineUnavailableError):
        return ApiError(503, str(exc), headers=_retry_after(exc.retry_after))
    return ApiError(500, "The server had an error while processing your request.")


_UNION_TAG_RE = re.compile(
    r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|.*\[.*\])$"
)


def _validation_message(errors: list[Any]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one message naming the field, and ``param``."""
    if not errors:
        return "Invalid request.", None
    # Union branches produce several errors; the explicit ones say the most.
    priority = {"extra_forbidden": 0, "json_invalid": 0, "value_error": 1, "missing": 2}
    err = sorted(errors, key=lambda e: priority.get(e.get("type", ""), 3))[0]
    loc = [
        str(part)
        for part in err.get("loc", ())
        if part != "body" and not (isinstance(part, str) and _UNION_TAG_RE.match(part))
    ]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {detail}".rstrip(": "), None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "finite_number":
        return f"{param}: must be a finite number (NaN and Infinity are not allowed)", param
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param
    if param is None:
        if kind.endswith("_type"):
            return "The request body must be a JSON object.", None
        return msg, None
    return f"{param}: {msg}", param


def _structured_from_response_format(body: SamplingFields) -> StructuredOutputSpec | None:
    rf = body.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputSpec(json_object=True)
    assert rf.json_schema is not None  # the model validator guarantees it
    schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
    return StructuredOutputSpec(json_schema=schema)


@dataclass
class ToolPlan:
    """How one chat request uses tools: what the template sees, how output is parsed.

    ``parser`` None: tools are not offered (``tool_choice: "none"``).
    ``structured``: a grammar forcing the call (``"required"`` or a named function).
    """

    tools: list[dict[str, Any]]
    parser: Any = None
    structured: StructuredOutputSpec | None = None
    parallel: bool = True


def _grammar_compiler(engine: Any) -> Any:
    """The engine's grammar compiler (AsyncEngine wraps LLMEngine, which owns it)."""
    for holder in (engine, getattr(engine, "engine", None)):
        compiler = getattr(holder, "grammar", None) if holder is not None else None
        if compiler is not None and hasattr(compiler, "build_tool_call_spec"):
            return compiler
    return None


def _check_tool_parameters(i: int, function: dict[str, Any]) -> None:
    """400 unless ``function.parameters`` is absent or a valid JSON Schema object.

    Checked for every ``tool_choice`` (as OpenAI does): a broken schema would
    otherwise only surface later, as unvalidatable arguments or a grammar error.
    """
    params = function.get("parameters")
    if params is None:
        return
    where = f"tools.{i}.function.parameters"
    name = function["name"]
    if not isinstance(params, dict):
        raise ApiError(400, f"tool {name!r}: parameters must be a JSON Schema object", param=where)
    cls = jsonschema.validators.validator_for(params)
    try:
        cls.check_schema(params)
    except jsonschema.exceptions.SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "<root>"
        raise ApiError(
            400,
            f"tool {name!r}: parameters is not a valid JSON Schema (at {path}): {exc.message}",
            param=where,
        ) from None


def resolve_tool_calling(
    engine: Any, body: ChatCompletionRequest, config: ServerConfig
) -> ToolPlan | None:
    """Validate ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and plan tool use.

    ``auto`` needs ``--enable-auto-tool-choice`` (as in vLLM); the parser is
    ``--tool-call-parser`` or inferred from the chat template. ``required`` and a
    named function are enforced by a grammar from ``engine/sampling/grammar.py``.
    """
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice requires tools.", param="tool_choice")
        if body.parallel_tool_calls is not None:
            raise ApiError(400, "parallel_tool_calls requires tools.", param="parallel_tool_calls")
        return None
    for i, tool in enumerate(body.tools):
        function = tool.get("function")
        if tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, "only function tools are supported", param=f"tools.{i}.type")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, "each tool needs function.name", param=f"tools.{i}.function.name")
        _check_tool_parameters(i, function)
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if choice == "none":
        return ToolPlan(tools=[])  # the model must not call tools: do not offer them
    if isinstance(choice, str) and choice not in ("auto", "required"):
        raise ApiError(400, f"unknown tool_choice {choice!r}", param="tool_choice")
    if choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise ApiError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
            param="tool_choice",
        )
    try:
        from server.tool_parsers import get_tool_parser, infer_tool_parser
    except ImportError:
        raise ApiError(400, "tool calling is not available in this build", param="tools") from None
    parser_name = config.tool_call_parser or infer_tool_parser(
        getattr(engine.tokenizer, "chat_template", None)
    )
    try:
        parser = get_tool_parser(parser_name, body.tools)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    parallel = body.parallel_tool_calls is not False
    plan = ToolPlan(tools=list(body.tools), parser=parser, parallel=parallel)
    if choice != "auto":
        if body.response_format is not None and body.response_format.type != "text":
            raise ApiError(
                400,
                "response_format cannot be combined with a forced tool_choice",
                param="response_format",
            )
        compiler = _grammar_compiler(engine)
        if compiler is None:
            raise ApiError(
                400, "forced tool calls need the engine's grammar support", param="tool_choice"
            )
        plan.structured = compiler.build_tool_call_spec(
            body.tools, choice, parser_name, parallel_tool_calls=parallel
        )
    return plan


def _log_invalid_calls(calls: list[Any], tools: list[dict[str, Any]]) -> None:
    """Log calls whose arguments do not follow their function's schema.

    As OpenAI does, such calls are still returned: the client owns its tools and
    judges them. Forced calls are grammar-generated, so a warning there is a bug.
    """
    from server.tool_parsers import validate_tool_calls

    for problem in validate_tool_calls(calls, tools):
        logger.warning("tool call does not validate: %s", problem)


def _log_invalid_streamed(deltas: list[Any], tools: list[dict[str, Any]]) -> None:
    """``_log_invalid_calls`` for the call deltas one streamed choice sent."""
    from server.tool_parsers import StreamDelta, assemble

    _log_invalid_calls(assemble([StreamDelta(tool_calls=deltas)]).tool_calls, tools)


def _tool_call_json(call: Any) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _tool_delta_json(delta: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": delta.index}
    function: dict[str, Any] = {"arguments": delta.arguments}
    if delta.id is not None:
        out["id"] = delta.id
        out["type"] = "function"
    if delta.name is not None:
        function["name"] = delta.name
    out["function"] = function
    return out


def _context_error(max_len: int, prompt_len: int, budget: int, where: str) -> ApiError:
    return ApiError(
        400,
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt_len + budget} tokens ({prompt_len} in {where}, {budget} in the completion). "
        "Please reduce the length of the messages or completion.",
        param="messages" if where == "the messages" else "prompt",
        code="context_length_exceeded",
    )


def _output_budget(requested: int | None, prompt_len: int, max_model_len: int, where: str) -> int:
    """Max new tokens: as asked (if it fits), else the room left in the window (vLLM)."""
    if requested is None:
        room = max_model_len - prompt_len
        if room < 1:
            raise _context_error(max_model_len, prompt_len, 0, where)
        return room
    if prompt_len + requested > max_model_len:
        raise _context_error(max_model_len, prompt_len, requested, where)
    return requested


def _request_options(body: SamplingFields) -> RequestOptions:
    return RequestOptions(
        priority=body.priority,
        cache_salt=body.cache_salt,
        latency_budget_ms=body.latency_budget_ms,
        ttft_budget_ms=body.ttft_budget_ms,
    )


def _sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    structured: StructuredOutputSpec | None = None,
) -> SamplingParams:
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
        structured=structured or _structured_from_response_format(body),
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


@dataclass
class _Choice:
    """Accumulated state of one output choice."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _finish_reason(reason: str | None) -> str | None:
    """Engine finish reasons -> OpenAI's. ``abort``/``error`` are not answers: raise."""
    if reason is None or reason in ("stop", "length"):
        return reason
    if reason == "abort":
        raise ApiError(503, "The request was aborted by the server.", headers=_retry_after(5))
    raise ApiError(500, "The server had an error while generating the response.")


async def _shielded(coro: Awaitable[None]) -> None:
    """Run cleanup even inside a cancelled scope (a client disconnect cancels us)."""
    with anyio.CancelScope(shield=True):
        try:
            await coro
        except Exception:  # cleanup must not mask the original outcome
            logger.exception("cleanup failed")


class _Stream:
    """One engine request: the generator plus its first output (pulled before headers)."""

    def __init__(
        self,
        engine: EngineClient,
        request_id: str,
        gen: AsyncIterator[RequestOutput],
        *,
        params: SamplingParams | None = None,
        metrics: Any = None,
        client_request_id: str | None = None,
    ):
        self.engine = engine
        self.request_id = request_id
        # The X-Request-Id of the HTTP request (logged with the engine id).
        self.client_request_id = client_request_id
        self.logged = False
        self.gen = gen
        self.first: RequestOutput | None = None
        self.finished = False
        # For Metrics.observe_finished (server/metrics.py), when metrics are on.
        self.params = params
        self.metrics = metrics
        self.last: RequestOutput | None = None
        self.num_generated = 0
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.observed = False

    def _record(self, out: RequestOutput) -> None:
        self.last = out
        new_tokens = sum(len(d.delta_token_ids) for d in out.outputs)
        if new_tokens:
            self.num_generated += new_tokens
            self.token_times.append(time.monotonic())
        for d in out.outputs:
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason

    async def start(self) -> None:
        self.first = await self.gen.__anext__()
        self.finished = self.first.finished
        self._record(self.first)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        assert self.first is not None
        yield self.first
        while not self.finished:
            out = await self.gen.__anext__()
            self.finished = out.finished
            self._record(out)
            yield out

    def _observe(self, aborted: bool) -> None:
        if self.metrics is None or self.observed or self.last is None:
            return
        self.observed = True
        try:
            self.metrics.observe_finished(
                self.last.metrics,
                len(self.last.prompt_token_ids),
                self.num_generated,
                "abort" if aborted else (self.finish_reason or "stop"),
                self.params.n if self.params else 1,
                self.params.max_tokens if self.params else None,
                self.token_times,
            )
        except Exception:  # metrics must never fail a request
            logger.exception("observe_finished failed")

    def _log_finished(self, aborted: bool) -> None:
        """One metadata-only line per admitted engine request (never prompt or output text)."""
        if self.logged or self.last is None:
            return
        self.logged = True
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
                "finish_reason": "abort" if aborted else (self.finish_reason or "stop"),
                "e2e_s": round(end - m.arrival_time, 6),
            },
        )

    async def close(self) -> None:
        """Abort in the engine if unfinished, and close the generator."""
        aborted = not self.finished
        self._observe(aborted)
        self._log_finished(aborted)
        if aborted:
            self.finished = True
            await _shielded(self.engine.abort(self.request_id))
        aclose = getattr(self.gen, "aclose", None)
        if aclose is not None:
            await _shielded(aclose())


async def _start_streams(streams: list[_Stream]) -> None:
    """Pull each request's first output; on any failure abort them all and re-raise."""
    try:
        for s in streams:
            await s.start()
    except BaseException:
        for s in streams:
            await s.close()
        raise


async def _merge(streams: list[_Stream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: yields (stream index, output)."""
    if len(streams) == 1:
        async for out in streams[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, s: _Stream) -> None:
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


async def _wait_for_disconnect(request: Request) -> None:
    """Return when the client goes away (``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _SSEResponse(Response):
    """Server-sent events that abort the engine request when the client leaves.

    Starlette's StreamingResponse may leave the body generator un-closed after a
    disconnect (until GC); here the generator is always closed, so its cleanup
    (``engine.abort``) runs at once.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        super().__init__(content=None, headers=headers, media_type=self.media_type)
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
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await _shielded(aclose())


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, allow_nan=False)}\n\n"


# ---------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------


def build_app(
    engine: EngineClient | None,
    server_config: ServerConfig,
    *,
    engine_factory: Callable[[], EngineClient] | None = None,
) -> FastAPI:
    """Build the app around ``engine`` (started in the lifespan).

    With ``engine=None`` and an ``engine_factory``, the engine is built in a
    worker thread after the server starts listening, and ``/health`` answers
    503 until it is ready (so orchestrators see "loading", not "down").
    """
    if engine is None and engine_factory is None:
        raise ValueError("build_app needs an engine or an engine_factory")
    state = AppState(config=server_config, front=FrontDoorState(), engine=None)

    async def load_engine() -> None:
        try:
            built = engine if engine is not None else await asyncio.to_thread(engine_factory)  # type: ignore[arg-type]
            await built.start()
            state.metrics = _make_metrics(_served_names(server_config, built)[0])
            describe = getattr(built, "describe", None)
            if callable(describe):
                logger.info("engine ready: %s", describe())
            state.engine = built
        except Exception as exc:  # the server keeps answering 503 with the reason
            logger.exception("engine failed to load")
            state.load_error = f"{type(exc).__name__}: {exc}"

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loader: asyncio.Task[None] | None = None
        if engine is not None:
            await load_engine()
        else:
            loader = asyncio.ensure_future(load_engine())
        try:
            yield
        finally:
            state.front.draining = True
            if loader is not None and not loader.done():
                loader.cancel()
            if state.engine is not None:
                await state.engine.shutdown()

    app = FastAPI(title="Fuel Serve", version=__version__, lifespan=lifespan)
    app.state.fuel = state
    app.add_middleware(
        FrontDoorMiddleware,  # type: ignore[arg-type]
        state=state.front,
        api_key=server_config.api_key,
        max_body_bytes=server_config.max_body_bytes,
        retry_after_draining_s=server_config.retry_after_draining_s,
    )
    _install_error_handlers(app, state)
    _install_routes(app, state)
    install_router_endpoints(app, state)
    return app


def _make_metrics(model_name: str) -> Any:
    try:
        from server.metrics import Metrics  # written by another engineer
    except ImportError:
        return None
    return Metrics(model_name)


def _served_names(config: ServerConfig, engine: EngineClient) -> list[str]:
    return list(config.served_model_name) or [engine.model_name]


def _install_error_handlers(app: FastAPI, state: AppState) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        logger.info(
            "%s %s -> %d",
            request.method,
            request.url.path,
            exc.status,
            extra={
                "request_id": request.scope.get("state", {}).get("request_id"),
                "status": exc.status,
                "code": exc.code,
            },
        )
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(exc.errors()))
        return _error_response(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None
        return _error_response(
            ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        )

    async def engine_error(_: Request, exc: Exception) -> JSONResponse:
        err = _error_from_exception(exc)
        if isinstance(exc, RequestRejectedError) and state.metrics is not None:
            state.metrics.observe_rejection(exc.reason)
        return _error_response(err)

    for exc_type in (InvalidRequestError, RequestRejectedError, EngineUnavailableError):
        app.add_exception_handler(exc_type, engine_error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(
            ApiError(500, "The server had an error while processing your request.")
        )


def _install_routes(app: FastAPI, state: AppState) -> None:
    config = state.config

    def ready_engine() -> EngineClient:
        if state.engine is None:
            detail = f" ({state.load_error})" if state.load_error else ""
            raise ApiError(503, f"The model is still loading{detail}.", headers=_retry_after(5))
        if state.front.draining:
            raise ApiError(503, "The server is shutting down.", headers=_retry_after(5))
        return state.engine

    def check_model(engine: EngineClient, model: str | None) -> str:
        names = _served_names(config, engine)
        if model is None:
            return names[0]
        if model not in names:
            raise ApiError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return model

    def request_id(request: Request) -> str:
        return str(request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex)

    def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if not kwargs:
            return None
        try:
            from engine.text.tokenizer import SAFE_TEMPLATE_KWARGS as allowed
        except ImportError:
            allowed = DEFAULT_SAFE_TEMPLATE_KWARGS
        for key in kwargs:
            if key not in allowed:
                raise ApiError(
                    400,
                    f"chat_template_kwargs key {key!r} is not allowed "
                    f"(allowed: {', '.join(sorted(allowed))}).",
                    param="chat_template_kwargs",
                )
        return dict(kwargs)

    async def render_chat(
        engine: EngineClient,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        def run() -> list[int]:
            return list(
                engine.tokenizer.apply_chat_template(
                    messages,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    template_kwargs=kwargs,
                    continue_final_message=continue_final_message,
                )
            )

        try:
            return await asyncio.to_thread(run)
        except (InvalidRequestError, ApiError):
            raise
        except Exception as exc:  # template errors are the request's fault (bad roles/order)
            raise ApiError(
                400, f"Could not apply the chat template: {exc}", param="messages"
            ) from None

    def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
        for tok in ids:
            if not 0 <= tok < vocab_size:
                raise ApiError(
                    400,
                    f"token id {tok} is out of range for vocabulary size {vocab_size}",
                    param=param,
                )

    def token_str(engine: EngineClient, token_id: int) -> str:
        return str(engine.tokenizer.token_to_text(token_id))

    def chat_logprob_entry(engine: EngineClient, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": token_str(engine, token_id),
            "logprob": max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB,
            "bytes": list(engine.tokenizer.token_bytes(token_id)),
        }

    def chat_logprobs(
        engine: EngineClient, positions: list[PositionLogprobs], top_k: int
    ) -> list[dict[str, Any]]:
        out = []
        for pos in positions:
            entry = chat_logprob_entry(engine, pos.chosen.token_id, pos.chosen.logprob)
            entry["top_logprobs"] = [
                chat_logprob_entry(engine, alt.token_id, alt.logprob) for alt in pos.top[:top_k]
            ]
            out.append(entry)
        return out

    def completion_logprobs(
        engine: EngineClient,
        positions: list[PositionLogprobs | None],
        token_ids: list[int],
        start_offset: int,
        top_k: int,
    ) -> tuple[dict[str, Any], int]:
        """Completions-style logprobs; returns it and the text offset after it."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        offset = start_offset
        for tok_id, pos in zip(token_ids, positions):
            text = token_str(engine, tok_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            if pos is None:  # the first prompt token has no logprob
                token_logprobs.append(None)
                tops.append(None)
                continue
            token_logprobs.append(max(pos.chosen.logprob, MIN_LOGPROB))
            tops.append(
                {
                    token_str(engine, a.token_id): max(a.logprob, MIN_LOGPROB)
                    for a in pos.top[:top_k]
                }
            )
        return (
            {
                "tokens": tokens,
                "token_logprobs": token_logprobs,
                "top_logprobs": tops,
                "text_offset": offsets,
            },
            offset,
        )

    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def run_until_disconnect(
        request: Request, work: Awaitable[Any], streams: list[_Stream]
    ) -> Any:
        """Await ``work``; if the client disconnects first, abort ``streams``."""
        work_task = asyncio.ensure_future(work)
        watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait(
                {work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED
            )
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

    def log_prompt(rid: str, prompt: Any) -> None:
        if state.engine is not None and state.engine.log_prompts:
            logger.info("request %s prompt=%r", rid, prompt)

    # ----------------------------------------------------------------- chat

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        engine = ready_engine()
        model = check_model(engine, body.model)
        plan = resolve_tool_calling(engine, body, config)
        kwargs = template_kwargs(body.chat_template_kwargs)
        messages = [m.to_template_dict() for m in body.messages]
        offered = plan.tools if plan is not None and plan.tools else None
        prompt_ids = await render_chat(
            engine,
            messages,
            body.add_generation_prompt,
            kwargs,
            tools=offered,
            continue_final_message=body.continue_final_message,
        )
        vocab = int(engine.tokenizer.vocab_size)
        budget = _output_budget(
            body.output_budget(), len(prompt_ids), engine.max_model_len, "the messages"
        )
        top_k = body.top_logprobs or 0
        params = _sampling_params(
            body,
            max_tokens=budget,
            logprobs=top_k if body.logprobs else None,
            prompt_logprobs=None,
            vocab_size=vocab,
            structured=plan.structured if plan is not None else None,
        )
        rid_base = request_id(request)
        engine_rid = f"{rid_base}-{uuid.uuid4().hex[:8]}"
        log_prompt(engine_rid, messages)
        stream = _Stream(
            engine,
            engine_rid,
            params=params,
            metrics=state.metrics,
            client_request_id=rid_base,
            gen=engine.generate(
                prompt_ids,
                params,
                engine_rid,
                _request_options(body),
            ),
        )
        await _start_streams([stream])
        # Response id = prefix + engine request id: GET /v1/traces/{id} maps back statelessly.
        response_id = f"chatcmpl-{engine_rid}"
        created = int(time.time())
        echo_prefix = ""
        if body.echo and body.messages[-1].role == "assistant":
            echo_prefix = body.messages[-1].text()
        headers: dict[str, str] = {}  # X-Request-Id is added by the middleware

        if body.stream:
            gen = chat_stream(
                engine,
                stream,
                body,
                model,
                response_id,
                created,
                len(prompt_ids),
                echo_prefix,
                top_k,
                plan,
            )
            return _SSEResponse(gen, headers=headers)

        async def collect() -> dict[str, Any]:
            choices = {i: _Choice(i) for i in range(body.n)}
            cached = 0
            try:
                async for _, out in _merge([stream]):
                    cached = max(cached, out.num_cached_tokens)
                    for d in out.outputs:
                        c = choices[d.index]
                        c.text.append(d.delta_text)
                        c.num_tokens += len(d.delta_token_ids)
                        if d.delta_logprobs:
                            c.logprobs.extend(d.delta_logprobs)
                        if d.finish_reason is not None:
                            c.finish_reason = _finish_reason(d.finish_reason)
                            c.stop_reason = d.stop_reason
            finally:
                await stream.close()
            return {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [
                    {
                        "index": c.index,
                        **chat_message(echo_prefix + "".join(c.text), c.finish_reason, plan),
                        "logprobs": (
                            {"content": chat_logprobs(engine, c.logprobs, top_k), "refusal": None}
                            if body.logprobs
                            else None
                        ),
                        "stop_reason": c.stop_reason,
                    }
                    for c in choices.values()
                ],
                "usage": usage(
                    len(prompt_ids), sum(c.num_tokens for c in choices.values()), cached
                ),
            }

        result = await run_until_disconnect(request, collect(), [stream])
        return _json_response(200, result, headers)

    def chat_message(text: str, finish: str | None, plan: ToolPlan | None) -> dict[str, Any]:
        """``message`` and ``finish_reason`` of a finished choice, tool calls parsed out."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish_reason = finish or "stop"
        if plan is not None and plan.parser is not None:
            parsed = plan.parser.parse(text)
            calls = parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
            if calls:
                _log_invalid_calls(calls, plan.tools)
                message["content"] = parsed.content
                message["tool_calls"] = [_tool_call_json(call) for call in calls]
                if finish_reason == "stop":
                    finish_reason = "tool_calls"
        return {"message": message, "finish_reason": finish_reason}

    async def chat_stream(
        engine: EngineClient,
        stream: _Stream,
        body: ChatCompletionRequest,
        model: str,
        response_id: str,
        created: int,
        prompt_len: int,
        echo_prefix: str,
        top_k: int,
        plan: ToolPlan | None,
    ) -> AsyncIterator[str]:
        include_usage = body.include_usage()
        # One incremental tool-call parser per choice; content it holds back (a
        # possible call opening) is released or turned into tool_calls deltas.
        parsers = (
            {i: plan.parser.stream() for i in range(body.n)}
            if plan is not None and plan.parser is not None
            else {}
        )
        has_calls: set[int] = set()
        sent_calls: dict[int, list[Any]] = {}  # call deltas sent, validated at finish

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            data: dict[str, Any] = {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices,
            }
            if include_usage:
                data["usage"] = None
            return data

        completion_tokens = 0
        cached = 0
        try:
            for i in range(body.n):
                yield _sse(
                    chunk(
                        [
                            {
                                "index": i,
                                "delta": {"role": "assistant", "content": echo_prefix},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                )
            async for _, out in _merge([stream]):
                cached = max(cached, out.num_cached_tokens)
                for d in out.outputs:
                    completion_tokens += len(d.delta_token_ids)
                    finish = _finish_reason(d.finish_reason)
                    delta: dict[str, Any] = {}
                    if parsers:
                        parser = parsers[d.index]
                        pieces = [parser.feed(d.delta_text)] if d.delta_text else []
                        if finish is not None:
                            pieces.append(parser.finish())
                        content = "".join(p.content for p in pieces)
                        calls = [c for p in pieces for c in p.tool_calls]
                        if plan is not None and not plan.parallel:
                            calls = [c for c in calls if c.index == 0]
                        if content:
                            delta["content"] = content
                        if calls:
                            has_calls.add(d.index)
                            sent_calls.setdefault(d.index, []).extend(calls)
                            delta["tool_calls"] = [_tool_delta_json(c) for c in calls]
                        if finish is not None and d.index in sent_calls and plan is not None:
                            _log_invalid_streamed(sent_calls.pop(d.index), plan.tools)
                        if finish == "stop" and d.index in has_calls:
                            finish = "tool_calls"
                    elif d.delta_text:
                        delta["content"] = d.delta_text
                    if not delta and finish is None and not d.delta_logprobs:
                        continue
                    choice: dict[str, Any] = {
                        "index": d.index,
                        "delta": delta,
                        "logprobs": (
                            {
                                "content": chat_logprobs(engine, d.delta_logprobs or [], top_k),
                                "refusal": None,
                            }
                            if body.logprobs
                            else None
                        ),
                        "finish_reason": finish,
                    }
                    if finish is not None:
                        choice["stop_reason"] = d.stop_reason
                    yield _sse(chunk([choice]))
            if include_usage:
                final = chunk([])
                final["usage"] = usage(prompt_len, completion_tokens, cached)
                yield _sse(final)
        except Exception as exc:
            err = _error_from_exception(exc)
            if err.status >= 500 and not isinstance(exc, ApiError | EngineUnavailableError):
                logger.exception("error during stream %s", stream.request_id)
            yield _sse(
                error_body(err.message, error_type_for_status(err.status), err.param, err.code)
            )
        finally:
            await stream.close()
        yield "data: [DONE]\n\n"

    # ----------------------------------------------------------- completions

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = ready_engine()
        model = check_model(engine, body.model)
        tok = engine.tokenizer
        vocab = int(tok.vocab_size)
        prompt = body.prompt
        prompt_texts: list[str | None]
        if isinstance(prompt, str):
            prompt_texts = [prompt]
        elif isinstance(prompt[0], str):
            prompt_texts = list(prompt)  # type: ignore[arg-type]
        else:
            prompt_texts = []
        if prompt_texts:
            texts = [p for p in prompt_texts if p is not None]
            prompts = await asyncio.to_thread(
                lambda: [list(tok.encode(p, add_special_tokens=True)) for p in texts]
            )
        else:
            prompts = [prompt] if isinstance(prompt[0], int) else list(prompt)  # type: ignore[list-item,arg-type]
            for i, ids in enumerate(prompts):
                check_token_ids(ids, vocab, "prompt" if len(prompts) == 1 else f"prompt.{i}")
            prompt_texts = [None] * len(prompts)
        for ids in prompts:
            if not ids:
                raise ApiError(400, "prompt must not be empty", param="prompt")
        top_k = body.logprobs or 0
        plans = []
        for ids in prompts:
            budget = _output_budget(
                body.output_budget(), len(ids), engine.max_model_len, "your prompt"
            )
            params = _sampling_params(
                body,
                max_tokens=budget,
                logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                vocab_size=vocab,
            )
            plans.append(params)
        rid_base = request_id(request)
        suffix = uuid.uuid4().hex[:8]
        streams = []
        for i, (ids, params) in enumerate(zip(prompts, plans)):
            engine_rid = f"{rid_base}-{suffix}-{i}"
            log_prompt(engine_rid, prompt_texts[i] if prompt_texts[i] is not None else ids)
            streams.append(
                _Stream(
                    engine,
                    engine_rid,
                    params=params,
                    metrics=state.metrics,
                    client_request_id=rid_base,
                    gen=engine.generate(
                        ids,
                        params,
                        engine_rid,
                        _request_options(body),
                    ),
                )
            )
        await _start_streams(streams)
        # Prompt k's engine id is f"{response id without cmpl-}-{k}" (GET /v1/traces).
        response_id = f"cmpl-{rid_base}-{suffix}"
        created = int(time.time())
        headers: dict[str, str] = {}  # X-Request-Id is added by the middleware
        echo_texts = [
            (pt if pt is not None else tok.decode(ids, skip_special_tokens=False))
            if body.echo
            else ""
            for pt, ids in zip(prompt_texts, prompts)
        ]

        def echo_logprobs(i: int) -> tuple[dict[str, Any], int]:
            """Logprobs of prompt i's tokens (echo + logprobs)."""
            first = streams[i].first
            positions: list[PositionLogprobs | None] = (
                list(first.prompt_logprobs)
                if first and first.prompt_logprobs
                else [None] * len(prompts[i])
            )
            return completion_logprobs(engine, positions, prompts[i], 0, top_k)

        if body.stream:
            return _SSEResponse(
                completion_stream(
                    engine,
                    streams,
                    body,
                    model,
                    response_id,
                    created,
                    prompts,
                    echo_texts,
                    echo_logprobs,
                    top_k,
                ),
                headers=headers,
            )

        async def collect() -> dict[str, Any]:
            n = body.n
            choices = {i: _Choice(i) for i in range(n * len(prompts))}
            cached = [0] * len(streams)
            try:
                async for si, out in _merge(streams):
                    cached[si] = max(cached[si], out.num_cached_tokens)
                    for d in out.outputs:
                        c = choices[si * n + d.index]
                        c.text.append(d.delta_text)
                        c.num_tokens += len(d.delta_token_ids)
                        if d.delta_logprobs:
                            c.logprobs.extend(d.delta_logprobs)
                        c.token_ids.extend(d.delta_token_ids)
                        if d.finish_reason is not None:
                            c.finish_reason = _finish_reason(d.finish_reason)
                            c.stop_reason = d.stop_reason
            finally:
                for s in streams:
                    await s.close()
            out_choices = []
            for idx, c in choices.items():
                si = idx // n
                logprobs = None
                if body.logprobs is not None:
                    offset = 0
                    merged: dict[str, list[Any]] = {
                        "tokens": [],
                        "token_logprobs": [],
                        "top_logprobs": [],
                        "text_offset": [],
                    }
                    if body.echo:
                        part, offset = echo_logprobs(si)
                        for k in merged:
                            merged[k].extend(part[k])
                    part, _ = completion_logprobs(
                        engine, list(c.logprobs), c.token_ids, offset, top_k
                    )
                    for k in merged:
                        merged[k].extend(part[k])
                    logprobs = merged
                out_choices.append(
                    {
                        "index": idx,
                        "text": echo_texts[si] + "".join(c.text),
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason or "stop",
                        "stop_reason": c.stop_reason,
                    }
                )
            return {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": out_choices,
                "usage": usage(
                    sum(len(p) for p in prompts),
                    sum(c.num_tokens for c in choices.values()),
                    sum(cached),
                ),
            }

        result = await run_until_disconnect(request, collect(), streams)
        return _json_response(200, result, headers)

    async def completion_stream(
        engine: EngineClient,
        streams: list[_Stream],
        body: CompletionRequest,
        model: str,
        response_id: str,
        created: int,
        prompts: list[list[int]],
        echo_texts: list[str],
        echo_logprobs: Callable[[int], tuple[dict[str, Any], int]],
        top_k: int,
    ) -> AsyncIterator[str]:
        include_usage = body.include_usage()
        n = body.n
        offsets = {}
        completion_tokens = 0
        cached = [0] * len(streams)

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            data: dict[str, Any] = {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices,
            }
            if include_usage:
                data["usage"] = None
            return data

        try:
            for si in range(len(streams)):
                for j in range(n):
                    offsets[si * n + j] = 0
                    if body.echo:
                        lp = None
                        if body.logprobs is not None:
                            lp, offsets[si * n + j] = echo_logprobs(si)
                        else:
                            offsets[si * n + j] = len(echo_texts[si])
                        yield _sse(
                            chunk(
                                [
                                    {
                                        "index": si * n + j,
                                        "text": echo_texts[si],
                                        "logprobs": lp,
                                        "finish_reason": None,
                                    }
                                ]
                            )
                        )
            async for si, out in _merge(streams):
                cached[si] = max(cached[si], out.num_cached_tokens)
                for d in out.outputs:
                    completion_tokens += len(d.delta_token_ids)
                    idx = si * n + d.index
                    finish = _finish_reason(d.finish_reason)
                    if not d.delta_text and finish is None and not d.delta_logprobs:
                        continue
                    lp = None
                    if body.logprobs is not None:
                        lp, offsets[idx] = completion_logprobs(
                            engine,
                            list(d.delta_logprobs or []),
                            d.delta_token_ids,
                            offsets[idx],
                            top_k,
                        )
                    choice: dict[str, Any] = {
                        "index": idx,
                        "text": d.delta_text,
                        "logprobs": lp,
                        "finish_reason": finish,
                    }
                    if finish is not None:
                        choice["stop_reason"] = d.stop_reason
                    yield _sse(chunk([choice]))
            if include_usage:
                final = chunk([])
                final["usage"] = usage(sum(len(p) for p in prompts), completion_tokens, sum(cached))
                yield _sse(final)
        except Exception as exc:
            err = _error_from_exception(exc)
            if err.status >= 500 and not isinstance(exc, ApiError | EngineUnavailableError):
                logger.exception("error during stream %s", response_id)
            yield _sse(
                error_body(err.message, error_type_for_status(err.status), err.param, err.code)
            )
        finally:
            for s in streams:
                await s.close()
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ the rest

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        engine = state.engine
        if engine is None:
            raise ApiError(503, "The model is still loading.", headers=_retry_after(5))
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.started_at,
                    "owned_by": "fuel-serve",
                    "root": engine.model_name,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                }
                for name in _served_names(config, engine)
            ],
        }

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        models = await list_models()
        for m in models["data"]:
            if m["id"] == model_id:
                return dict(m)
        raise ApiError(
            404, f"The model `{model_id}` does not exist.", param="model", code="model_not_found"
        )

    @app.get("/health")
    async def health() -> Response:
        if state.front.draining:
            return _error_response(
                ApiError(503, "The server is shutting down.", headers=_retry_after(5))
            )
        if state.engine is None:
            detail = f": {state.load_error}" if state.load_error else ""
            return _error_response(
                ApiError(503, f"The model is loading{detail}.", headers=_retry_after(5))
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        engine = state.engine
        if state.metrics is not None:
            if engine is not None:
                state.metrics.update_from_stats(engine.get_stats())
            payload, content_type = state.metrics.render()
            return Response(content=payload, media_type=content_type)
        # PLACEHOLDER until server/metrics.py lands: engine gauges in Prometheus text format.
        lines = ["# PLACEHOLDER metrics: server/metrics.py is not installed"]
        if engine is not None:
            for key, value in dataclasses.asdict(engine.get_stats()).items():
                if isinstance(value, int | float):
                    lines.append(f"# TYPE fuel_engine_{key} gauge")
                    lines.append(f"fuel_engine_{key} {value}")
        return Response(content="\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        engine = ready_engine()
        check_model(engine, body.model)
        tok = engine.tokenizer
        if body.messages is not None:
            ids = await render_chat(
                engine,
                [m.to_template_dict() for m in body.messages],
                body.add_generation_prompt,
                template_kwargs(body.chat_template_kwargs),
                continue_final_message=body.continue_final_message,
            )
        else:
            assert body.prompt is not None
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tok.encode(body.prompt, add_special_tokens=add_special))
        return {
            "count": len(ids),
            "max_model_len": engine.max_model_len,
            "tokens": ids,
            "token_strs": [token_str(engine, i) for i in ids] if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        engine = ready_engine()
        check_model(engine, body.model)
        check_token_ids(body.tokens, int(engine.tokenizer.vocab_size), "tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/v1/traces/{trace_id}")
    async def get_trace(trace_id: str, publish: bool = False) -> dict[str, Any]:
        """A request's trace (server/traces.py); ``publish=true``: the reviewed, stripped form."""
        engine = ready_engine()
        if not engine.traces_enabled:
            raise ApiError(
                404,
                "Request traces are off: start the server with --enable-request-traces.",
                code="trace_not_found",
            )
        try:
            return await fetch_trace(engine, trace_id, publish=publish)
        except TraceNotFound:
            raise ApiError(
                404,
                f"No trace for request `{trace_id}` (unknown, or evicted by --max-traces).",
                param="trace_id",
                code="trace_not_found",
            ) from None

    if config.enable_debug_endpoints:

        @app.get("/debug/engine")
        async def debug_engine() -> dict[str, Any]:
            engine = state.engine
            if engine is None:
                raise ApiError(503, "The model is still loading.", headers=_retry_after(5))
            stats = dataclasses.asdict(engine.get_stats())
            stats["num_unfinished_requests"] = engine.num_unfinished_requests()
            stats["in_flight_http_requests"] = state.front.in_flight
            return stats
