"""``GET /v1/traces/{trace_id}``: a request's trace (see server/traces.py for the mapping)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from server.errors import ApiError
from server.state import State
from server.traces import TraceNotFound, fetch_trace

router = APIRouter()


@router.get("/v1/traces/{trace_id}")
async def get_trace(trace_id: str, state: State, publish: bool = False) -> dict[str, Any]:
    """A request's trace (server/traces.py); ``publish=true``: the reviewed, stripped form."""
    engine = state.ready_engine()
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
