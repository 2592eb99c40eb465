"""Pure-ASGI front door: request ids, API key, body size limit, draining, in-flight count.

Runs on the raw ASGI scope (path as the server decoded it, headers as bytes), so
no Host header, proxy prefix or route lookup can route around the checks.
"""

from __future__ import annotations

import hmac
import json
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from server.errors import error_body, error_type_for_status

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# Paths that stay reachable without a key / while draining.
_UNAUTHENTICATED_PATHS = frozenset({"/health"})
_DRAIN_EXEMPT_PATHS = frozenset({"/health", "/metrics", "/version", "/debug/engine"})


class BodyTooLargeError(HTTPException):
    """Raised from ``receive`` when the streamed body passes the limit.

    An ``HTTPException`` so FastAPI's body parser re-raises it (it turns other
    exceptions into a 400) and the app's handler answers 413 in the envelope.
    """

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes.")


class FrontDoorState:
    """Mutable per-app state the middleware and the app share (one per app, no globals)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0


async def send_error(
    send: Send,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Send a complete OpenAI-envelope JSON error response."""
    body = json.dumps(error_body(message, error_type_for_status(status), None, code)).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


class FrontDoorMiddleware:
    """See module docstring. ``api_key`` None disables auth."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        state: FrontDoorState,
        api_key: str | None,
        max_body_bytes: int,
        retry_after_draining_s: float,
    ) -> None:
        self.app = app
        self.state = state
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.retry_after = str(max(1, round(retry_after_draining_s))).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        raw_id = headers.get(b"x-request-id", b"").decode("latin-1")
        # Echo a well-formed client id; replace anything else so it cannot inject headers/logs.
        request_id = raw_id if _REQUEST_ID_RE.match(raw_id) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        id_header = (b"x-request-id", request_id.encode())

        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), id_header]
            await send(message)

        path: str = scope.get("path", "")
        if self.api_key is not None and path not in _UNAUTHENTICATED_PATHS:
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            ok = scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
            if not ok:
                await send_error(
                    send_with_id,
                    401,
                    "Incorrect API key provided." if auth else "Missing API key.",
                    code="invalid_api_key",
                    headers=[(b"www-authenticate", b"Bearer")],
                )
                return

        content_length = headers.get(b"content-length")
        if content_length is not None:
            try:
                declared = int(content_length)
            except ValueError:
                await send_error(send_with_id, 400, "Invalid Content-Length header.")
                return
            if declared > self.max_body_bytes:
                await self._too_large(send_with_id)
                return

        if self.state.draining and path not in _DRAIN_EXEMPT_PATHS:
            await send_error(
                send_with_id,
                503,
                "The server is shutting down; retry on another replica.",
                headers=[(b"retry-after", self.retry_after)],
            )
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLargeError(self.max_body_bytes)
            return message

        counted = path not in _DRAIN_EXEMPT_PATHS
        if counted:
            self.state.in_flight += 1
        try:
            await self.app(scope, limited_receive, send_with_id)
        except BodyTooLargeError:
            if not started:
                await self._too_large(send_with_id)
        finally:
            if counted:
                self.state.in_flight -= 1

    async def _too_large(self, send: Send) -> None:
        await send_error(
            send,
            413,
            f"Request body is larger than the limit of {self.max_body_bytes} bytes.",
            code="request_too_large",
        )
