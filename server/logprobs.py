"""Logprobs in OpenAI's two shapes: chat's ``content`` entries and completions' columns.

The numbers are the engine's (the model's log-softmax, before any sampling
transform); this module only formats them. JSON has no infinity, so a logprob
of ``-inf`` (or NaN) is reported as ``MIN_LOGPROB``, as OpenAI does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engine.client import ClientTokenizer, JsonObject, JsonValue
from engine.outputs import PositionLogprobs

MIN_LOGPROB = -9999.0


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def _chat_entry(tok: ClientTokenizer, token_id: int, logprob: float) -> JsonObject:
    return {
        "token": tok.token_to_text(token_id),
        "logprob": _clamp(logprob),
        "bytes": list(tok.token_bytes(token_id)),
    }


def chat_logprobs(
    tok: ClientTokenizer, positions: Sequence[PositionLogprobs], top_k: int
) -> list[JsonObject]:
    """Chat ``logprobs.content``: one entry per generated token with its top ``top_k``."""
    out = []
    for pos in positions:
        entry = _chat_entry(tok, pos.chosen.token_id, pos.chosen.logprob)
        entry["top_logprobs"] = [
            _chat_entry(tok, alt.token_id, alt.logprob) for alt in pos.top[:top_k]
        ]
        out.append(entry)
    return out


def completion_logprobs(
    tok: ClientTokenizer,
    positions: Sequence[PositionLogprobs | None],
    token_ids: Sequence[int],
    start_offset: int,
    top_k: int,
) -> tuple[JsonObject, int]:
    """Completions-style logprobs of ``token_ids``, and the text offset after them.

    ``text_offset`` counts characters of the tokens' texts from ``start_offset``
    (the echoed prompt's tokens come first when ``echo`` is on). A position
    without logprobs (the first prompt token) reports ``null``.
    """
    tokens: list[JsonValue] = []
    token_logprobs: list[JsonValue] = []
    tops: list[JsonValue] = []
    offsets: list[JsonValue] = []
    offset = start_offset
    for tok_id, pos in zip(token_ids, positions):
        text = tok.token_to_text(tok_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if pos is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(max(pos.chosen.logprob, MIN_LOGPROB))
        tops.append(
            {tok.token_to_text(a.token_id): max(a.logprob, MIN_LOGPROB) for a in pos.top[:top_k]}
        )
    return (
        {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        },
        offset,
    )


def merge_completion_logprobs(parts: Sequence[JsonObject]) -> JsonObject:
    """Concatenate completions-style logprobs column by column (echoed prompt, then output)."""
    merged: dict[str, list[JsonValue]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for part in parts:
        for key, column in merged.items():
            values = part[key]
            assert isinstance(values, list)
            column.extend(values)
    return dict(merged)
