"""``POST /v1/chat/completions``: messages -> chat template -> the generation pipeline.

Chat's own part is the shape of a choice (``ChatFormat``): a message with
``content`` and parsed ``tool_calls``, or streamed deltas (the role first,
then content and call deltas from an incremental tool-call parser per choice).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.client import ClientTokenizer, EngineClient, JsonObject, JsonValue
from engine.outputs import CompletionDelta, PositionLogprobs
from server.context_compression import Compression, compress, wants_compression
from server.generation import (
    ChoiceFormat,
    ChoiceState,
    Generation,
    request_budget,
    request_options,
    sampling_params,
    windowed,
)
from server.logprobs import chat_logprobs, prompt_logprobs_json
from server.prompts import ChatPrompt, render_chat_prompt, template_kwargs
from server.protocol import ChatCompletionRequest
from server.state import State, request_id
from server.tool_parsers import ToolCallDelta, ToolStreamParser
from server.tools import (
    ToolPlan,
    log_invalid_calls,
    log_invalid_streamed,
    resolve_tool_calling,
    tool_call_json,
    tool_delta_json,
)

router = APIRouter()
logger = logging.getLogger("fuel_serve.server")


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State) -> Response:
    engine = state.ready_engine()
    model = state.check_model(engine, body.model)
    plan = resolve_tool_calling(engine, body, state.config)
    kwargs = template_kwargs(body.chat_template_kwargs)
    messages = [m.to_template_dict() for m in body.messages]
    offered = plan.tools if plan is not None and plan.tools else None
    prompt = await render_chat_prompt(
        engine,
        messages,
        body.add_generation_prompt,
        kwargs,
        tools=offered,
        continue_final_message=body.continue_final_message,
        with_segments=_wants_segments(engine, body),
    )
    compression = await _compress_if_needed(engine, state, body, messages, prompt, offered, kwargs)
    if compression is not None:
        prompt = compression.prompt
        messages = [messages[i] for i in compression.kept]
    prompt_ids = prompt.token_ids
    budget = request_budget(body, body.output_budget(), len(prompt_ids), engine, "the messages")
    top_k = body.top_logprobs or 0
    params = sampling_params(
        body,
        max_tokens=budget,
        logprobs=top_k if body.logprobs else None,
        prompt_logprobs=body.prompt_logprobs,
        vocab_size=engine.tokenizer.vocab_size,
        structured=plan.structured if plan is not None else None,
    )
    rid_base = request_id(request)
    engine_rid = f"{rid_base}-{uuid.uuid4().hex[:8]}"
    state.log_prompt(engine_rid, messages)
    generation = Generation.submit(
        engine,
        [(engine_rid, prompt_ids, params)],
        dataclasses.replace(request_options(body), segments=prompt.segments),
        metrics=state.metrics,
        client_request_id=rid_base,
        # Response id = prefix + engine request id: GET /v1/traces/{id} maps back statelessly.
        response_id=f"chatcmpl-{engine_rid}",
        model=model,
        include_usage=body.include_usage(),
    )
    if compression is not None:
        generation.usage_extra["context_compression"] = compression.usage_field()
        generation.headers.update(compression.headers())
    await generation.start()
    echo_prefix = ""
    if body.echo and body.messages[-1].role == "assistant":
        echo_prefix = body.messages[-1].text()
    fmt = ChatFormat(engine.tokenizer, body, plan, echo_prefix, top_k)
    first = generation.streams[0].first
    if body.prompt_logprobs is not None and first is not None:
        fmt.prompt_logprobs = prompt_logprobs_json(
            engine.tokenizer, prompt_ids, first.prompt_logprobs or [], body.prompt_logprobs
        )
    if body.stream:
        return generation.stream(fmt)
    return await generation.answer(request, fmt)


def _wants_segments(engine: EngineClient, body: ChatCompletionRequest) -> bool:
    """Whether the engine reads this request's segments: its KV policy (its own
    ``kv_policy`` or the server's ``--kv-policy``) is one the engine says reads
    them (``EngineClient.segment_policies``: whole-turn eviction, a segment vote)."""
    asked = body.kv_policy.type if body.kv_policy is not None else None
    policy = asked if asked is not None else engine.execution_info.get("kv_policy", "full")
    return policy in engine.segment_policies


async def _compress_if_needed(
    engine: EngineClient,
    state: State,
    body: ChatCompletionRequest,
    messages: list[JsonObject],
    prompt: ChatPrompt,
    tools: list[JsonObject] | None,
    kwargs: JsonObject | None,
) -> Compression | None:
    """Whole turns dropped to fit the context, when asked and needed (else None).

    None also when even the pinned messages do not fit: ``output_budget`` then
    gives the request today's ``context_length_exceeded`` 400, unchanged.
    """
    max_len = engine.max_model_len
    requested = body.output_budget()
    n = len(prompt.token_ids)
    fits = n < max_len if requested is None else n + requested <= max_len
    if windowed(body, engine):
        return None  # a KV policy bounds the cache: nothing needs dropping
    if fits or not wants_compression(body.truncation, state.config.context_compression):
        return None
    need = requested if requested is not None else state.config.context_compression_reserve
    if not prompt.segments:
        # Selection prices turns by their spans: only a request being compressed pays for them.
        prompt = await render_chat_prompt(
            engine,
            messages,
            body.add_generation_prompt,
            kwargs,
            tools=tools,
            continue_final_message=body.continue_final_message,
        )

    async def render(subset: list[JsonObject]) -> ChatPrompt:
        return await render_chat_prompt(
            engine,
            subset,
            body.add_generation_prompt,
            kwargs,
            tools=tools,
            continue_final_message=body.continue_final_message,
        )

    result = await compress(messages, prompt, max_len - need, render, engine.tokenizer.encode)
    if result is not None:
        logger.info(
            "context compression dropped messages %s (%d prompt tokens)",
            result.dropped,
            result.dropped_tokens,
        )
    return result


class ChatFormat(ChoiceFormat):
    """Chat choices: ``message`` (tool calls parsed out) or streamed ``delta``s."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    null_usage_in_chunks = True

    def __init__(
        self,
        tok: ClientTokenizer,
        body: ChatCompletionRequest,
        plan: ToolPlan | None,
        echo_prefix: str,
        top_k: int,
    ) -> None:
        self.tok = tok
        self.n = body.n
        self.want_logprobs = body.logprobs
        self.plan = plan
        self.echo_prefix = echo_prefix
        self.top_k = top_k
        # One incremental tool-call parser per streamed choice; content it holds
        # back (a possible call opening) is released or turned into call deltas.
        self.parsers: dict[int, ToolStreamParser] = {}
        self.has_calls: set[int] = set()
        self.sent_calls: dict[int, list[ToolCallDelta]] = {}  # validated at finish
        self.prompt_logprobs: list[JsonValue] | None = None  # vLLM's, when asked

    def final_fields(self) -> JsonObject:
        return {} if self.prompt_logprobs is None else {"prompt_logprobs": self.prompt_logprobs}

    def _logprobs(self, positions: list[PositionLogprobs]) -> JsonValue:
        if not self.want_logprobs:
            return None
        return {"content": chat_logprobs(self.tok, positions, self.top_k), "refusal": None}

    def prelude(self) -> list[JsonObject]:
        if self.plan is not None and self.plan.parser is not None:
            self.parsers = {i: self.plan.parser.stream() for i in range(self.n)}
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": self.echo_prefix},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(self.n)
        ]

    def _tool_delta(
        self, index: int, d: CompletionDelta, finish: str | None, delta: JsonObject
    ) -> str | None:
        """Feed the choice's parser; fill ``delta``; return the (maybe ``tool_calls``) finish."""
        parser = self.parsers[index]
        pieces = [parser.feed(d.delta_text)] if d.delta_text else []
        if finish is not None:
            pieces.append(parser.finish(self._drop_incomplete(finish)))
        content = "".join(p.content for p in pieces)
        calls = [c for p in pieces for c in p.tool_calls]
        if self.plan is not None and self.plan.single_call:
            calls = [c for c in calls if c.index == 0]  # as _message: the first call only
        if content:
            delta["content"] = content
        if calls:
            self.has_calls.add(index)
            self.sent_calls.setdefault(index, []).extend(calls)
            delta["tool_calls"] = [tool_delta_json(c) for c in calls]
        if finish is not None and index in self.sent_calls and self.plan is not None:
            log_invalid_streamed(self.sent_calls.pop(index), self.plan.tools)
        if finish == "stop" and index in self.has_calls:
            return "tool_calls"
        return finish

    def stream_choice(
        self, index: int, delta: CompletionDelta, finish: str | None
    ) -> JsonObject | None:
        out: JsonObject = {}
        if self.parsers:
            finish = self._tool_delta(index, delta, finish, out)
        elif delta.delta_text:
            out["content"] = delta.delta_text
        if not out and finish is None and not delta.delta_logprobs:
            return None
        choice: JsonObject = {
            "index": index,
            "delta": out,
            "logprobs": self._logprobs(delta.delta_logprobs or []),
            "finish_reason": finish,
        }
        if finish is not None:
            choice["stop_reason"] = delta.stop_reason
        return choice

    def _drop_incomplete(self, finish: str) -> bool:
        """Whether a call block the text ends inside is dropped rather than made content.

        A forced turn is calls only (the grammar allows nothing else), and a call
        cut off by ``max_tokens`` is no call: either way a half call is neither
        returned nor left as raw markup in ``content``; ``finish_reason`` says
        ``length``.
        """
        return finish == "length" or (self.plan is not None and self.plan.forced)

    def _message(self, text: str, finish: str | None) -> tuple[JsonObject, str]:
        """``message`` and ``finish_reason`` of a finished choice, tool calls parsed out.

        Every call the model generated is returned, except under
        ``parallel_tool_calls: false`` (``ToolPlan.single_call``): then only the
        first (a forced turn's grammar generates no other).
        """
        message: JsonObject = {"role": "assistant", "content": text, "refusal": None}
        reason = finish or "stop"
        plan = self.plan
        if plan is not None and plan.parser is not None:
            parsed = plan.parser.parse(text, drop_incomplete=self._drop_incomplete(reason))
            # A forced turn has no content (the grammar allows calls only); nor has a
            # cut-off turn whose only text was the dropped half call.
            dropped = self._drop_incomplete(reason)
            message["content"] = (parsed.content or None) if dropped else parsed.content
            calls = parsed.tool_calls[:1] if plan.single_call else parsed.tool_calls
            if calls:
                log_invalid_calls(calls, plan.tools)
                message["tool_calls"] = [tool_call_json(call) for call in calls]
                if reason == "stop":
                    reason = "tool_calls"
        return message, reason

    def final_choice(self, choice: ChoiceState) -> JsonObject:
        message, reason = self._message(
            self.echo_prefix + "".join(choice.text), choice.finish_reason
        )
        return {
            "index": choice.index,
            "message": message,
            "finish_reason": reason,
            "logprobs": self._logprobs(choice.logprobs),
            "stop_reason": choice.stop_reason,
        }
