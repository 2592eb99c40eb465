"""Errors in OpenAI's envelope: ``ApiError``, the engine-error mapping, validation messages.

Contract: every failure the server answers is ``{"error": {message, type, param,
code}}`` with the status OpenAI (or vLLM) uses: 400 invalid request, 401 bad key,
404 unknown model/route, 413 body too large, 429 admission said "not now" (with
Retry-After), 503 loading/draining/aborted (with Retry-After). A 500 means a bug
and never carries internal detail.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from engine.client import JsonObject
from engine.errors import EngineUnavailableError, InvalidRequestError, RequestRejectedError

INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."


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


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | None = None
) -> JsonObject:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_type_for_status(status: int) -> str:
    """OpenAI's ``type`` strings by status."""
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable_error"
    return "invalid_request_error"


def api_error_body(err: ApiError) -> JsonObject:
    """The envelope of ``err`` (also sent as the last SSE event of a failed stream)."""
    return error_body(err.message, error_type_for_status(err.status), err.param, err.code)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(status_code=err.status, content=api_error_body(err), headers=err.headers)


def retry_after(seconds: float) -> dict[str, str]:
    """A ``Retry-After`` header of whole seconds (at least 1)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def loading_error(detail: str | None = None) -> ApiError:
    suffix = f" ({detail})" if detail else ""
    return ApiError(503, f"The model is still loading{suffix}.", headers=retry_after(5))


def draining_error() -> ApiError:
    return ApiError(503, "The server is shutting down.", headers=retry_after(5))


def error_from_exception(exc: BaseException) -> ApiError:
    """Map engine exceptions (and our own) onto statuses; anything else is a 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, RequestRejectedError):
        return ApiError(
            429, str(exc), code=exc.reason or "rate_limited", headers=retry_after(exc.retry_after)
        )
    if isinstance(exc, EngineUnavailableError):
        return ApiError(503, str(exc), headers=retry_after(exc.retry_after))
    return ApiError(500, INTERNAL_ERROR_MESSAGE)


_UNION_TAG_RE = re.compile(
    r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*|.*\[.*\])$"
)
# Union branches produce several errors; the explicit ones say the most.
_ERROR_PRIORITY = {"extra_forbidden": 0, "json_invalid": 0, "value_error": 1, "missing": 2}


def validation_message(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """Turn pydantic's error list into one message naming the field, and ``param``.

    (``Any``: pydantic's error dicts hold arbitrary input values; this is not a seam.)
    """
    if not errors:
        return "Invalid request.", None
    err = sorted(errors, key=lambda e: _ERROR_PRIORITY.get(e.get("type", ""), 3))[0]
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
