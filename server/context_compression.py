"""Context compression: fit a conversation that exceeds the context by dropping whole turns.

Asked for by ``truncation: "auto"`` on a chat request (OpenAI's Responses API
name), or for every request without ``truncation`` by ``--context-compression
auto``. It runs only where the request would otherwise be refused with
``context_length_exceeded``; a conversation that fits is never touched.

Selection rule (``select_turns``):

* Units. A turn is a ``user`` message and every message after it up to the next
  ``user`` message (the assistant's reply, its tool calls and their ``tool``
  results), so a unit is kept or dropped whole: never half a turn, never an
  assistant tool call without its result. Messages before the first ``user``
  message (other than system ones) form a unit of their own.
* Pinned, always kept: every ``system``/``developer`` message and the newest
  turn (the last ``user`` message and everything after it, tool results
  included). If they alone do not fit, the request gets the same 400 it gets
  without compression.
* The other turns are ranked by ``relevance + 0.5 * recency``: relevance is the
  BM25 score (k1 = 1.2, b = 0.75, Lucene's non-negative IDF) of the turn's
  words against the newest turn's words (words: lower-cased ``\\w+`` runs),
  divided by the best candidate's score (0 for all when no word overlaps);
  recency is ``r / m`` for the r-th oldest of m candidates (the newest earlier
  turn has 1). Ties go to the newer turn. In that order a turn is kept when its
  tokens fit in what is left of the budget; one that does not fit is skipped
  and smaller ones after it may still be kept.
* The budget is the context minus the room the answer needs (``max_tokens``,
  or ``--context-compression-reserve`` when the request sets none). A turn's
  tokens come from the rendered prompt's segments (exact for templates that
  render a conversation message by message); the kept messages are rendered
  again in their original order and, should the template not add up (so the
  render still exceeds the budget), the lowest-ranked kept turn is dropped too,
  until it fits.

The response reports what was dropped: ``usage.context_compression`` =
``{"dropped_messages": [indices into the request's messages], "dropped_tokens":
prompt tokens saved}`` and the headers ``x-fuel-context-dropped-messages``
(comma-separated indices) and ``x-fuel-context-dropped-tokens``.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from engine.client import JsonObject
from engine.request import Segment
from server.prompts import ChatPrompt

SYSTEM_ROLES = frozenset({"system", "developer"})
RECENCY_WEIGHT = 0.5
BM25_K1 = 1.2
BM25_B = 0.75
_WORD_RE = re.compile(r"\w+")

DROPPED_MESSAGES_HEADER = "x-fuel-context-dropped-messages"
DROPPED_TOKENS_HEADER = "x-fuel-context-dropped-tokens"


@dataclass(frozen=True)
class Compression:
    """The outcome: the prompt to run and what was left out of it.

    ``prompt.segments`` index the request's original messages (``kept`` maps
    a position in the kept list back to it).
    """

    prompt: ChatPrompt
    kept: list[int]  # original indices of the messages rendered, in order
    dropped: list[int]  # original indices of the messages left out, ascending
    dropped_tokens: int

    def usage_field(self) -> JsonObject:
        """The ``usage.context_compression`` extension."""
        return {"dropped_messages": list(self.dropped), "dropped_tokens": self.dropped_tokens}

    def headers(self) -> dict[str, str]:
        return {
            DROPPED_MESSAGES_HEADER: ",".join(str(i) for i in self.dropped),
            DROPPED_TOKENS_HEADER: str(self.dropped_tokens),
        }


def turn_units(messages: Sequence[JsonObject]) -> tuple[list[list[int]], int | None]:
    """The droppable units (lists of message indices, in order) and which is the newest.

    System messages belong to no unit (they are always kept). The newest unit is
    the one holding the last ``user`` message (None when there is no unit).
    """
    units: list[list[int]] = []
    newest: int | None = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if role in SYSTEM_ROLES:
            continue
        if role == "user" or not units:
            units.append([i])
        else:
            units[-1].append(i)
        if role == "user":
            newest = len(units) - 1
    if newest is None and units:
        newest = len(units) - 1
    return units, newest


def message_text(message: JsonObject) -> str:
    """The words a message contributes to relevance: its text and its tool calls."""
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(str(part["text"]))
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            # The name and arguments, not the envelope every call shares ("id", "type"...).
            args = fn.get("arguments")
            parts.append(str(fn.get("name", "")))
            parts.append(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    return "\n".join(parts)


def words(text: str) -> list[str]:
    return _WORD_RE.findall(text.lower())


def bm25_scores(query: Sequence[str], docs: Sequence[Sequence[str]]) -> list[float]:
    """Okapi BM25 of each doc against the query terms (each distinct term counted once)."""
    n = len(docs)
    if n == 0:
        return []
    avg_len = sum(len(d) for d in docs) / n or 1.0
    df: Counter[str] = Counter()
    for d in docs:
        df.update(set(d))
    terms = set(query)
    idf = {t: math.log((n - df[t] + 0.5) / (df[t] + 0.5) + 1.0) for t in terms if df[t]}
    scores: list[float] = []
    for d in docs:
        tf = Counter(d)
        norm = BM25_K1 * (1.0 - BM25_B + BM25_B * len(d) / avg_len)
        scores.append(
            sum(w * tf[t] * (BM25_K1 + 1.0) / (tf[t] + norm) for t, w in idf.items() if tf[t])
        )
    return scores


def rank_units(
    messages: Sequence[JsonObject], candidates: Sequence[list[int]], query: str
) -> list[int]:
    """Candidate positions (indices into ``candidates``, oldest first) best first."""
    docs = [words(" ".join(message_text(messages[i]) for i in unit)) for unit in candidates]
    rel = bm25_scores(words(query), docs)
    best = max(rel, default=0.0)
    m = len(candidates)
    score = [
        (r / best if best > 0 else 0.0) + RECENCY_WEIGHT * (c + 1) / m for c, r in enumerate(rel)
    ]
    return sorted(range(m), key=lambda c: (-score[c], -c))


def message_costs(
    messages: Sequence[JsonObject], prompt: ChatPrompt, encode: Callable[[str], list[int]]
) -> list[int]:
    """Prompt tokens each message renders to (from the segments; estimated without them)."""
    if prompt.segments:
        costs = [0] * len(messages)
        for s in prompt.segments:
            costs[s.turn] += s.end - s.start
        return costs
    # A template the renderer could not split: the text's tokens are a lower bound,
    # and the re-render check in ``compress`` makes the result fit regardless.
    return [len(encode(message_text(m))) for m in messages]


Renderer = Callable[[list[JsonObject]], Awaitable[ChatPrompt]]


async def compress(
    messages: list[JsonObject],
    prompt: ChatPrompt,
    budget: int,
    render: Renderer,
    encode: Callable[[str], list[int]],
) -> Compression | None:
    """Drop whole turns until the rendered prompt has at most ``budget`` tokens.

    ``prompt`` is ``messages`` rendered; ``render`` renders a subset the same
    way. None when the pinned messages (system ones, the newest turn) do not fit
    on their own: the caller answers the usual ``context_length_exceeded``.
    """
    units, newest = turn_units(messages)
    if newest is None or budget < 1:
        return None
    candidates = [u for k, u in enumerate(units) if k != newest]
    costs = message_costs(messages, prompt, encode)
    unit_cost = [sum(costs[i] for i in u) for u in candidates]
    room = budget - (len(prompt.token_ids) - sum(unit_cost))
    if room < 0:
        return None
    query = " ".join(message_text(messages[i]) for i in units[newest])
    order = rank_units(messages, candidates, query)
    chosen: list[int] = []  # candidate positions kept, best first
    for c in order:
        if unit_cost[c] <= room:
            chosen.append(c)
            room -= unit_cost[c]
    # Re-render what is kept; drop the lowest-ranked kept turn while it still does not fit.
    pinned = set(units[newest])
    while True:
        keep_set = pinned.union(*(candidates[c] for c in chosen))
        kept = [i for i, m in enumerate(messages) if m.get("role") in SYSTEM_ROLES or i in keep_set]
        rendered = await render([messages[i] for i in kept])
        if len(rendered.token_ids) <= budget:
            break
        if not chosen:
            return None
        chosen.pop()
    segments = tuple(Segment(s.start, s.end, s.kind, kept[s.turn]) for s in rendered.segments)
    kept_set = set(kept)
    return Compression(
        prompt=ChatPrompt(rendered.token_ids, segments),
        kept=kept,
        dropped=[i for i in range(len(messages)) if i not in kept_set],
        dropped_tokens=len(prompt.token_ids) - len(rendered.token_ids),
    )


def wants_compression(truncation: str | None, server_default: str) -> bool:
    """The request's ``truncation`` if set, else the server's ``--context-compression``."""
    if truncation is not None:
        return truncation == "auto"
    return server_default == "auto"


__all__ = [
    "DROPPED_MESSAGES_HEADER",
    "DROPPED_TOKENS_HEADER",
    "Compression",
    "bm25_scores",
    "compress",
    "rank_units",
    "turn_units",
    "wants_compression",
]
