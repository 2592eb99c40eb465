"""The OpenAI-compatible FastAPI app: ``build_app(engine, server_config) -> FastAPI``.

This module wires the app and holds nothing else: the lifespan (load, start and
shut down the engine), the exception handlers (every failure answers OpenAI's
envelope, see server/errors.py), the front-door middleware and the routers
(server/routes/). The shared state is ``server.state.AppState``; the
generation pipeline is server/generation.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.client import EngineClient
from engine.errors import EngineUnavailableError, InvalidRequestError, RequestRejectedError
from server import __version__
from server.config import ServerConfig
from server.errors import (
    INTERNAL_ERROR_MESSAGE,
    ApiError,
    error_from_exception,
    error_response,
    validation_message,
)
from server.metrics import Metrics
from server.middleware import FrontDoorMiddleware, FrontDoorState
from server.routes import chat, completions, health, models, router_api, traces
from server.state import AppState

logger = logging.getLogger("fuel_serve.server")


def build_app(
    engine: EngineClient | None,
    server_config: ServerConfig,
    *,
    engine_factory: Callable[[], EngineClient] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """Build the app around ``engine`` (started in the lifespan).

    With ``engine=None`` and an ``engine_factory``, the engine is built in a
    worker thread after the server starts listening, and ``/health`` answers
    503 until it is ready (so orchestrators see "loading", not "down").
    If building or starting the engine fails, ``on_load_failure(reason)`` is
    called with one line saying why (the CLI then exits non-zero); without it
    the app logs the traceback and keeps answering 503 with the reason.
    Once running, an engine that fails for good (``fatal_error``: its loop died,
    a tensor-parallel worker exited) turns ``/health`` 503 and, within half a
    second, ``on_fatal(reason)`` is called (the CLI then exits non-zero).
    """
    if engine is None and engine_factory is None:
        raise ValueError("build_app needs an engine or an engine_factory")
    state = AppState(config=server_config, front=FrontDoorState(), engine=None)

    async def load_engine() -> None:
        try:
            if engine is not None:
                built = engine
            else:
                assert engine_factory is not None
                built = await asyncio.to_thread(engine_factory)
            await built.start()
            state.metrics = Metrics(state.served_names(built)[0])
            state.metrics.set_cache_config(built.cache_config)
            logger.info("engine ready: %s", built.describe())
            state.engine = built
            watchers.append(asyncio.ensure_future(watch(built)))
        except Exception as exc:
            # One line: the reason goes to /health, the log and the CLI's exit message.
            state.load_error = " ".join(f"{type(exc).__name__}: {exc}".split())
            if on_load_failure is None:  # keep answering 503 with the reason
                logger.exception("engine failed to load")
                return
            logger.debug("engine failed to load", exc_info=True)
            on_load_failure(state.load_error)

    watchers: list[asyncio.Task[None]] = []

    async def watch(built: EngineClient) -> None:
        while built.fatal_error is None:
            await asyncio.sleep(0.5)
        logger.error("the engine failed: %s", built.fatal_error)
        if on_fatal is not None:
            on_fatal(built.fatal_error)

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
            for task in watchers:
                task.cancel()
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
    for module in (chat, completions, models, health, traces, router_api):
        app.include_router(module.router)
    if server_config.enable_debug_endpoints:
        app.include_router(health.debug_router)
    return app


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
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(
            ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        )

    async def engine_error(_: Request, exc: Exception) -> JSONResponse:
        err = error_from_exception(exc)
        if isinstance(exc, RequestRejectedError) and state.metrics is not None:
            state.metrics.observe_rejection(exc.reason)
        return error_response(err)

    for exc_type in (InvalidRequestError, RequestRejectedError, EngineUnavailableError):
        app.add_exception_handler(exc_type, engine_error)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, INTERNAL_ERROR_MESSAGE))
