"""Shared types and the streaming machinery of the tool-call parsers.

Contract (all parsers):

* ``ToolParser.parse(text)`` is *defined* as ``stream().feed(text)`` followed by
  ``finish()``. Streaming and non-streaming therefore run the same state machine,
  and the machine only ever makes a decision that no later text can change (it
  waits otherwise). So for every chunking of the same text the concatenated
  streamed content equals the parsed content, the streamed calls equal the parsed
  calls (same ids when the same id generator is used), and indexes are 0, 1, 2...
* A call is emitted once its block is complete and valid (known function name,
  arguments a JSON object). Emitting earlier would mean emitting text that a later
  syntax error would have to retract; holding the call costs a little latency on
  the argument stream and buys exactness. Each emitted call streams as two deltas:
  ``(index, id, name, "")`` then ``(index, None, None, arguments)``; ``{}``
  arguments are emitted like any other.
* Arguments are re-serialized as compact JSON (``separators=(",", ":")``,
  ``ensure_ascii=False``), identically in both paths.
* Malformed output (unterminated block, invalid JSON, unknown function name, wrong
  shape) is never an error: the offending block falls back to plain content.
  Except, with ``finish(drop_incomplete=True)``, a block the text ends inside
  (cut off by ``max_tokens``, or any unfinished call of a forced turn) is
  dropped: a half call is neither a call nor content.
* Whitespace between a tool-call block and the next block, the start or the end
  of the text is dropped (it is the model's separator, not content); whitespace
  between a block and later content is kept, so words never get glued together;
  all other text is content, verbatim (plain text comes back unchanged).
"""

from __future__ import annotations

import itertools
import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

IdGenerator = Callable[[], str]


def random_call_id() -> str:
    """A fresh OpenAI-style call id: ``call_`` + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def sequential_ids(prefix: str = "call_") -> IdGenerator:
    """A deterministic id generator (``call_0``, ``call_1``, ...), for tests and replays."""
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter)}"


@dataclass
class ToolCall:
    """One complete function call; ``arguments`` is compact JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedMessage:
    """A parsed assistant message. ``content`` is None when it is empty and calls exist."""

    content: str | None
    tool_calls: list[ToolCall]


@dataclass
class ToolCallDelta:
    """One streamed piece of a call, in OpenAI's shape.

    The first delta of a call carries ``id`` and ``name`` (and empty arguments);
    later deltas carry only argument fragments.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class StreamDelta:
    """What one ``feed``/``finish`` produced: new content text and new call deltas."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> frozenset[str] | None:
    """Function names declared in OpenAI ``tools`` (None: no list given, accept any name)."""
    if tools is None:
        return None
    names: set[str] = set()
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return frozenset(names)


def _reject_constant(token: str) -> Any:
    # NaN/Infinity are not JSON; accepting them would re-serialize to invalid JSON.
    raise ValueError(f"non-standard JSON constant {token}")


def loads_strict(text: str) -> Any:
    """``json.loads`` that rejects NaN/Infinity; raises ``ValueError`` on bad JSON."""
    return json.loads(text, parse_constant=_reject_constant)


