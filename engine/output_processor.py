"""Turns sampled tokens into per-choice text deltas and decides text-level stops.

Runs on the engine thread right after each step, because a stop string ends
the request (and frees its blocks) at once. Per token the work is O(1)
amortised: incremental detokenization over a short window and a stop-string
matcher that holds back only a possible partial match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CompletionDelta, PositionLogprobs, RequestOutput
from engine.request import Request, RequestStatus
from engine.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.text.tokenizer import Tokenizer


@dataclass
class ChoiceState:
    req: Request
    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None
    finished: bool = False


@dataclass
class GroupState:
    """One API request: its n choices and where their outputs go."""

    group_id: str
    prompt_token_ids: list[int]
    choices: list[ChoiceState]
    sink: object  # the async side's delivery handle (opaque to the engine)
    sent_prompt_logprobs: bool = False
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


def token_stop(req: Request, token: int) -> RequestStatus | None:
    """Token-level stop checks after ``token`` was appended to ``req``."""
    p = req.params
    if req.num_output_tokens >= p.min_tokens:
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if req.num_tokens >= req.max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def make_choice(tokenizer: Tokenizer, req: Request) -> ChoiceState:
    p = req.params
    stops = StopStringMatcher(list(p.stop), p.include_stop_str_in_output) if p.stop else None
    detok = IncrementalDetokenizer(
        tokenizer, req.prompt_token_ids, skip_special_tokens=p.skip_special_tokens
    )
    return ChoiceState(req, detok, stops)


def process_token(
    choice: ChoiceState, token: int, logprobs: PositionLogprobs | None
) -> tuple[CompletionDelta, RequestStatus | None]:
    """Append ``token`` to the choice; return its delta and how it finished (if it did)."""
    req = choice.req
    req.append_output(token)
    status = token_stop(req, token)
    text = ""
    stopped_by_token = status is RequestStatus.FINISHED_STOPPED
    if not stopped_by_token:
        text = choice.detok.add(token)
    if choice.stops is not None:
        text, matched = choice.stops.feed(text)
        if matched is not None:
            req.stop_reason = matched
            status = RequestStatus.FINISHED_STOPPED
    if status is not None:
        tail, late_match = finish_text(choice)
        text += tail
        if late_match:
            # The stop string completed only in text held back until the end
            # (e.g. an unfinished UTF-8 sequence): it is a stop, not a length finish.
            status = RequestStatus.FINISHED_STOPPED
    delta = CompletionDelta(
        index=req.index,
        delta_text=text,
        delta_token_ids=[token],
        delta_logprobs=[logprobs] if logprobs is not None else None,
        finish_reason=status.value if status is not None else None,
        stop_reason=req.stop_reason if status is not None else None,
        num_output_tokens=req.num_output_tokens,
    )
    return delta, status


def merge_deltas(deltas: list[CompletionDelta]) -> CompletionDelta:
    """One choice's consecutive deltas of a step (accepted drafts) as a single delta."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in (d.delta_logprobs or [])]
    return CompletionDelta(
        index=last.index,
        delta_text="".join(d.delta_text for d in deltas),
        delta_token_ids=[t for d in deltas for t in d.delta_token_ids],
        delta_logprobs=logprobs if any(d.delta_logprobs is not None for d in deltas) else None,
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_output_tokens=last.num_output_tokens,
    )


def finish_text(choice: ChoiceState) -> tuple[str, bool]:
    """Text still held back when a choice ends, and whether it completed a stop string."""
    choice.finished = True
    if isinstance(choice.req.stop_reason, str):
        return "", False
    tail = choice.detok.flush()
    if choice.stops is not None:
        emit, matched = choice.stops.feed(tail)
        if matched is not None:
            choice.req.stop_reason = matched
            return emit, True
        return emit + choice.stops.flush(), False
    return tail, False


def final_delta(choice: ChoiceState, status: RequestStatus) -> CompletionDelta:
    """The closing delta of a choice ended from outside (abort, error)."""
    choice.finished = True
    return CompletionDelta(
        index=choice.req.index,
        finish_reason=status.value,
        num_output_tokens=choice.req.num_output_tokens,
    )


def build_output(group: GroupState, deltas: list[CompletionDelta]) -> RequestOutput:
    first = group.choices[0].req
    out = RequestOutput(
        request_id=group.group_id,
        prompt_token_ids=group.prompt_token_ids,
        outputs=deltas,
        finished=group.finished,
        num_cached_tokens=max(c.req.num_cached_tokens for c in group.choices),
        metrics=first.metrics,
    )
    if (
        group.prompt_logprobs
        and not group.sent_prompt_logprobs
        and first.params.prompt_logprobs is not None
    ):
        if len(group.prompt_logprobs) >= len(group.prompt_token_ids):
            out.prompt_logprobs = group.prompt_logprobs
            group.sent_prompt_logprobs = True
    return out
