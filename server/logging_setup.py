"""Log configuration: one JSON object per line, or plain text for humans.

JSON records carry ``ts`` (UTC ISO-8601), ``level``, ``logger``, ``msg`` and
every ``extra=`` field the caller passed (``request_id``, ``model``, token
counts, ...). Exceptions go under ``exc``.

Privacy: logs carry metadata only. Extra fields that hold user content
(:data:`PRIVATE_FIELDS`: prompt, output text, messages, ...) are dropped unless
the server runs with ``--log-prompts`` (``log_prompts=True``); the log line
then says which fields were withheld, so nobody mistakes absence for emptiness.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
from datetime import datetime, timezone
from typing import Any, TextIO

# Fields whose values are user content, withheld unless log_prompts.
PRIVATE_FIELDS: frozenset[str] = frozenset(
    {
        "prompt",
        "prompt_text",
        "prompt_token_ids",
        "messages",
        "output",
        "output_text",
        "output_token_ids",
        "text",
        "completion",
        "user",
    }
)

# Attributes every LogRecord has; anything else on a record came from extra=.
_STANDARD_ATTRS: frozenset[str] = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)

# Marks the handler we install so reconfiguring replaces it instead of stacking.
_HANDLER_NAME = "fuel-serve"


def record_extras(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of ``record`` (everything not a standard LogRecord attribute)."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS}


class PrivacyFilter(logging.Filter):
    """Drops user-content extras from records unless ``log_prompts``; notes what it dropped."""

    def __init__(self, log_prompts: bool) -> None:
        super().__init__()
        self.log_prompts = log_prompts

    def filter(self, record: logging.LogRecord) -> bool:
        if self.log_prompts:
            return True
        withheld = sorted(k for k in record_extras(record) if k in PRIVATE_FIELDS)
        for key in withheld:
            delattr(record, key)
        if withheld:
            record.withheld = withheld
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, extras, exc."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record_extras(record).items():
            payload.setdefault(key, value)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        # default=str: an extra that is not JSON-serializable must not lose the line.
        return jsonlib.dumps(payload, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Human-readable lines, extras appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = record_extras(record)
        if extras:
            line += " " + " ".join(f"{k}={v}" for k, v in sorted(extras.items()))
        return line


def configure_logging(
    json: bool, level: str, log_prompts: bool = False, stream: TextIO | None = None
) -> logging.Handler:
    """Install Fuel Serve's handler on the root logger (replacing one installed earlier).

    ``level`` is a logging level name (``debug``, ``INFO``...); ``ValueError``
    if unknown. ``stream`` defaults to stderr. Uvicorn's loggers are routed
    through the root handler so access logs share the format. Returns the
    handler (tests attach to it).
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if json else TextFormatter())
    handler.addFilter(PrivacyFilter(log_prompts))
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True
    return handler
