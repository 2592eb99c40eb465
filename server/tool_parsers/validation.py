"""Validate parsed tool calls against the request's ``tools`` JSON schemas."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from server.tool_parsers.base import ToolCall, loads_strict


def validate_tool_calls(
    calls: Sequence[ToolCall], tools: Sequence[Mapping[str, Any]] | None
) -> list[str]:
    """One human-readable message per problem; an empty list means all calls are valid.

    Checks, per call: the function is declared in ``tools``, ``arguments`` is a
    JSON object, and it validates against the function's ``parameters`` schema
    (absent parameters: any object). An invalid schema is reported, not raised.

    What the server does with failures: in the default (non-strict) mode the
    model's call is returned to the client as-is and each message is logged, as
    OpenAI does (the client is the judge of its own tools). Functions declared
    with ``strict: true`` are generated under a grammar built from their schema
    (``engine.sampling.grammar.GrammarCompiler.build_tool_call_spec``), so their
    arguments are valid by construction and a failure here signals a bug.
    """
    schemas: dict[str, Any] = {}
    for tool in tools or ():
        function = tool.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            schemas[function["name"]] = function.get("parameters") or {"type": "object"}
    problems: list[str] = []
    for i, call in enumerate(calls):
        where = f"tool_calls[{i}] ({call.name!r})"
        if call.name not in schemas:
            problems.append(f"{where}: no such function in tools")
            continue
        try:
            args = loads_strict(call.arguments)
        except ValueError as exc:
            problems.append(f"{where}: arguments are not valid JSON: {exc}")
            continue
        if not isinstance(args, dict):
            problems.append(f"{where}: arguments must be a JSON object")
            continue
        schema = schemas[call.name]
        try:
            cls = jsonschema.validators.validator_for(schema)
            cls.check_schema(schema)
            errors = sorted(cls(schema).iter_errors(args), key=lambda e: list(e.path))
        except jsonschema.exceptions.SchemaError as exc:
            problems.append(f"{where}: the function's parameters schema is invalid: {exc.message}")
            continue
        for error in errors:
            path = "/".join(str(p) for p in error.path) or "<root>"
            problems.append(f"{where}: arguments at {path}: {error.message}")
    return problems
