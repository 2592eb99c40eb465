"""Mistral formats: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` and v11's
``[TOOL_CALLS]name[ARGS]{...}`` (one call per ``[TOOL_CALLS]``).

In the pre-v11 JSON-array format the array (or a single object) is all-or-nothing:
if any element is invalid the whole block falls back to content.
"""

from __future__ import annotations

from typing import Any

from server.tool_parsers._block import MarkedBlockStreamParser
from server.tool_parsers.base import IdGenerator, ToolParser, ToolStreamParser, normalize_call


def _convert(value: Any, names: frozenset[str] | None) -> list[tuple[str, str]] | None:
    items = value if isinstance(value, list) else [value]
    calls: list[tuple[str, str]] = []
    for item in items:
        call = normalize_call(item, names, ("arguments", "parameters"))
        if call is None:
            return None
        calls.append(call)
    return calls or None


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` then a JSON array of calls (or one call object), or ``name[ARGS]{...}``."""

    name = "mistral"

    def stream(self, id_generator: IdGenerator | None = None) -> ToolStreamParser:
        return MarkedBlockStreamParser(
            self._names,
            id_generator or self._id_generator,
            marker="[TOOL_CALLS]",
            openers="[{",
            end_marker="",
            convert=_convert,
            args_marker="[ARGS]",
        )
