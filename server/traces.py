"""``GET /v1/traces/{id}``: request traces (``engine/trace.py``) over HTTP.

Contracts:
- ``{id}`` is a response's ``id`` (``chatcmpl-...`` / ``cmpl-...``); the server
  builds response ids as the OpenAI prefix + the engine request id, so the
  lookup is stateless. A bare engine request id works too. ``{id}-{k}``
  addresses choice ``k`` of an ``n > 1`` chat request or prompt ``k`` of a
  multi-prompt completion; the plain id answers choice 0 of the first prompt.
- Without ``--enable-request-traces``, or for an unknown/evicted id, the answer
  is 404 in the OpenAI error envelope (the route raises :class:`TraceNotFound`).
- The trace is copied between engine steps (``EngineClient.get_trace``), so
  the engine loop never mutates what is being serialized.
- Default view: the whole trace. It holds metadata only unless the engine runs
  with ``--log-prompts``; then the recorded token ids are also decoded into
  ``prompt_text`` / ``output_text``. ``?publish=true`` answers
  :func:`engine.trace.review_for_publication` (text, token ids and ``user``
  stripped, timings checked).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.client import (
    ClientTokenizer,
    EngineClient,
    RequestTrace,
    review_for_publication,
    summarize_timings,
)

# Response-id prefixes the server puts in front of engine request ids.
RESPONSE_ID_PREFIXES: tuple[str, ...] = ("chatcmpl-", "cmpl-")


class TraceNotFound(LookupError):
    """No trace for the id: tracing off, unknown id, evicted, or no engine support."""


def engine_id_candidates(trace_id: str) -> list[str]:
    """Engine request ids to try for ``trace_id``, most specific first.

    The prefix is stripped; then the id itself, its choice 0 (``n > 1`` chat,
    or prompt 0 of a completion) and choice 0 of prompt 0 (multi-prompt
    completion with ``n > 1``).
    """
    base = trace_id
    for prefix in RESPONSE_ID_PREFIXES:
        if trace_id.startswith(prefix):
            base = trace_id[len(prefix) :]
            break
    return [base, f"{base}-0", f"{base}-0-0"]


def decode_content(trace: RequestTrace, tokenizer: ClientTokenizer) -> None:
    """Fill ``prompt_text`` / ``output_text`` from recorded token ids (``--log-prompts`` only).

    The engine records ids, not text; without ``--log-prompts`` there are no
    ids and this does nothing. Special tokens are kept so the chat template
    shows. Mutates ``trace`` (a snapshot, never the stored trace).
    """
    if trace.prompt_text is None and trace.prompt_token_ids is not None:
        trace.prompt_text = tokenizer.decode(trace.prompt_token_ids, skip_special_tokens=False)
    if trace.output_text is None and trace.output_token_ids is not None:
        trace.output_text = tokenizer.decode(trace.output_token_ids, skip_special_tokens=False)


def trace_to_dict(trace: RequestTrace) -> dict[str, Any]:
    """The full trace as JSON-ready data: events with ``kind``, timing sums, content if any.

    Private fields appear only when they were recorded (``--log-prompts``);
    a metadata-only trace has no ``prompt_text`` etc. keys at all.
    """
    out: dict[str, Any] = {
        "object": "trace",
        "request_id": trace.request_id,
        "arrival_s": trace.arrival_s,
        "finished": trace.finished is not None,
        "events": [{"kind": e.kind, **dataclasses.asdict(e)} for e in trace.events],
        "num_dropped_events": trace.num_dropped_events,
        "timings": dataclasses.asdict(summarize_timings(trace)),
    }
    for name in ("prompt_text", "output_text", "prompt_token_ids", "output_token_ids", "user"):
        value = getattr(trace, name)
        if value is not None:
            out[name] = value
    return out


async def fetch_trace(engine: EngineClient, trace_id: str, *, publish: bool) -> dict[str, Any]:
    """The JSON body for ``GET /v1/traces/{trace_id}``; raises :class:`TraceNotFound`."""
    trace = await engine.get_trace(engine_id_candidates(trace_id))
    if trace is None:
        raise TraceNotFound(trace_id)
    if publish:
        # Published traces never carry content, so there is nothing to decode.
        return review_for_publication(trace)
    decode_content(trace, engine.tokenizer)
    return trace_to_dict(trace)
