"""OpenAI's structured-output limits on every schema that reaches the grammar compiler."""

from __future__ import annotations

from typing import Any

import pytest

from server.errors import ApiError
from server.schema_limits import check_json_depth, check_schema_limits

P = "tools.0.function.parameters"


def nested(levels: int) -> dict[str, Any]:
    """A schema of exactly ``levels`` levels of values (the root object is level 1)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def props(n: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}


OK: list[dict[str, Any]] = [
    nested(10),
    props(5000),
    {"type": "string", "enum": [f"v{i}" for i in range(1000)]},
    {"type": "string", "enum": ["x" * 59] * 251},  # 14,809 characters
    {"anyOf": [nested(10), nested(10)]},  # branches stay at their level
    {"$defs": {"n": nested(10)}, "$ref": "#/$defs/n"},
    {"type": "string", "pattern": "a{1000}"},
]
TOO_BIG: list[tuple[dict[str, Any], str]] = [
    (nested(11), "nested deeper than 10 levels"),
    ({"type": "array", "items": nested(10)}, "nested deeper than 10 levels"),
    (props(5001), "more than 5000 object properties"),
    ({"type": "string", "enum": [f"v{i}" for i in range(1001)]}, "more than 1000 enum values"),
    ({"type": "string", "enum": ["x" * 60] * 251}, "15000"),
    (
        {"type": "object", "properties": {"k" * 60_001: {}, "j" * 60_000: {}}},
        "120000 characters",
    ),
    ({"type": "string", "pattern": "a{1001}"}, "repeats more than 1000"),
    ({"type": "string", "pattern": "a" * 1001}, "longer than 1000"),
    ({"type": "string", "maxLength": 10**12}, "maxLength"),
]


@pytest.mark.parametrize("schema", OK, ids=range(len(OK)))
def test_within_limits(schema: dict[str, Any]) -> None:
    check_schema_limits(schema, P)


@pytest.mark.parametrize(("schema", "needle"), TOO_BIG, ids=[n for _, n in TOO_BIG])
def test_over_a_limit_is_a_400_naming_the_parameter(schema: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiError) as info:
        check_schema_limits(schema, P)
    assert info.value.status == 400 and info.value.param == P
    assert needle in info.value.message, info.value.message


def test_depth_is_checked_without_recursion() -> None:
    deep: Any = {}
    for _ in range(100_000):  # far past Python's recursion limit
        deep = {"x": deep}
    with pytest.raises(ApiError, match="nested deeper than 64"):
        check_json_depth(deep, "tools")
    with pytest.raises(ApiError, match="nested deeper"):
        check_schema_limits(deep, P)
