"""The application state every route shares, and how a route gets it.

One ``AppState`` per app, hung on ``app.state.fuel`` by ``build_app`` (no module
globals); routes take it as a FastAPI dependency (``State``). ``engine`` is None
until the engine has loaded and started; ``load_error`` says why it never will.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from engine.client import EngineClient, JsonValue
from server.config import ServerConfig
from server.errors import ApiError, draining_error, loading_error
from server.metrics import Metrics
from server.middleware import FrontDoorState

logger = logging.getLogger("fuel_serve.server")


@dataclass
class AppState:
    """Everything the routes share. Mutated only by the lifespan (engine, metrics, load_error)."""

    config: ServerConfig
    front: FrontDoorState
    engine: EngineClient | None = None
    load_error: str | None = None
    metrics: Metrics | None = None
    started_at: int = field(default_factory=lambda: int(time.time()))

    def ready_engine(self) -> EngineClient:
        """The engine, or a 503 while it loads (or failed to) and while draining."""
        if self.engine is None:
            raise loading_error(self.load_error)
        if self.front.draining:
            raise draining_error()
        return self.engine

    def served_names(self, engine: EngineClient) -> list[str]:
        """Names clients may send as ``model``; the first is the one responses report."""
        return list(self.config.served_model_name) or [engine.model_name]

    def check_model(self, engine: EngineClient, model: str | None) -> str:
        """The name to report for a request's ``model`` (404 if it is not served here)."""
        names = self.served_names(engine)
        if model is None:
            return names[0]
        if model not in names:
            raise ApiError(
                404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return model

    def log_prompt(self, request_id: str, prompt: JsonValue) -> None:
        """Log a request's prompt, only with ``--log-prompts`` (prompts are private)."""
        if self.engine is not None and self.engine.log_prompts:
            logger.info("request %s prompt=%r", request_id, prompt)


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.fuel
    return state


def request_id(request: Request) -> str:
    """The HTTP request's id (X-Request-Id as the middleware checked it, else a fresh one)."""
    return str(request.scope.get("state", {}).get("request_id") or uuid.uuid4().hex)


State = Annotated[AppState, Depends(app_state)]
