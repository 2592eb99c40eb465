"""Incremental detokenization and stop-string matching for streamed output."""

from __future__ import annotations

from engine.text.tokenizer import Tokenizer

# How many trailing prompt tokens serve as decoding context for the first
# output tokens. A few are enough for any decoder to see the token boundary.
_PROMPT_CONTEXT_TOKENS = 6

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of final text pieces.

    ``add(token_id)`` returns the text that became final with that token,
    possibly ``""``: text is held back while the decoded window ends in U+FFFD
    (an incomplete multi-byte UTF-8 character, split over byte-level or
    byte-fallback tokens). ``flush()`` releases what is still held at the end.

    Decoding works on a small window (``prefix_offset``..end): the new text is
    ``decode(window)`` minus ``decode(window without the unread tokens)``, so
    per-token work is O(1) amortized and decoders that strip a leading space at
    the start of a sequence (SentencePiece ``▁``) strip it from both sides
    alike.

    Invariant: with an empty ``prompt_ids`` the concatenation of everything
    ``add`` and ``flush`` return equals ``tokenizer.decode(output_ids,
    skip_special_tokens=...)``. With a prompt, the last few prompt tokens are
    decoding context, so the output reads as a continuation of the prompt: for
    byte-level BPE (GPT-2 style) that is the same text; for SentencePiece
    tokenizers the first token keeps the leading space that decoding the
    output alone would drop. Context is not used when the prompt's tail does
    not end on a complete character.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            # The context's last character is incomplete; output bytes could
            # complete it, which would rewrite context text. Decode without it.
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _pending_text(self) -> str:
        """Decoded text of the unread tokens (may end in an incomplete character)."""
        window = self._tokens[self._prefix_offset :]
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(window)
        # The read part ends on a complete character (we only advance there),
        # so its text is a prefix of the window's text.
        return new_text[len(prefix_text) :]

    def add(self, token_id: int) -> str:
        """Append one generated token; return the text that is now final."""
        self._tokens.append(token_id)
        self.output_ids.append(token_id)
        piece = self._pending_text()
        if not piece or piece.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        # Keep the token list bounded to the window; older tokens are final.
        if self._prefix_offset > 4096:
            del self._tokens[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return piece

    def flush(self) -> str:
        """Release held-back text (e.g. a final incomplete character as U+FFFD)."""
        piece = self._pending_text()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return piece


class StopStringMatcher:
    """Finds stop strings in streamed text without ever emitting part of one.

    ``feed(text)`` returns ``(safe_text, matched)``. Text that could still be
    the start of a stop string (the longest suffix that is a prefix of some
    stop) is held back until disambiguated. The match reported is the first
    stop to *complete* in the stream (ties: the one starting earliest), which
    makes the result independent of how the text was chunked. On a match the
    safe text ends right before the stop (or right after it with
    ``include_stop_str_in_output``); later ``feed`` calls return ``("", None)``.
    ``flush()`` returns the held-back text when the stream ends with no match.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stops) if s]
        self._include = include_stop_str_in_output
        self._buffer = ""
        self.matched: str | None = None

    @property
    def finished(self) -> bool:
        return self.matched is not None

    def feed(self, new_text: str) -> tuple[str, str | None]:
        """Add streamed text; return the text safe to emit and the matched stop."""
        if self.matched is not None:
            return "", None
        if not self._stops:
            return new_text, None
        old_len = len(self._buffer)
        buf = self._buffer + new_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            # A stop completing now must end inside the new text; the held
            # buffer is shorter than every stop, so start searching early enough.
            start = buf.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is not None:
            end, start, stop = best
            self.matched = stop
            self._buffer = ""
            return (buf[:end] if self._include else buf[:start]), stop
        hold = self._held_suffix_len(buf)
        self._buffer = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Release held-back text at the end of the stream (no stop matched)."""
        out, self._buffer = self._buffer, ""
        return out
