"""Tool-call parsers: turn a model's raw text into OpenAI ``tool_calls``.

``get_tool_parser(name, tools=...)`` returns a parser (which one a model needs comes
from its chat template: ``ClientTokenizer.tool_call_format``). See ``base`` for the
exactness contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from server.tool_parsers.base import (
    IdGenerator,
    ParsedMessage,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamParser,
    assemble,
    random_call_id,
    sequential_ids,
)
from server.tool_parsers.hermes import HermesToolParser
from server.tool_parsers.llama3_json import Llama3JsonToolParser
from server.tool_parsers.mistral import MistralToolParser
from server.tool_parsers.validation import validate_tool_calls

TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType(
    {
        HermesToolParser.name: HermesToolParser,
        Llama3JsonToolParser.name: Llama3JsonToolParser,
        MistralToolParser.name: MistralToolParser,
    }
)


def get_tool_parser(
    name: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    id_generator: IdGenerator | None = None,
) -> ToolParser:
    """The parser called ``name``; ``ValueError`` (listing the choices) if unknown."""
    try:
        cls = TOOL_PARSERS[name]
    except KeyError:
        choices = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {choices}") from None
    return cls(tools, id_generator=id_generator)


__all__ = [
    "TOOL_PARSERS",
    "IdGenerator",
    "ParsedMessage",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamParser",
    "assemble",
    "get_tool_parser",
    "random_call_id",
    "sequential_ids",
    "validate_tool_calls",
]
