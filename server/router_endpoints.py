"""Endpoints that routers poll beyond vLLM's own: ``GET /get_load``.

vllm-router (and sglang-router, whose API it inherits) asks each worker for
``GET /get_load`` when its ``power_of_two`` policy is on and reads the integer
``load``; a worker without it is routed blind (the router's own counters).
Everything else the routers consume is vLLM's own surface and lives with it in
server/app.py: ``/health`` (503 while loading or draining), ``/v1/models``,
``/tokenize`` (the cache-aware policy's fallback for the prompt's token ids
after ``/v1/chat/completions/render``, which a default ``vllm serve`` does not
serve either, answers 404) and the ``vllm:*`` gauges on ``/metrics``.

``/get_load`` is reachable without the API key, like ``/health``: the router
polls without credentials, and a request count is no more than ``/health`` says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from engine.stats import EngineStats
from server.protocol import error_body

if TYPE_CHECKING:
    from server.app import AppState


def load_body(num_unfinished: int, stats: EngineStats) -> dict[str, int | float]:
    """``/get_load``'s JSON: ``load`` = requests the engine holds (running + waiting)."""
    return {
        "load": num_unfinished,
        "num_requests_running": stats.num_running,
        "num_requests_waiting": stats.num_waiting,
        "kv_cache_usage_perc": stats.kv_cache_usage,
    }


def install_router_endpoints(app: FastAPI, state: AppState) -> None:
    """Add the routes above to ``app`` (called by ``server.app.build_app``)."""

    @app.get("/get_load")
    async def get_load() -> JSONResponse:
        engine = state.engine
        if engine is None:
            body = error_body("The model is still loading.", "service_unavailable_error")
            return JSONResponse(status_code=503, content=body, headers={"Retry-After": "5"})
        stats: EngineStats = engine.get_stats()
        return JSONResponse(load_body(engine.num_unfinished_requests(), stats))
