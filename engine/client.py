"""The engine as its callers see it: the ``EngineClient`` protocol and what it hands back.

The engine's public surface, for the server and any other front end, is:

* this module (``EngineClient``, ``ClientTokenizer``, the JSON types of the seam,
  and re-exports of what the client returns: ``EngineStats`` (with its
  ``MoeLayerStats``), ``RequestTrace``
  with its helpers, ``SAFE_TEMPLATE_KWARGS``);
* ``engine.request.RequestOptions`` (per-request options beyond sampling) and its
  ``Segment`` (a prompt's per-message token span);
* ``engine.sampling.params`` (``SamplingParams``, ``StructuredOutputSpec``);
* ``engine.outputs`` (``RequestOutput`` and its parts);
* ``engine.errors`` (what ``generate`` raises, mapped to HTTP statuses by the server);
* for the composition root only (``server/cli.py``, ``server/config.py``):
  ``engine.config``, ``engine.settings`` and ``engine.async_engine.AsyncEngine``,
  the one implementation of ``EngineClient``.

Everything else under ``engine/`` is private to the engine; an import-linter
contract in pyproject.toml keeps the server to this list.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Literal, Protocol, TypeAlias, runtime_checkable

from engine.outputs import RequestOutput
from engine.request import RequestOptions, Segment
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from engine.stats import EngineStats, MoeLayerStats
from engine.text.tokenizer import SAFE_TEMPLATE_KWARGS, ToolCallFormat
from engine.trace import RequestTrace, review_for_publication, summarize_timings

# JSON as it crosses the seam (chat messages, tool definitions, schemas, response
# bodies). Read-only containers, so a ``list[JsonObject]`` is a ``JsonValue``;
# ``JsonObject`` is the mutable object a caller builds.
JsonValue: TypeAlias = (
    "str | int | float | bool | Sequence[JsonValue] | Mapping[str, JsonValue] | None"
)
JsonObject: TypeAlias = "dict[str, JsonValue]"

# ``tool_choice`` values that force a call: "required" or {"type": "function", ...}.
ForcedToolChoice: TypeAlias = Literal["required"] | Mapping[str, JsonValue]

__all__ = [
    "SAFE_TEMPLATE_KWARGS",
    "ClientTokenizer",
    "EngineClient",
    "EngineStats",
    "ForcedToolChoice",
    "JsonObject",
    "JsonValue",
    "MoeLayerStats",
    "RequestTrace",
    "ToolCallFormat",
    "review_for_publication",
    "summarize_timings",
]


class ClientTokenizer(Protocol):
    """The tokenizer operations a front end uses (``engine.text.tokenizer.Tokenizer``).

    ``encode`` never turns special-token strings in user text into control
    tokens; ``apply_chat_template`` renders in a sandbox and raises
    ``ValueError`` on any template error (bad roles or order: the request's fault);
    with ``continue_final_message`` the rendered text ends right after the final
    message's content (no end of turn), for the model to continue it.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def tool_call_format(self) -> ToolCallFormat | None:
        """The tool-call format prompts rendered with ``tools`` ask for (None: unknown)."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_text(self, token_id: int) -> str:
        """The text a token shows as (OpenAI's logprobs ``token``)."""
        ...

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes a token stands for (OpenAI's logprobs ``bytes``)."""
        ...

    def apply_chat_template(
        self,
        messages: list[JsonObject],
        *,
        add_generation_prompt: bool = True,
        tools: list[JsonObject] | None = None,
        chat_template: str | None = None,
        template_kwargs: JsonObject | None = None,
        continue_final_message: bool = False,
    ) -> list[int]: ...

    def apply_chat_template_segments(
        self,
        messages: list[JsonObject],
        *,
        add_generation_prompt: bool = True,
        tools: list[JsonObject] | None = None,
        chat_template: str | None = None,
        template_kwargs: JsonObject | None = None,
        continue_final_message: bool = False,
    ) -> tuple[list[int], tuple[Segment, ...]]:
        """``apply_chat_template``'s ids and each message's token span (``Segment.turn``
        is the message's index in ``messages``); no segments when the template
        cannot render the conversation's prefixes on their own."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """Everything a front end may ask of a running engine (``AsyncEngine`` implements it).

    Lifecycle: ``start`` once before the first ``generate``, ``shutdown`` once at
    the end. ``generate`` raises ``engine.errors`` exceptions from its first
    ``__anext__`` when the request is refused (validation, admission); after
    that it yields deltas until an output with ``finished`` True. Stopping the
    iteration early, or ``abort``, aborts the request, and every block it holds
    is given back. Methods other than ``generate``/``abort``/``get_trace`` are
    cheap and safe to call from the event loop.
    """

    @property
    def tokenizer(self) -> ClientTokenizer: ...

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def log_prompts(self) -> bool:
        """Whether prompts and outputs may be logged (``--log-prompts``)."""
        ...

    @property
    def traces_enabled(self) -> bool:
        """Whether request traces are recorded (``--enable-request-traces``)."""
        ...

    @property
    def execution_info(self) -> Mapping[str, str]:
        """Which path runs (device, dtype, cpu_linear, kv_cache_dtype, attention,
        decode_step), fixed at start-up; served in ``/v1/models`` as ``fuel``."""
        ...

    @property
    def segment_policies(self) -> frozenset[str]:
        """The ``--kv-policy`` / ``kv_policy`` names under which the engine reads a
        chat request's segments (``RequestOptions.segments``); the server renders
        them only then (they cost a template render per message)."""
        ...

    @property
    def cache_config(self) -> Mapping[str, str]:
        """The KV cache's configuration as ``vllm:cache_config_info`` labels
        (block_size, cache_dtype, num_gpu_blocks, kv_tokens, ...), fixed at start-up."""
        ...

    def describe(self) -> str:
        """One line for the start-up log: model, dtype, device, KV cache size."""
        ...

    @property
    def fatal_error(self) -> str | None:
        """Why the engine stopped for good (its loop died, a tensor-parallel worker
        exited); None while it can serve. The server then answers 503 and exits."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    def get_stats(self) -> EngineStats:
        """Counters and gauges as of the last step (a snapshot the caller may keep)."""
        ...

    def num_unfinished_requests(self) -> int: ...

    def tool_call_spec(
        self,
        tools: Sequence[Mapping[str, JsonValue]],
        tool_choice: ForcedToolChoice,
        tool_format: ToolCallFormat,
        parallel_tool_calls: bool,
    ) -> StructuredOutputSpec:
        """A grammar spec that forces tool calls in ``tool_format``, then ends the turn.

        Raises ``engine.errors.InvalidRequestError`` (with ``param``) when the
        choice, the format or a tool's schema cannot be enforced.
        """
        ...

    async def get_trace(self, request_ids: Sequence[str]) -> RequestTrace | None:
        """A copy of the first recorded trace among ``request_ids``; None if none is.

        The copy is taken between engine steps, so it can be read while the
        engine moves on. Always None when traces are off.
        """
        ...
