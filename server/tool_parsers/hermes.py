"""Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

from typing import Any

from server.tool_parsers._block import MarkedBlockStreamParser
from server.tool_parsers.base import IdGenerator, ToolParser, ToolStreamParser, normalize_call


def _convert(value: Any, names: frozenset[str] | None) -> list[tuple[str, str]] | None:
    call = normalize_call(value, names, ("arguments", "parameters"))
    return None if call is None else [call]


class HermesToolParser(ToolParser):
    """Any number of ``<tool_call>`` blocks with content before, between and after."""

    name = "hermes"

    def stream(self, id_generator: IdGenerator | None = None) -> ToolStreamParser:
        return MarkedBlockStreamParser(
            self._names,
            id_generator or self._id_generator,
            marker="<tool_call>",
            openers="{",
            end_marker="</tool_call>",
            convert=_convert,
        )
