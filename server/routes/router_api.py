"""Endpoints that routers poll beyond vLLM's own: ``GET /get_load``.

vllm-router (and sglang-router, whose API it inherits) asks each worker for
``GET /get_load`` when its ``power_of_two`` policy is on and reads the integer
``load``; a worker without it is routed blind (the router's own counters).
Everything else the routers consume is vLLM's own surface and lives with it:
``/health`` (503 while loading or draining), ``/v1/models``, ``/tokenize``
(the cache-aware policy's fallback for the prompt's token ids after
``/v1/chat/completions/render``, which a default ``vllm serve`` does not serve
either: it answers 404) and the ``vllm:*`` gauges on ``/metrics``.

``/get_load`` is reachable without the API key, like ``/health``
(server/middleware.py): the router polls without credentials, and a request
count says no more than ``/health`` does.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from engine.client import EngineStats
from server.errors import error_response, loading_error
from server.state import State

router = APIRouter()


def load_body(num_unfinished: int, stats: EngineStats) -> dict[str, int | float]:
    """``/get_load``'s JSON: ``load`` = requests the engine holds (running + waiting)."""
    return {
        "load": num_unfinished,
        "num_requests_running": stats.num_running,
        "num_requests_waiting": stats.num_waiting,
        "kv_cache_usage_perc": stats.kv_cache_usage,
    }


@router.get("/get_load", response_model=None)
async def get_load(state: State) -> JSONResponse:
    engine = state.engine
    if engine is None:
        return error_response(loading_error(state.load_error))
    return JSONResponse(load_body(engine.num_unfinished_requests(), engine.get_stats()))
