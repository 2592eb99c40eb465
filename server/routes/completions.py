"""``POST /v1/completions``: prompts (text or token ids) -> the generation pipeline.

Completions' own part is the shape of a choice (``CompletionFormat``): plain
``text``, the echoed prompt first when ``echo`` is on, and logprobs as
columns whose ``text_offset`` runs on across the echoed prompt.
"""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.client import ClientTokenizer, JsonObject, JsonValue
from engine.outputs import CompletionDelta, PositionLogprobs
from server.generation import (
    ChoiceFormat,
    ChoiceState,
    Generation,
    request_budget,
    request_options,
    sampling_params,
)
from server.logprobs import (
    completion_logprobs,
    merge_completion_logprobs,
    prompt_logprobs_json,
)
from server.prompts import completion_prompts
from server.protocol import CompletionRequest
from server.state import State, request_id

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, state: State) -> Response:
    engine = state.ready_engine()
    model = state.check_model(engine, body.model)
    prompts, prompt_texts = await completion_prompts(engine, body.prompt)
    requests = []
    rid_base = request_id(request)
    suffix = uuid.uuid4().hex[:8]
    for i, ids in enumerate(prompts):
        budget = request_budget(body, body.output_budget(), len(ids), engine, "your prompt")
        params = sampling_params(
            body,
            max_tokens=budget,
            logprobs=body.logprobs,
            prompt_logprobs=_prompt_logprobs(body),
            vocab_size=engine.tokenizer.vocab_size,
        )
        requests.append((f"{rid_base}-{suffix}-{i}", ids, params))
    for (rid, ids, _), text in zip(requests, prompt_texts):
        state.log_prompt(rid, text if text is not None else ids)
    generation = Generation.submit(
        engine,
        requests,
        request_options(body),
        metrics=state.metrics,
        client_request_id=rid_base,
        # Prompt k's engine id is f"{response id without cmpl-}-{k}" (GET /v1/traces).
        response_id=f"cmpl-{rid_base}-{suffix}",
        model=model,
        include_usage=body.include_usage(),
    )
    await generation.start()
    echo_texts = [
        (text if text is not None else engine.tokenizer.decode(ids, skip_special_tokens=False))
        if body.echo
        else ""
        for text, ids in zip(prompt_texts, prompts)
    ]
    prompt_logprobs = [
        s.first.prompt_logprobs if s.first is not None else None for s in generation.streams
    ]
    fmt = CompletionFormat(engine.tokenizer, body, prompts, echo_texts, prompt_logprobs)
    if body.stream:
        return generation.stream(fmt)
    return await generation.answer(request, fmt)


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """How many alternatives prompt tokens need: for echo + logprobs and for vLLM's field."""
    wanted = [body.prompt_logprobs]
    if body.echo and body.logprobs is not None:
        wanted.append(body.logprobs)
    known = [k for k in wanted if k is not None]
    return max(known) if known else None


class CompletionFormat(ChoiceFormat):
    """Completion choices: ``text`` (after the echoed prompt) and columnar logprobs."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    null_usage_in_chunks = False  # CreateCompletionResponse has no nullable usage

    def __init__(
        self,
        tok: ClientTokenizer,
        body: CompletionRequest,
        prompts: list[list[int]],
        echo_texts: list[str],
        prompt_logprobs: list[list[PositionLogprobs | None] | None],
    ) -> None:
        self.tok = tok
        self.n = body.n
        self.echo = body.echo
        self.logprobs = body.logprobs  # None: no logprobs; k: the top k alternatives
        self.want_prompt_logprobs = body.prompt_logprobs is not None
        self.prompt_top_k = body.prompt_logprobs or 0
        self.top_k = body.logprobs or 0
        self.prompts = prompts
        self.echo_texts = echo_texts
        self.prompt_logprobs = prompt_logprobs
        self.offsets: dict[int, int] = {}  # per streamed choice: text offset so far

    def _echo_logprobs(self, si: int) -> tuple[JsonObject, int]:
        """Logprobs of prompt ``si``'s tokens (echo + logprobs), and the offset after them."""
        first = self.prompt_logprobs[si]
        positions: list[PositionLogprobs | None] = (
            list(first) if first else [None] * len(self.prompts[si])
        )
        return completion_logprobs(self.tok, positions, self.prompts[si], 0, self.top_k)

    def prelude(self) -> list[JsonObject]:
        choices: list[JsonObject] = []
        for si in range(len(self.prompts)):
            for j in range(self.n):
                index = si * self.n + j
                self.offsets[index] = 0
                if not self.echo:
                    continue
                lp: JsonValue = None
                if self.logprobs is not None:
                    lp, self.offsets[index] = self._echo_logprobs(si)
                else:
                    self.offsets[index] = len(self.echo_texts[si])
                choices.append(
                    {
                        "index": index,
                        "text": self.echo_texts[si],
                        "logprobs": lp,
                        "finish_reason": None,
                    }
                )
        return choices

    def stream_choice(
        self, index: int, delta: CompletionDelta, finish: str | None
    ) -> JsonObject | None:
        if not delta.delta_text and finish is None and not delta.delta_logprobs:
            return None
        lp: JsonValue = None
        if self.logprobs is not None:
            lp, self.offsets[index] = completion_logprobs(
                self.tok,
                list(delta.delta_logprobs or []),
                delta.delta_token_ids,
                self.offsets[index],
                self.top_k,
            )
        choice: JsonObject = {
            "index": index,
            "text": delta.delta_text,
            "logprobs": lp,
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = delta.stop_reason
        return choice

    def final_choice(self, choice: ChoiceState) -> JsonObject:
        si = choice.index // self.n
        lp: JsonValue = None
        if self.logprobs is not None:
            parts: list[JsonObject] = []
            offset = 0
            if self.echo:
                part, offset = self._echo_logprobs(si)
                parts.append(part)
            part, _ = completion_logprobs(
                self.tok, choice.logprobs, choice.token_ids, offset, self.top_k
            )
            parts.append(part)
            lp = merge_completion_logprobs(parts)
        out: JsonObject = {
            "index": choice.index,
            "text": self.echo_texts[si] + "".join(choice.text),
            "logprobs": lp,
            "finish_reason": choice.finish_reason or "stop",
            "stop_reason": choice.stop_reason,
        }
        if self.want_prompt_logprobs:  # vLLM puts them on each choice
            out["prompt_logprobs"] = prompt_logprobs_json(
                self.tok,
                self.prompts[si],
                self.prompt_logprobs[si] or [],
                self.prompt_top_k,
            )
        return out
