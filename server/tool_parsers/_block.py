"""The state machine shared by formats of the shape ``MARKER json-value [END]``."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from server.tool_parsers.base import (
    IdGenerator,
    JsonExtentScanner,
    ToolStreamParser,
    held_prefix_len,
    loads_strict,
    normalize_call,
    skip_ws,
)

Converter = Callable[[Any, "frozenset[str] | None"], "list[tuple[str, str]] | None"]

_CONTENT, _BLOCK_WS, _BLOCK_JSON, _BLOCK_END, _BLOCK_NAME = range(5)
# A function name in the ``NAME[ARGS]`` form: OpenAI's rule (letters, digits,
# underscores, dashes; at most 64), read up to the args marker.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_MAX_NAME_SPAN = 256  # characters to wait for the args marker before giving up


class MarkedBlockStreamParser(ToolStreamParser):
    """Content, then blocks ``marker ws VALUE ws end_marker`` (end optional).

    ``openers`` are the characters a VALUE may start with (``{`` and/or ``[``);
    ``convert`` turns the decoded VALUE into calls or None (invalid). A block that
    fails at any point is replaced by its marker as content, and scanning resumes
    right after the marker, so the block's text ends up as content verbatim.
    With ``args_marker`` (Mistral v11's ``[ARGS]``), a block may also be
    ``marker NAME args_marker {ARGS}``: one call of NAME (an optional
    ``[CALL_ID]id`` after the name is ignored).
    """

    def __init__(
        self,
        names: frozenset[str] | None,
        id_generator: IdGenerator,
        *,
        marker: str,
        openers: str,
        end_marker: str,
        convert: Converter,
        args_marker: str | None = None,
    ) -> None:
        super().__init__(names, id_generator)
        self._marker = marker
        self._openers = openers
        self._end = end_marker
        self._convert = convert
        self._state = _CONTENT
        self._block_start = 0
        self._json_start = 0
        self._json_end = 0
        self._scanner: JsonExtentScanner | None = None
        self._args_marker = args_marker
        self._name: str | None = None  # set while reading a NAME[ARGS]{...} block

    def _fail_block(self) -> None:
        # Only the marker is decided to be content; what follows is re-scanned.
        self._pos = self._block_start + len(self._marker)
        self._emit_content(self._buf[self._block_start : self._pos])
        self._state = _CONTENT
        self._scanner = None
        self._name = None

    def _incomplete_block(self) -> None:
        """The text ended inside a block: content, or nothing when dropping incomplete calls."""
        if not self._drop_incomplete:
            self._fail_block()
            return
        self._drop_rest()
        self._state = _CONTENT
        self._scanner = None
        self._name = None

    def _read_name(self, final: bool) -> bool:
        """``NAME[ARGS]``: find the args marker; True once the ARGS object may be scanned."""
        assert self._args_marker is not None
        buf = self._buf
        k = buf.find(self._args_marker, self._pos)
        if k < 0:
            span = buf[self._pos :]
            if len(span) > _MAX_NAME_SPAN or "{" in span or "\n" in span:
                self._fail_block()
            elif final:
                self._incomplete_block()
            return False
        name = buf[self._pos : k].split("[CALL_ID]", 1)[0].strip()
        if not _NAME_RE.match(name):
            self._fail_block()
            return False
        i = skip_ws(buf, k + len(self._args_marker))
        if i == len(buf):
            if final:
                self._incomplete_block()
            return False
        if buf[i] != "{":
            self._fail_block()
            return False
        self._name = name
        self._json_start = i
        self._scanner = JsonExtentScanner(i)
        self._state = _BLOCK_JSON
        return True

    def _convert_block(self, value: Any) -> list[tuple[str, str]] | None:
        if self._name is None:
            return self._convert(value, self._names)
        call = normalize_call({"name": self._name, "arguments": value}, self._names, ("arguments",))
        return None if call is None else [call]

    def _advance(self, final: bool) -> None:
        # Over 80 lines on purpose: one loop over the states of one machine, a branch
        # per state, reads better in one place than split across helpers.
        buf = self._buf
        while True:
            if self._state == _CONTENT:
                k = buf.find(self._marker, self._pos)
                if k < 0:
                    rest = buf[self._pos :]
                    hold = held_prefix_len(rest, self._marker)
                    if final and not self._drop_incomplete:
                        hold = 0  # a marker's beginning at the very end is text
                    self._emit_content(rest[: len(rest) - hold])
                    self._pos = len(buf) - hold
                    self._compact()
                    if final:
                        self._drop_rest()
                    return
                self._emit_content(buf[self._pos : k])
                self._pos = k
                self._compact()
                buf = self._buf
                self._block_start = 0
                self._pos = len(self._marker)
                self._state = _BLOCK_WS
            elif self._state == _BLOCK_WS:
                i = skip_ws(buf, self._pos)
                if i == len(buf):
                    if final:
                        self._incomplete_block()
                        continue
                    return
                if buf[i] not in self._openers:
                    if self._args_marker is not None:
                        self._pos = i
                        self._state = _BLOCK_NAME
                        continue
                    self._fail_block()
                    continue
                self._json_start = i
                self._scanner = JsonExtentScanner(i)
                self._state = _BLOCK_JSON
            elif self._state == _BLOCK_NAME:
                if not self._read_name(final):
                    if self._state == _BLOCK_NAME:
                        return  # waiting for more text
                    continue
            elif self._state == _BLOCK_JSON:
                assert self._scanner is not None
                end = self._scanner.scan(buf)
                if end is None:
                    if final:
                        self._incomplete_block()
                        continue
                    return
                if end == JsonExtentScanner.FAILED:
                    self._fail_block()
                    continue
                self._json_end = end
                self._pos = end
                self._state = _BLOCK_END
            else:  # _BLOCK_END
                i = skip_ws(buf, self._json_end) if self._end else self._json_end
                tail = buf[i : i + len(self._end)]
                if len(tail) < len(self._end) and self._end.startswith(tail):
                    if not final:
                        return
                    self._incomplete_block()
                    continue
                if tail != self._end:
                    self._fail_block()
                    continue
                try:
                    value = loads_strict(buf[self._json_start : self._json_end])
                except ValueError:
                    self._fail_block()
                    continue
                calls = self._convert_block(value)
                if not calls:
                    self._fail_block()
                    continue
                for name, arguments in calls:
                    self._emit_call(name, arguments)
                self._pos = i + len(self._end)
                self._state = _CONTENT
                self._scanner = None
                self._name = None
