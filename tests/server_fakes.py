"""A scripted fake ``engine.client.EngineClient`` and an OpenAPI schema checker.

The fake tokenizer maps each character to one token (``ord(c) + 10``) so tests
can predict token counts; the fake engine "generates" a fixed reply character
by character and records what it was asked, so tests can assert the mapping.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonschema import validators
from openapi_schema_validator import OAS31Validator

from engine.client import EngineStats, RequestTrace
from engine.errors import EngineUnavailableError, InvalidRequestError, RequestRejectedError
from engine.outputs import CompletionDelta, PositionLogprobs, RequestOutput, TokenLogprob
from engine.request import RequestOptions, Segment
from engine.sampling.params import SamplingParams, StructuredOutputSpec

VOCAB = 1000
OFFSET = 10


class FakeTokenizer:
    vocab_size = VOCAB
    eos_token_ids = frozenset({0})
    chat_template: str | None = None
    tool_call_format: str | None = None  # a template with no known tool-call format

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), VOCAB - 1 - OFFSET) + OFFSET for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.token_to_text(i) for i in ids)

    def token_to_text(self, token_id: int) -> str:
        return chr(token_id - OFFSET) if token_id >= OFFSET else f"<{token_id}>"

    def token_bytes(self, token_id: int) -> list[int]:
        return list(self.token_to_text(token_id).encode())

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Any = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[int]:
        return self.apply_chat_template_segments(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )[0]

    def apply_chat_template_segments(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Any = None,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> tuple[list[int], tuple[Segment, ...]]:
        """One ``role:content\\n`` line per message, one token per character."""
        lines = [f"{m['role']}:{m['content']}\n" for m in messages]
        if continue_final_message:
            lines[-1] = lines[-1][: -len("\n")]  # the final message stays open
        segments, pos = [], 0
        for turn, (m, line) in enumerate(zip(messages, lines, strict=True)):
            kind = {"developer": "system", "function": "tool"}.get(m["role"], m["role"])
            segments.append(Segment(pos, pos + len(line), kind, turn))
            pos += len(line)
        text = "".join(lines) + ("assistant:" if add_generation_prompt else "")
        return self.encode(text), tuple(segments)


@dataclass
class Call:
    """One ``generate`` call as the fake saw it."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    kwargs: dict[str, Any]


@dataclass
class FakeEngine:
    """Scripted engine. ``reply`` is generated one char per token per choice.

    ``fail_first``: raise this from the first ``__anext__``. ``fail_after``:
    raise a RuntimeError after that many outputs. ``step_delay``: seconds per step.
    """

    reply: str = "Hello world"
    max_model_len: int = 128
    model_name: str = "fake-model"
    log_prompts: bool = False
    traces_enabled: bool = False
    step_delay: float = 0.0
    fail_first: BaseException | None = None
    fail_after: int | None = None
    calls: list[Call] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    started: bool = False
    stopped: bool = False
    fatal_error: str | None = None  # set it to make the app see a dead engine
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    execution_info: dict[str, str] = field(
        default_factory=lambda: {"cpu_linear": "q4_1", "kv_cache_dtype": "float16"}
    )
    segment_policies: frozenset[str] = frozenset({"segmented", "vote"})
    cache_config: dict[str, str] = field(
        default_factory=lambda: {
            "block_size": "16",
            "cache_dtype": "float16",
            "num_gpu_blocks": "64",
        }
    )

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.stopped = True

    def describe(self) -> str:
        return "fake engine"

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_total_blocks=10, num_free_blocks=10)

    def num_unfinished_requests(self) -> int:
        return len(self.running)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    def tool_call_spec(
        self,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: Any,
        tool_format: str,
        parallel_tool_calls: bool,
    ) -> StructuredOutputSpec:
        # The fake has no grammar compiler (it has no real vocabulary to mask).
        raise InvalidRequestError("forced tool calls need a real engine", param="tool_choice")

    async def get_trace(self, request_ids: Sequence[str]) -> RequestTrace | None:
        return None  # the fake records no traces (tests/test_traces_api.py has one that does)

    def _logprobs(self, token_id: int, k: int) -> PositionLogprobs:
        top = [TokenLogprob(token_id, -0.5)] + [
            TokenLogprob(OFFSET + 65 + j, -2.0 - j) for j in range(k)
        ]
        return PositionLogprobs(TokenLogprob(token_id, -0.5), top[:k])

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        opts = options or RequestOptions()
        self.calls.append(
            Call(
                list(prompt_token_ids),
                params,
                request_id,
                dataclasses.asdict(opts),
            )
        )
        if self.fail_first is not None:
            raise self.fail_first
        self.running.add(request_id)
        ids = self.tokenizer.encode(self.reply)
        limit = min(len(ids), params.max_tokens or len(ids))
        prompt_lp: list[PositionLogprobs | None] | None = None
        if params.prompt_logprobs is not None:
            prompt_lp = [None] + [
                self._logprobs(t, params.prompt_logprobs) for t in prompt_token_ids[1:]
            ]
        emitted = 0
        try:
            for step in range(limit):
                if request_id not in self.running:
                    return
                if self.step_delay:
                    await asyncio.sleep(self.step_delay)
                if self.fail_after is not None and emitted >= self.fail_after:
                    raise RuntimeError("secret internal failure detail")
                deltas = []
                for i in range(params.n):
                    last = step == limit - 1
                    deltas.append(
                        CompletionDelta(
                            index=i,
                            delta_text=self.tokenizer.token_to_text(ids[step]),
                            delta_token_ids=[ids[step]],
                            delta_logprobs=(
                                [self._logprobs(ids[step], params.logprobs)]
                                if params.logprobs is not None
                                else None
                            ),
                            finish_reason=(
                                ("length" if limit < len(ids) else "stop") if last else None
                            ),
                            num_output_tokens=step + 1,
                        )
                    )
                emitted += 1
                yield RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=list(prompt_token_ids),
                    outputs=deltas,
                    finished=step == limit - 1,
                    num_cached_tokens=3,
                    prompt_logprobs=prompt_lp if step == 0 else None,
                )
        finally:
            self.running.discard(request_id)


