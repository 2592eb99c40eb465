"""The state machine shared by formats of the shape ``MARKER json-value [END]``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.tool_parsers.base import (
    IdGenerator,
    JsonExtentScanner,
    ToolStreamParser,
    held_prefix_len,
    loads_strict,
    skip_ws,
)

Converter = Callable[[Any, "frozenset[str] | None"], "list[tuple[str, str]] | None"]

_CONTENT, _BLOCK_WS, _BLOCK_JSON, _BLOCK_END = range(4)


class MarkedBlockStreamParser(ToolStreamParser):
    """Content, then blocks ``marker ws VALUE ws end_marker`` (end optional).

    ``openers`` are the characters a VALUE may start with (``{`` and/or ``[``);
    ``convert`` turns the decoded VALUE into calls or None (invalid). A block that
    fails at any point is replaced by its marker as content, and scanning resumes
    right after the marker, so the block's text ends up as content verbatim.
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

    def _fail_block(self) -> None:
        # Only the marker is decided to be content; what follows is re-scanned.
        self._pos = self._block_start + len(self._marker)
        self._emit_content(self._buf[self._block_start : self._pos])
        self._state = _CONTENT
        self._scanner = None

    def _advance(self, final: bool) -> None:
        buf = self._buf
        while True:
            if self._state == _CONTENT:
                k = buf.find(self._marker, self._pos)
                if k < 0:
                    rest = buf[self._pos :]
                    hold = 0 if final else held_prefix_len(rest, self._marker)
                    self._emit_content(rest[: len(rest) - hold])
                    self._pos = len(buf) - hold
                    self._compact()
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
                        self._fail_block()
                        continue
                    return
                if buf[i] not in self._openers:
                    self._fail_block()
                    continue
                self._json_start = i
                self._scanner = JsonExtentScanner(i)
                self._state = _BLOCK_JSON
            elif self._state == _BLOCK_JSON:
                assert self._scanner is not None
                end = self._scanner.scan(buf)
                if end is None:
                    if final:
                        self._fail_block()
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
                if len(tail) < len(self._end) and self._end.startswith(tail) and not final:
                    return
                if tail != self._end:
                    self._fail_block()
                    continue
                try:
                    value = loads_strict(buf[self._json_start : self._json_end])
                except ValueError:
                    self._fail_block()
                    continue
                calls = self._convert(value, self._names)
                if not calls:
                    self._fail_block()
                    continue
                for name, arguments in calls:
                    self._emit_call(name, arguments)
                self._pos = i + len(self._end)
                self._state = _CONTENT
                self._scanner = None