def compact_json(value: Any) -> str:
    """The one serialization of arguments used by every parser and both paths."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def normalize_call(
    obj: Any, names: frozenset[str] | None, argument_keys: Iterable[str]
) -> tuple[str, str] | None:
    """``(name, compact arguments)`` for a decoded call object, or None when invalid.

    The arguments live under the first present key of ``argument_keys``; a JSON
    string holding an object is accepted (some models double-encode); a missing
    key means ``{}`` (models often omit arguments of parameterless functions).
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (names is not None and name not in names):
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = loads_strict(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, compact_json(args)


class JsonExtentScanner:
    """Finds, incrementally, where the JSON object/array starting at ``start`` ends.

    String-aware (braces and end tags inside strings don't count) and bracket
    matched; it does not validate the JSON (``loads_strict`` does, once closed).
    """

    FAILED = -1

    def __init__(self, start: int) -> None:
        self._i = start
        self._stack: list[str] = []
        self._in_string = False
        self._escaped = False

    def scan(self, buf: str) -> int | None:
        """End index (exclusive) once closed, None if more text is needed, FAILED on mismatch."""
        closers = {"{": "}", "[": "]"}
        i = self._i
        n = len(buf)
        while i < n:
            ch = buf[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in closers:
                self._stack.append(closers[ch])
            elif ch in "}]":
                if not self._stack or self._stack.pop() != ch:
                    self._i = i
                    return self.FAILED
                if not self._stack:
                    self._i = i
                    return i
        self._i = i
        return None


def held_prefix_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def skip_ws(buf: str, i: int) -> int:
    """First index at or after ``i`` that is not JSON whitespace."""
    n = len(buf)
    while i < n and buf[i] in " \t\r\n":
        i += 1
    return i


class ToolStreamParser(ABC):
    """Incremental parser for one response. ``feed`` chunks, then ``finish`` once.

    Subclasses implement ``_advance(final)``: consume as much of ``self._buf`` from
    ``self._pos`` as can be decided, through ``_emit_content`` / ``_emit_call``.
    With ``final`` true no more text will come, so nothing may be left undecided.
    """

    def __init__(self, names: frozenset[str] | None, id_generator: IdGenerator) -> None:
        self._names = names
        self._new_id = id_generator
        self._buf = ""
        self._pos = 0
        self._finished = False
        self._pending_ws = ""  # held whitespace: dropped if a call or the end follows a call
        self._after_call = False  # the last thing emitted was a call
        self._n_calls = 0
        self._out_content: list[str] = []
        self._out_calls: list[ToolCallDelta] = []
        self._drop_incomplete = False  # set by finish()

    def _drop_rest(self) -> None:
        """Discard the undecided text from ``_pos`` on (an incomplete block at the end)."""
        self._pos = len(self._buf)

    def feed(self, text_chunk: str) -> StreamDelta:
        """Add generated text; return what can now be emitted for certain."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._buf += text_chunk
        self._advance(final=False)
        return self._take()

    def finish(self, drop_incomplete: bool = False) -> StreamDelta:
        """The response ended: resolve everything still held back.

        ``drop_incomplete``: a call block the text ends inside (cut off by
        ``max_tokens``, or any text of a grammar-forced turn) is dropped
        instead of becoming content: no half call, no raw markup in content.
        """
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._drop_incomplete = drop_incomplete
        self._advance(final=True)
        if not self._after_call:  # whitespace after the last call is a separator
            self._out_content.append(self._pending_ws)
        self._pending_ws = ""
        self._finished = True
        return self._take()

    @abstractmethod
    def _advance(self, final: bool) -> None: ...

    def _compact(self) -> None:
        """Drop consumed text (only call when no block index into ``_buf`` is live)."""
        if self._pos:
            self._buf = self._buf[self._pos :]
            self._pos = 0

    def _emit_content(self, text: str) -> None:
        # Piecewise-invariant: emitting "a " then "b" gives the same text as "a b".
        # Trailing whitespace is held: a following call drops it, content keeps it.
        body = text.rstrip(" \t\r\n")
        if body:
            self._out_content.append(self._pending_ws + body)
            self._pending_ws = text[len(body) :]
            self._after_call = False
        else:
            self._pending_ws += text

    def _emit_call(self, name: str, arguments: str) -> None:
        self._pending_ws = ""
        self._after_call = True
        index = self._n_calls
        self._n_calls += 1
        self._out_calls.append(ToolCallDelta(index, self._new_id(), name, ""))
        self._out_calls.append(ToolCallDelta(index, None, None, arguments))

    def _take(self) -> StreamDelta:
        delta = StreamDelta("".join(self._out_content), self._out_calls)
        self._out_content = []
        self._out_calls = []
        return delta


class ToolParser(ABC):
    """A model family's tool-call format. Stateless; one ``stream()`` per response.

    ``tools`` (OpenAI ``tools`` list) restricts accepted function names; None
    accepts any name. ``id_generator`` makes call ids (default: random).
    """

    name: str = ""

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        id_generator: IdGenerator | None = None,
    ) -> None:
        self._names = tool_names(tools)
        self._id_generator = id_generator or random_call_id

    @abstractmethod
    def stream(self, id_generator: IdGenerator | None = None) -> ToolStreamParser:
        """A fresh incremental parser (``id_generator`` overrides the parser's)."""

    def parse(
        self,
        text: str,
        id_generator: IdGenerator | None = None,
        *,
        drop_incomplete: bool = False,
    ) -> ParsedMessage:
        """Parse a complete response; same result as streaming it in any chunking."""
        parser = self.stream(id_generator)
        deltas = [parser.feed(text), parser.finish(drop_incomplete)]
        return assemble(deltas)


def assemble(deltas: Iterable[StreamDelta]) -> ParsedMessage:
    """Fold streamed deltas into the message they describe (how a client does it)."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                calls.append(ToolCall(piece.id or "", piece.name or "", ""))
            elif piece.index != len(calls) - 1:
                raise ValueError(f"tool call index {piece.index} out of order")
            calls[piece.index].arguments += piece.arguments
    text = "".join(content)
    return ParsedMessage(None if not text and calls else text, calls)
