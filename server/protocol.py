"""OpenAI wire format: pydantic v2 request models and response builders.

Contract: every request model forbids unknown fields (``extra="forbid"``) and
non-finite floats, so a field Fuel Serve cannot honour (image parts, ``audio``,
``modalities``, legacy ``functions``...) is a 400 that names it, never silently
dropped. Limits that are Fuel Serve's choice (not OpenAI's) are constants here.

Routers (vllm-router, sglang-router) re-serialise every body with SGLang-style
extension fields set to their *neutral* values (``no_stop_trim: false``,
``return_hidden_states: false``, ``separate_reasoning: true``, ...). The rule
for such a known extension: its neutral value is accepted; any other value is
honoured (``no_stop_trim``, ``continue_final_message``) or refused with a 400
that names it (``return_hidden_states``, ``include_reasoning: false``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Limits. OpenAI allows n <= 128 and 4 stop strings; vLLM has no stop limit.
# We pick bounds that keep one request from monopolising a small server.
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 20
MAX_PROMPTS = 64
MAX_STOP_TOKEN_IDS = 64


class OpenAIModel(BaseModel):
    """Base for request models: unknown fields and NaN/Infinity are rejected."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def _find_surrogate(data: Any) -> str | None:
    """The path of the first string holding a lone surrogate (iterative), or None.

    JSON's ``\\ud800`` escapes decode to such strings, which no tokenizer can
    encode and no UTF-8 response can carry.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE_RE.search(node):
                return path or "<body>"
        elif isinstance(node, dict):
            for key, value in node.items():
                if isinstance(key, str) and _SURROGATE_RE.search(key):
                    return path or "<body>"
                stack.append((f"{path}.{key}" if path else str(key), value))
        elif isinstance(node, list):
            stack.extend((f"{path}.{i}", value) for i, value in enumerate(node))
    return None


class RequestBody(OpenAIModel):
    """A whole request body: also refuses strings that are not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = _find_surrogate(data)
        if where is not None:
            raise ValueError(
                f"{where}: strings must be valid Unicode (a lone surrogate escape "
                "such as \\ud800 is not)"
            )
        return data


# ---------------------------------------------------------------------------
# Chat messages
# ---------------------------------------------------------------------------


class TextContentPart(OpenAIModel):
    """A text content part. Other part types are rejected by name."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _only_text(cls, data: Any) -> Any:
        # A clear message beats pydantic's "Input should be 'text'" for image/audio parts.
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(
                f"content part type {data.get('type')!r} is not supported: "
                "this server serves a text-only model"
            )
        return data


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    """An assistant message's tool call, as the client echoes it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(OpenAIModel):
    """One chat message. ``content`` is a string or a list of text parts."""

    role: ChatRole
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Our responses carry ``refusal: null`` (as OpenAI's do), and clients send the
    # assistant message back as they got it; only that null is accepted.
    refusal: None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool messages need a tool_call_id")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id is only allowed on tool messages")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"{self.role} messages need content")
        return self

    def text(self) -> str:
        """The content as one string (text parts concatenated)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (plain dicts, string content)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """``response_format``: text, json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


# ---------------------------------------------------------------------------
# Shared sampling fields
# ---------------------------------------------------------------------------


class KVPolicyBody(OpenAIModel):
    """Our ``kv_policy`` extension (issue 17): narrows the server's ``--kv-policy``
    for this request (engine/kv/policies/resolve.py refuses what widens it)."""

    type: Literal["full", "streaming", "h2o", "rkv", "vote", "segmented"] | None = None
    budget_tokens: int | None = Field(default=None, ge=2, le=1 << 24)
    sink_tokens: int | None = Field(default=None, ge=0, le=1 << 24)


