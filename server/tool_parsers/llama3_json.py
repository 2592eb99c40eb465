"""Llama 3.x JSON format: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]*``.

Tool mode starts at ``<|python_tag|>`` (anywhere) or when the response's first
non-whitespace character is ``{``. Calls are JSON objects separated by ``;``; the
sequence ends at the end of the text. If the first object is invalid the block
falls back to content (marker included); if a later one is invalid, the calls
before it stand and the text from its ``;`` on is content.
"""

from __future__ import annotations

from server.tool_parsers.base import (
    IdGenerator,
    JsonExtentScanner,
    ToolParser,
    ToolStreamParser,
    held_prefix_len,
    loads_strict,
    normalize_call,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"
_START, _CONTENT, _OBJ_WS, _OBJ_JSON, _SEP = range(5)


class Llama3JsonStreamParser(ToolStreamParser):
    """Incremental parser for the Llama 3 JSON tool-call format."""

    def __init__(self, names: frozenset[str] | None, id_generator: IdGenerator) -> None:
        super().__init__(names, id_generator)
        self._state = _START
        self._marker_len = 0  # 0 when tool mode began at a bare "{"
        self._first = True  # the object being read is the block's first
        self._sep_start = 0
        self._json_start = 0
        self._scanner: JsonExtentScanner | None = None

    def _fail(self) -> None:
        if self._first:
            # Block starts at 0 (compacted on entry): its marker becomes content.
            self._emit_content(self._buf[: self._marker_len])
            self._pos = self._marker_len
        else:
            self._pos = self._sep_start
        self._state = _CONTENT
        self._scanner = None

    def _incomplete(self) -> None:
        """The text ended inside an object: content, or nothing when dropping incomplete calls."""
        if not self._drop_incomplete:
            self._fail()
            return
        self._drop_rest()
        self._state = _CONTENT
        self._scanner = None

    def _advance(self, final: bool) -> None:
        # Over 80 lines on purpose: one loop over the states of one machine, a branch
        # per state, reads better in one place than split across helpers.
        buf = self._buf
        while True:
            if self._state == _START:
                i = skip_ws(buf, 0)
                if i == len(buf) and not final:
                    return
                if i < len(buf) and buf[i] == "{":
                    self._marker_len = 0
                    self._first = True
                    self._state = _OBJ_WS
                else:
                    self._state = _CONTENT
            elif self._state == _CONTENT:
                k = buf.find(PYTHON_TAG, self._pos)
                if k < 0:
                    rest = buf[self._pos :]
                    hold = held_prefix_len(rest, PYTHON_TAG)
                    if final and not self._drop_incomplete:
                        hold = 0  # a tag's beginning at the very end is text
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
                self._marker_len = len(PYTHON_TAG)
                self._pos = self._marker_len
                self._first = True
                self._state = _OBJ_WS
            elif self._state == _OBJ_WS:
                i = skip_ws(buf, self._pos)
                if i == len(buf):
                    if not final:
                        return
                    if self._first:
                        self._incomplete()
                        continue
                    self._pos = i  # a trailing ";" after the last call: nothing left
                    return
                if buf[i] != "{":
                    self._fail()
                    continue
                self._json_start = i
                self._scanner = JsonExtentScanner(i)
                self._state = _OBJ_JSON
            elif self._state == _OBJ_JSON:
                assert self._scanner is not None
                end = self._scanner.scan(buf)
                if end is None and not final:
                    return
                if end is None:
                    self._incomplete()
                    continue
                if end == JsonExtentScanner.FAILED:
                    self._fail()
                    continue
                try:
                    value = loads_strict(buf[self._json_start : end])
                except ValueError:
                    self._fail()
                    continue
                call = normalize_call(value, self._names, ("parameters", "arguments"))
                if call is None:
                    self._fail()
                    continue
                self._emit_call(*call)
                self._pos = end
                self._scanner = None
                self._state = _SEP
            else:  # _SEP
                i = skip_ws(buf, self._pos)
                if i == len(buf):
                    if final:
                        self._pos = i
                    return
                if buf[i] == ";":
                    self._sep_start = i
                    self._pos = i + 1
                    self._first = False
                    self._state = _OBJ_WS
                else:
                    self._state = _CONTENT  # whitespace before it is skipped after a call


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2/3.3 JSON tool calls (``<|python_tag|>`` optional)."""

    name = "llama3_json"

    def stream(self, id_generator: IdGenerator | None = None) -> ToolStreamParser:
        return Llama3JsonStreamParser(self._names, id_generator or self._id_generator)