def rejected() -> RequestRejectedError:
    return RequestRejectedError("queue is full", reason="queue_full", retry_after=2.5)


def unavailable() -> EngineUnavailableError:
    return EngineUnavailableError("engine is restarting", retry_after=7)


def invalid() -> InvalidRequestError:
    return InvalidRequestError("bad stop token", param="stop_token_ids", code="invalid_value")


# OpenAI's published document: shared/openai/openapi.yaml beside the repository when
# it is there (as on CI), else the copy in tests/data (the same file).
_SHARED_OPENAPI = Path(__file__).resolve().parents[2] / "shared" / "openai" / "openapi.yaml"
OPENAPI_PATH = (
    _SHARED_OPENAPI
    if _SHARED_OPENAPI.exists()
    else Path(__file__).parent / "data" / "openai_openapi.yaml"
)


def _honour_nullable(check: Any) -> Any:
    """A keyword check that lets ``null`` through where the schema says ``nullable: true``.

    The document is OpenAPI 3.1 but still marks nullable fields with 3.0's
    ``nullable: true`` (111 places); OAS 3.1's JSON Schema ignores that keyword,
    so a validator that honours it reads the document as its authors wrote it.
    The document itself is used as published: nothing in it is rewritten.
    """

    def wrapped(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        if instance is None and isinstance(schema, dict) and schema.get("nullable") is True:
            return None
        return check(validator, value, instance, schema)

    return wrapped


@functools.cache
def _components() -> dict[str, Any]:
    with OPENAPI_PATH.open() as f:
        # The C loader parses the 3 MB document several times faster.
        spec = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return spec["components"]  # type: ignore[no-any-return]


@functools.cache
def _validator(schema_name: str) -> Any:
    cls = validators.extend(
        OAS31Validator,
        {k: _honour_nullable(v) for k, v in OAS31Validator.VALIDATORS.items()},
    )
    schema = {"$ref": f"#/components/schemas/{schema_name}", "components": _components()}
    return cls(schema)


def schema_errors(instance: Any, schema_name: str) -> list[tuple[tuple[Any, ...], str]]:
    """Every way ``instance`` breaks OpenAI's ``components.schemas[schema_name]``: (path, message)."""
    return sorted(
        (
            (tuple(e.absolute_path), e.message)
            for e in _validator(schema_name).iter_errors(instance)
        ),
        key=repr,
    )


def assert_schema(instance: Any, schema_name: str) -> None:
    """Validate ``instance`` against OpenAI's ``components.schemas[schema_name]``, as published."""
    errors = schema_errors(instance, schema_name)
    assert not errors, errors


def _is_openai_null(error: Any) -> bool:
    """The nulls OpenAI's legacy completions send where the shared schema has none.

    ``finish_reason`` is null on a stream chunk until its choice finishes (OpenAI's
    stream and the openai SDK do this), and with ``echo`` the first prompt token
    has no logprob: ``token_logprobs[0]`` and ``top_logprobs[0]`` are null.
    """
    path = tuple(error.absolute_path)
    if len(path) == 3 and path[0] == "choices" and path[2] == "finish_reason":
        return error.instance is None
    if len(path) == 3 and path[0] == "choices" and path[2] == "logprobs" and error.context:
        # anyOf [object, null]: judge the object branch's own errors.
        inner = [e for e in error.context if e.relative_schema_path[0] == 0]
        return bool(inner) and all(
            e.instance is None
            and tuple(e.relative_path) in (("token_logprobs", 0), ("top_logprobs", 0))
            for e in inner
        )
    return False


def assert_completion_schema(body: Any) -> None:
    """A ``text_completion`` (answer or stream chunk) follows ``CreateCompletionResponse``
    as published, but for the nulls OpenAI itself sends there (``_is_openai_null``)."""
    errors = [
        (tuple(e.absolute_path), e.message)
        for e in _validator("CreateCompletionResponse").iter_errors(body)
        if not _is_openai_null(e)
    ]
    assert not errors, (errors, body)


def assert_error(
    resp: Any, status: int, *, contains: str = "", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``resp`` is an OpenAI-format error with ``status``, a message containing
    ``contains`` and, where given, that ``param`` and ``code``; returns the error."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert_schema(body, "ErrorResponse")
    err = body["error"]
    assert contains.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return dict(err)


def sse_events(raw: str) -> list[Any]:
    """Split raw SSE text strictly: every event is ``data: ...\\n\\n``."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]
