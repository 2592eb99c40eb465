"""From a request body to prompt token ids: chat templates, text prompts, token-id prompts.

Contracts: template rendering runs off the event loop (it can be slow) in the
engine tokenizer's sandbox; a template error is the request's fault (400
naming ``messages``). Token ids a client sends are checked against the
vocabulary here, before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from engine.client import SAFE_TEMPLATE_KWARGS, EngineClient, JsonObject, JsonValue
from engine.errors import InvalidRequestError
from engine.request import Segment
from server.errors import ApiError

_T = TypeVar("_T")


def template_kwargs(kwargs: Mapping[str, JsonValue] | None) -> JsonObject | None:
    """The allow-listed ``chat_template_kwargs`` (400 naming any other key)."""
    if not kwargs:
        return None
    for key in kwargs:
        if key not in SAFE_TEMPLATE_KWARGS:
            raise ApiError(
                400,
                f"chat_template_kwargs key {key!r} is not allowed "
                f"(allowed: {', '.join(sorted(SAFE_TEMPLATE_KWARGS))}).",
                param="chat_template_kwargs",
            )
    return dict(kwargs)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat: its token ids and each message's span (``Segment.turn`` indexes
    the messages as the client sent them, also after context compression)."""

    token_ids: list[int]
    segments: tuple[Segment, ...]


async def render_chat(
    engine: EngineClient,
    messages: list[JsonObject],
    add_generation_prompt: bool,
    kwargs: JsonObject | None,
    tools: list[JsonObject] | None = None,
    continue_final_message: bool = False,
) -> list[int]:
    """The chat template applied to ``messages`` (and ``tools``), as token ids.

    ``continue_final_message``: the final (assistant) message is left open for the
    model to continue (vLLM's meaning; see ``ClientTokenizer.apply_chat_template``)."""

    def run() -> list[int]:
        return list(
            engine.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                template_kwargs=kwargs,
                continue_final_message=continue_final_message,
            )
        )

    return await _off_loop(run)


async def render_chat_prompt(
    engine: EngineClient,
    messages: list[JsonObject],
    add_generation_prompt: bool,
    kwargs: JsonObject | None,
    tools: list[JsonObject] | None = None,
    continue_final_message: bool = False,
    with_segments: bool = True,
) -> ChatPrompt:
    """``render_chat`` with each message's token span (``RequestOptions.segments``).

    Spans cost one template render per message prefix (quadratic in the
    conversation's length: docs/benchmarks/context-compression.md), so a caller
    that needs none passes ``with_segments=False`` and gets ``segments=()``."""

    def run() -> ChatPrompt:
        if not with_segments:
            plain = engine.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                template_kwargs=kwargs,
                continue_final_message=continue_final_message,
            )
            return ChatPrompt(list(plain), ())
        ids, segments = engine.tokenizer.apply_chat_template_segments(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=kwargs,
            continue_final_message=continue_final_message,
        )
        return ChatPrompt(list(ids), segments)

    return await _off_loop(run)


async def _off_loop(run: Callable[[], _T]) -> _T:
    """Run a template render in a thread; its errors are the request's fault (400)."""
    try:
        return await asyncio.to_thread(run)
    except (InvalidRequestError, ApiError):
        raise
    except Exception as exc:  # template errors are the request's fault (bad roles/order)
        raise ApiError(400, f"Could not apply the chat template: {exc}", param="messages") from None


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """400 naming ``param`` unless every id is in ``[0, vocab_size)``."""
    for tok in ids:
        if not 0 <= tok < vocab_size:
            raise ApiError(
                400,
                f"token id {tok} is out of range for vocabulary size {vocab_size}",
                param=param,
            )


async def completion_prompts(
    engine: EngineClient, prompt: str | list[str] | list[int] | list[list[int]]
) -> tuple[list[list[int]], list[str | None]]:
    """A completion's prompts as token ids, with their text (None for token-id prompts).

    Text prompts are tokenized with the tokenizer's special tokens (a BOS where
    the model has one), as vLLM does; the result is never empty (400).
    """
    tok = engine.tokenizer
    texts: list[str]
    if isinstance(prompt, str):
        texts = [prompt]
    elif isinstance(prompt[0], str):
        texts = [p for p in prompt if isinstance(p, str)]
    else:
        texts = []
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    if texts:
        prompts = await asyncio.to_thread(
            lambda: [list(tok.encode(p, add_special_tokens=True)) for p in texts]
        )
        prompt_texts = list(texts)
    else:
        prompts = (
            [[t for t in prompt if isinstance(t, int)]]
            if isinstance(prompt[0], int)
            else [list(p) for p in prompt if isinstance(p, list)]
        )
        for i, ids in enumerate(prompts):
            check_token_ids(ids, tok.vocab_size, "prompt" if len(prompts) == 1 else f"prompt.{i}")
        prompt_texts = [None] * len(prompts)
    for ids in prompts:
        if not ids:
            raise ApiError(400, "prompt must not be empty", param="prompt")
    return prompts, prompt_texts
