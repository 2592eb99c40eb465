"""What the engine hands back: incremental (delta) outputs per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """A token's log-probability under the model's (unprocessed) log-softmax."""

    token_id: int
    logprob: float


@dataclass
class PositionLogprobs:
    """Logprob of the chosen token at one position, plus the top alternatives."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


@dataclass
class CompletionDelta:
    """What one choice (``index``) produced since its previous delta.

    ``delta_text`` pieces of a choice concatenate to exactly its final text;
    text held back for a possible stop-string match is released later or
    dropped when the stop string completes. ``finish_reason`` is set on the
    last delta of the choice: ``stop``, ``length``, ``abort`` or ``error``.
    ``stop_reason`` is the matched stop string or stop token id, if any.
    """

    index: int
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic`` seconds) and counts for one request."""

    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """One event of a request's stream: deltas of the choices that advanced.

    ``finished`` is True on the last event of the request (every choice has
    finished). ``num_cached_tokens`` counts prompt tokens served from the
    prefix cache. ``prompt_logprobs`` (first event only, when asked) holds one
    entry per prompt token, ``None`` for the first.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionDelta]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
