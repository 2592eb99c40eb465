"""Typed settings fields: one declaration gives the dataclass field, its flag and its help.

Every configurable value of Fuel Serve is a field of ``EngineConfig``
(engine/config.py) or ``ServerConfig`` (server/config.py) declared with
:func:`setting`. The CLI (server/cli.py) builds its flags from these fields,
``configs/default.yaml`` is generated from them (``fuel-serve
--print-defaults``) and a test checks that they agree, so a new setting is one
line in one place.

Types drive parsing and validation:
* ``Literal[...]``: the flag's choices; ``validate_fields`` rejects others.
* ``bool``: ``--flag`` / ``--no-flag``.
* ``int``, ``float``, ``str`` (optionally ``| None``): parsed by that type.
* ``list[str]``: one or more values.
* ``kind="bytes"``: a byte count (``1GiB``, ``512MiB``, ``1000``).
* ``kind="json"``: a JSON object (``--speculative-config '{"method": "ngram"}'``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import Field
from typing import Any, Literal, Union, get_args, get_origin

SettingKind = Literal["plain", "bytes", "json"]


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    kind: SettingKind = "plain",
    flag: str | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    default_factory: Callable[[], Any] | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field with the metadata the CLI and the validator read.

    ``flag`` overrides the flag name (default: ``--`` + the field name with
    dashes); ``cli=False`` keeps a field out of the flags (set from YAML or code).
    ``minimum``/``maximum`` bound numbers (inclusive), checked by ``validate_fields``.
    """
    metadata = {
        "help": help,
        "kind": kind,
        "flag": flag,
        "minimum": minimum,
        "maximum": maximum,
        "cli": cli,
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """What one setting field says about itself, resolved from its annotation."""

    name: str
    base: type
    optional: bool
    choices: tuple[str, ...] | None
    is_list: bool
    kind: SettingKind
    help: str
    flag: str
    minimum: float | None
    maximum: float | None
    cli: bool
    default: Any


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True)."""
    origin = get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def field_specs(cls: type) -> list[FieldSpec]:
    """The settings of dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    out: list[FieldSpec] = []
    for f in dataclasses.fields(cls):
        tp, optional = _unwrap(hints[f.name])
        choices: tuple[str, ...] | None = None
        is_list = False
        if get_origin(tp) is Literal:
            choices = tuple(str(a) for a in get_args(tp))
            base: type = str
        elif get_origin(tp) is list:
            is_list = True
            base = get_args(tp)[0]
        elif isinstance(tp, type):
            base = tp
        else:  # dict[str, Any] and the like: JSON values
            base = dict
        md = f.metadata
        out.append(
            FieldSpec(
                name=f.name,
                base=base,
                optional=optional,
                choices=choices,
                is_list=is_list,
                kind=md.get("kind", "plain"),
                help=md.get("help", ""),
                flag=md.get("flag") or "--" + f.name.replace("_", "-"),
                minimum=md.get("minimum"),
                maximum=md.get("maximum"),
                cli=md.get("cli", True),
                default=_default_of(f),
            )
        )
    return out


def _default_of(f: Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_bytes(value: str | int) -> int:
    """Parse a byte count: ``1073741824``, ``1GiB``, ``512MiB``, ``2G``, ``1.5GB``.

    ``KiB/MiB/GiB/TiB`` (and bare ``K/M/G/T``) are powers of 1024; ``KB/MB/GB/TB``
    are powers of 1000, as the units say. Raises ``ValueError`` on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"byte count must be a number, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"byte count must be non-negative, got {value}")
        return value
    if isinstance(value, float):
        if value < 0 or value != int(value):
            raise ValueError(f"byte count must be a whole non-negative number, got {value}")
        return int(value)
    m = _SIZE_RE.match(value)
    if m is None:
        raise ValueError(f"cannot parse byte count {value!r} (try 1GiB, 512MiB, 1000000)")
    number, unit, binary = m.group(1), m.group(2).upper(), m.group(3)
    exponent = "KMGT".find(unit) + 1 if unit else 0
    # A bare "G" means GiB (as vLLM and most CLIs read it); "GB" means 10^9.
    explicit_decimal = bool(unit) and not binary and value.strip().upper().endswith("B")
    base = 1000 if explicit_decimal else 1024
    result = float(number) * base**exponent
    if result != int(result):
        raise ValueError(f"byte count {value!r} is not a whole number of bytes")
    return int(result)


def parse_json_object(value: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON object given as text (CLI) or already parsed (YAML)."""
    if isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError("must be a JSON object")
    return parsed


def coerce(spec: FieldSpec, value: Any) -> Any:
    """Convert a YAML/CLI value to the field's type; raises ValueError naming the problem."""
    if value is None:
        if spec.optional or spec.base is dict:
            return None
        raise ValueError("must not be null")
    if spec.kind == "bytes":
        return parse_bytes(value)
    if spec.kind == "json":
        return parse_json_object(value)
    if spec.is_list:
        items = [value] if isinstance(value, str) else list(value)
        return [spec.base(v) for v in items]
    if spec.base is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {value!r}")
    if spec.base is int:
        if isinstance(value, bool) or (isinstance(value, float) and value != int(value)):
            raise ValueError(f"expected an integer, got {value!r}")
        return int(value)
    if spec.base is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if spec.base is str:
        return str(value)
    return value


def validate_fields(obj: Any) -> None:
    """Check every setting of dataclass instance ``obj`` against its declared type.

    Raises ValueError naming the flag: a value outside a ``Literal``'s
    choices, a number outside its bounds, or a value of the wrong type.
    Called from each config's ``__post_init__``: settings are validated once,
    at the edge, whoever builds them (CLI, YAML or code).
    """
    for spec in field_specs(type(obj)):
        value = getattr(obj, spec.name)
        if value is None:
            if not (spec.optional or spec.base is dict):
                raise ValueError(f"{spec.flag}: must be set")
            continue
        if spec.choices is not None and str(value) not in spec.choices:
            raise ValueError(f"{spec.flag}: {value!r} is not one of {', '.join(spec.choices)}")
        if spec.base in (int, float) and not spec.is_list:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{spec.flag}: expected a number, got {value!r}")
            if spec.minimum is not None and value < spec.minimum:
                raise ValueError(f"{spec.flag}: must be at least {spec.minimum:g}, got {value}")
            if spec.maximum is not None and value > spec.maximum:
                raise ValueError(f"{spec.flag}: must be at most {spec.maximum:g}, got {value}")
        if spec.base is bool and not isinstance(value, bool):
            raise ValueError(f"{spec.flag}: expected true or false, got {value!r}")
