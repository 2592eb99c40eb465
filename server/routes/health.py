"""``GET /health``, ``/version``, ``/metrics`` (Prometheus) and ``/debug/engine``.

``/health`` is 200 once the engine is ready and 503 (in OpenAI's envelope,
with the reason) while it loads or the server drains. The debug router is
only included with ``--enable-debug-endpoints``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.client import JsonObject
from server import __version__
from server.errors import ApiError, draining_error, error_response, retry_after
from server.state import State

router = APIRouter()
debug_router = APIRouter()


# The error envelope, for the OpenAPI document (server/errors.py builds it).
_ERROR_ENVELOPE: JsonObject = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


@router.get(
    "/health",
    response_class=Response,  # 200 has no body (as vLLM's): declared without content
    responses={
        200: {"description": "The engine is ready (empty body)."},
        503: {
            "description": "Loading, failed to load, failed (a dead tensor-parallel worker), or "
            "draining (with Retry-After).",
            "content": {"application/json": {"schema": _ERROR_ENVELOPE}},
        },
    },
)
async def health(state: State) -> Response:
    if state.front.draining:
        return error_response(draining_error())
    if state.engine is None:
        detail = f": {state.load_error}" if state.load_error else ""
        return error_response(
            ApiError(503, f"The model is loading{detail}.", headers=retry_after(5))
        )
    if state.engine.fatal_error is not None:
        return error_response(ApiError(503, f"The engine failed: {state.engine.fatal_error}."))
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(state: State) -> Response:
    """Prometheus text format. Before the engine has loaded there is nothing to export yet."""
    if state.metrics is None:
        return Response(content=b"", media_type=CONTENT_TYPE_LATEST)
    if state.engine is not None:
        state.metrics.update_from_stats(state.engine.get_stats())
    payload, content_type = state.metrics.render()
    return Response(content=payload, media_type=content_type)


@debug_router.get("/debug/engine")
async def debug_engine(state: State) -> dict[str, Any]:
    engine = state.engine
    if engine is None:
        raise ApiError(503, "The model is still loading.", headers=retry_after(5))
    stats: dict[str, Any] = dataclasses.asdict(engine.get_stats())
    stats["num_unfinished_requests"] = engine.num_unfinished_requests()
    stats["in_flight_http_requests"] = state.front.in_flight
    return stats
