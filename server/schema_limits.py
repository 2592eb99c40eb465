"""Limits on every JSON Schema a request hands the grammar compiler (tools, ``response_format``).

OpenAI's structured-output limits, as its guide states them ("Supported
schemas"): at most 5,000 object properties in total and 10 levels of nesting;
at most 1,000 enum values in total; at most 120,000 characters in all property
names, definition names, enum values and const values together; and for one
string enum of more than 250 values, at most 15,000 characters in its values.
Ours, for what OpenAI leaves unbounded but a grammar compiler pays for: a
``pattern`` of at most 1,000 characters with repetition counts of at most
1,000, and size keywords (``maxLength``, ``minItems``...) of at most 100,000.

The walk is iterative (no recursion, whatever the depth) and stops at the
first limit passed: a schema over a limit is a 400 naming the parameter
before anything compiles it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from engine.client import JsonValue
from server.errors import ApiError

MAX_NESTING = 10
MAX_PROPERTIES = 5_000
MAX_ENUM_VALUES = 1_000
MAX_TOTAL_STRING_CHARS = 120_000
LARGE_ENUM = 250
MAX_LARGE_ENUM_CHARS = 15_000
MAX_PATTERN_CHARS = 1_000
MAX_REPEAT = 1_000
MAX_SIZE_KEYWORD = 100_000

# Keywords whose value is one sub-schema one nesting level down (a value inside this one).
_NESTED_ONE = ("items", "additionalProperties", "contains", "additionalItems", "unevaluatedItems")
# Keywords whose value maps names to sub-schemas one level down.
_NESTED_MAP = ("properties", "patternProperties")
# Keywords whose sub-schemas describe the same value (same level).
_SAME_ONE = ("not", "if", "then", "else", "propertyNames")
_SAME_LIST = ("anyOf", "oneOf", "allOf")
_DEFS = ("$defs", "definitions")
_SIZE_KEYWORDS = (
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
)
_REPEAT_RE = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class _Budget:
    def __init__(self, param: str) -> None:
        self.param = param
        self.properties = 0
        self.enum_values = 0
        self.chars = 0

    def fail(self, message: str) -> ApiError:
        return ApiError(400, f"{self.param}: {message}", param=self.param)

    def add_chars(self, n: int) -> None:
        self.chars += n
        if self.chars > MAX_TOTAL_STRING_CHARS:
            raise self.fail(
                f"the schema's property names, definition names, enum and const values "
                f"exceed {MAX_TOTAL_STRING_CHARS} characters"
            )


def _value_chars(value: JsonValue) -> int:
    return len(value) if isinstance(value, str) else len(str(value))


def _check_enum(values: Sequence[JsonValue], budget: _Budget) -> None:
    budget.enum_values += len(values)
    if budget.enum_values > MAX_ENUM_VALUES:
        raise budget.fail(f"the schema has more than {MAX_ENUM_VALUES} enum values in total")
    chars = sum(_value_chars(v) for v in values)
    if len(values) > LARGE_ENUM and all(isinstance(v, str) for v in values):
        if chars > MAX_LARGE_ENUM_CHARS:
            raise budget.fail(
                f"an enum of {len(values)} strings has {chars} characters "
                f"(at most {MAX_LARGE_ENUM_CHARS} above {LARGE_ENUM} values)"
            )
    budget.add_chars(chars)


def _check_pattern(pattern: str, budget: _Budget) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise budget.fail(f"a pattern is longer than {MAX_PATTERN_CHARS} characters")
    for m in _REPEAT_RE.finditer(pattern):
        for count in m.groups():
            if count and int(count) > MAX_REPEAT:
                raise budget.fail(f"a pattern repeats more than {MAX_REPEAT} times ({m.group(0)})")


def _check_keywords(node: Mapping[str, JsonValue], budget: _Budget) -> None:
    enum = node.get("enum")
    if isinstance(enum, list):
        _check_enum(enum, budget)
    if "const" in node:
        budget.add_chars(_value_chars(node["const"]))
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        _check_pattern(pattern, budget)
    for key in _SIZE_KEYWORDS:
        size = node.get(key)
        if isinstance(size, int | float) and not isinstance(size, bool):
            if size > MAX_SIZE_KEYWORD:
                raise budget.fail(f"{key} {size} is larger than {MAX_SIZE_KEYWORD}")


# Any JSON nesting (known keywords or not) deeper than this is refused before a
# recursive consumer (a JSON encoder, a schema validator) meets it.
MAX_RAW_DEPTH = 64


def check_json_depth(value: JsonValue, param: str, limit: int = MAX_RAW_DEPTH) -> None:
    """400 naming ``param`` if ``value`` nests objects/arrays deeper than ``limit`` (iterative)."""
    stack: list[tuple[JsonValue, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children: list[JsonValue] = list(node.values())
        elif isinstance(node, list):
            children = list(node)
        else:
            continue
        if depth > limit:
            raise ApiError(
                400, f"{param}: the JSON is nested deeper than {limit} levels", param=param
            )
        stack.extend((child, depth + 1) for child in children)


def check_schema_limits(schema: JsonValue, param: str) -> None:
    """400 (naming ``param``) unless ``schema`` is within the limits of the module doc.

    Nesting counts the levels of values: the root is level 1, and each step into
    a property, an array item or additional properties is one more; ``anyOf``
    branches, ``not``/``if`` and definitions describe a value at their own level.
    """
    check_json_depth(schema, param)
    budget = _Budget(param)
    stack: list[tuple[JsonValue, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if not isinstance(node, Mapping):
            continue
        if level > MAX_NESTING:
            raise budget.fail(f"the schema is nested deeper than {MAX_NESTING} levels")
        _check_keywords(node, budget)
        for key in _NESTED_MAP:
            children = node.get(key)
            if isinstance(children, Mapping):
                if key == "properties":
                    budget.properties += len(children)
                    if budget.properties > MAX_PROPERTIES:
                        raise budget.fail(
                            f"the schema has more than {MAX_PROPERTIES} object properties"
                        )
                for name, child in children.items():
                    budget.add_chars(len(name))
                    stack.append((child, level + 1))
        for key in _NESTED_ONE:
            if key in node:
                stack.append((node[key], level + 1))
        prefix = node.get("prefixItems")
        if isinstance(prefix, list):
            stack.extend((child, level + 1) for child in prefix)
        for key in _SAME_ONE:
            if key in node:
                stack.append((node[key], level))
        for key in _SAME_LIST:
            branches = node.get(key)
            if isinstance(branches, list):
                stack.extend((child, level) for child in branches)
        for key in _DEFS:
            defs = node.get(key)
            if isinstance(defs, Mapping):
                for name, child in defs.items():
                    budget.add_chars(len(name))
                    stack.append((child, 1))
