"""Errors the engine raises to its callers; the server maps them to HTTP statuses."""

from __future__ import annotations


class EngineError(Exception):
    """Base class. ``kind`` tells the caller how to answer."""

    kind = "internal"


class InvalidRequestError(EngineError, ValueError):
    """The request can never be served as asked (HTTP 400).

    ``param`` names the offending field when known; ``code`` is an OpenAI error
    code such as ``context_length_exceeded``.
    """

    kind = "invalid"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class RequestRejectedError(EngineError):
    """Admission control said no for now (HTTP 429); retry after ``retry_after`` s."""

    kind = "rejected"

    def __init__(self, message: str, reason: str, retry_after: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class EngineUnavailableError(EngineError):
    """The engine is loading, draining or dead (HTTP 503)."""

    kind = "unavailable"

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


class WorkerDiedError(EngineUnavailableError):
    """A tensor-parallel worker died or a step across the ranks failed: the engine
    cannot go on (health 503, the server exits non-zero)."""