class SamplingFields(RequestBody):
    """Fields chat and completions share (OpenAI's plus vLLM's extensions)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions.
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    latency_budget_ms: float | None = Field(default=None, gt=0.0)
    ttft_budget_ms: float | None = Field(default=None, gt=0.0)
    response_format: ResponseFormat | None = None
    kv_policy: KVPolicyBody | None = None  # ours: per-request KV policy (narrowing only)
    # SGLang extensions routers send at their neutral values (module docstring).
    # no_stop_trim is SGLang's name for include_stop_str_in_output (folded into it below).
    no_stop_trim: bool = False
    return_hidden_states: bool = False

    @field_validator("return_hidden_states")
    @classmethod
    def _no_hidden_states(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "true is not supported: Fuel Serve does not return hidden states "
                "(only false, the default, is accepted)"
            )
        return value

    @model_validator(mode="after")
    def _fold_no_stop_trim(self) -> SamplingFields:
        # Either name asks for the same thing: keep the matched stop string in the text.
        if self.no_stop_trim:
            self.include_stop_str_in_output = True
        return self

    # vLLM extension: logprobs of every prompt token, with the top k alternatives.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed")
        for s in stops:
            if not s:
                raise ValueError("stop sequences must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop sequences must be at most {MAX_STOP_STRING_CHARS} characters"
                )
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for key, bias in value.items():
            try:
                tok = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if tok < 0:
                raise ValueError(f"logit_bias token id {tok} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


def check_continue_final_message(
    continue_final_message: bool, add_generation_prompt: bool, messages: list[ChatMessage]
) -> None:
    """vLLM's rules: the final message is continued (the template's end-of-turn after
    it is cut, no new generation prompt), so it must be the assistant's and
    ``add_generation_prompt`` must be false. Raises ValueError naming the field."""
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise ValueError(
            "Cannot set both continue_final_message and add_generation_prompt to true: "
            "send add_generation_prompt: false to continue the final message"
        )
    if messages[-1].role != "assistant":
        raise ValueError(
            "continue_final_message needs the last message to be the assistant's "
            f"(it is {messages[-1].role!r})"
        )
    if not messages[-1].text().strip():
        raise ValueError("continue_final_message needs a final assistant message with content")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extensions.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # OpenAI's Responses API field, accepted here as an extension: "auto" lets the
    # server drop whole earlier turns of a conversation that exceeds the context
    # (server/context_compression.py); "disabled" answers 400 instead; absent: the
    # server's --context-compression.
    truncation: Literal["auto", "disabled"] | None = None
    # Reasoning extensions (SGLang's separate_reasoning / stream_reasoning, vLLM's
    # include_reasoning) that routers send at their neutral values. No reasoning
    # parser runs here, so reasoning text is never split out of ``content``:
    # separate_reasoning and stream_reasoning (how a split-out reasoning_content
    # is sent) change nothing, either value is what we do; include_reasoning: false
    # (drop the reasoning) cannot be honoured and is refused.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    @field_validator("include_reasoning")
    @classmethod
    def _keep_reasoning(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "false is not supported: no reasoning parser runs, so reasoning text "
                "cannot be told apart from the answer and dropped"
            )
        return value

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_continue_final_message(self) -> ChatCompletionRequest:
        check_continue_final_message(
            self.continue_final_message, self.add_generation_prompt, self.messages
        )
        return self

    def output_budget(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens else self.max_tokens


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` body. ``prompt``: text, texts, token ids, or lists of ids."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: None = None  # accepted only as null: no model here supports insertion
    best_of: int | None = Field(default=None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, str):
            if not value:
                raise ValueError("prompt must not be empty")
            return value
        if not value:
            raise ValueError("prompt must not be empty")
        if isinstance(value[0], list):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(not ids for ids in value):  # type: ignore[union-attr]
                raise ValueError("token-id prompts must not be empty")
        elif isinstance(value[0], str):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if any(not p for p in value):  # type: ignore[union-attr]
                raise ValueError("prompts must not be empty")
        return value

    def output_budget(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(RequestBody):
    """vLLM's ``POST /tokenize``: exactly one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.messages is None and self.continue_final_message:
            raise ValueError("continue_final_message applies to messages, not to a prompt")
        if self.messages is not None:
            check_continue_final_message(
                self.continue_final_message, self.add_generation_prompt, self.messages
            )
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
