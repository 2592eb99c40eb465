"""Structured outputs: compile a ``StructuredOutputSpec`` to a token mask, per request.

Why xgrammar: it is maintained, it is what vLLM and SGLang use, it compiles JSON
Schema, EBNF, regex and structural tags (what the tool-call grammar needs), and
its per-token work is a precomputed-cache bitmask fill plus a fast (C++ on CPU,
Triton/CUDA on GPU) in-place bitmask application: no Python loop over the
vocabulary anywhere on the hot path.

Use: one ``GrammarCompiler`` per model (thread safe, cached); one
``GrammarState`` per request; per decode step ``allocate_bitmask`` once per
batch shape, ``state.fill_bitmask(bitmask, row)`` for each constrained row,
``apply_bitmask(logits, bitmask, rows)``, sample, then ``state.accept_token``.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any, Literal

import torch
import xgrammar as xgr
from xgrammar import structural_tag as xst

from engine.errors import InvalidRequestError
from engine.sampling.params import StructuredOutputSpec
from engine.text.tokenizer import ToolCallFormat

# Limits against hostile schemas; checked before compiling (cheap) and enforced by
# a compile timeout for what slips through (expensive shapes with small text).
MAX_SPEC_BYTES = 100_000
MAX_SCHEMA_DEPTH = 64
MAX_ENUM_VALUES = 10_000
COMPILE_TIMEOUT_S = 5.0
# Timed-out compiles cannot be killed (native code); refuse new compiles while
# this many are still burning CPU in the background.
MAX_ABANDONED_COMPILES = 2
# Consecutive whitespace allowed between JSON tokens of tool-call arguments (the
# structural-tag format has no compact mode): enough for indented output, bounded
# so a small model cannot loop on whitespace forever.
MAX_JSON_WHITESPACE = 16

ToolChoice = Literal["required"] | Mapping[str, Any]


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param="response_format")


def _native_message(exc: BaseException) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())


def _check_json_limits(value: Any, depth: int = 0) -> None:
    """Reject schemas nested deeper than MAX_SCHEMA_DEPTH or with huge enums."""
    if depth > MAX_SCHEMA_DEPTH:
        raise _invalid(f"the JSON schema is nested deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(value, dict):
        enum = value.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_ENUM_VALUES:
            raise _invalid(
                f"the JSON schema has an enum with {len(enum)} values "
                f"(at most {MAX_ENUM_VALUES} are allowed)"
            )
        for item in value.values():
            _check_json_limits(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json_limits(item, depth + 1)


def canonical_key(spec: StructuredOutputSpec) -> str:
    """The cache key: the spec as canonical JSON (sorted keys, compact)."""
    return json.dumps(asdict(spec), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """A ``[batch, ceil(vocab_size / 32)]`` int32 bitmask on CPU, all tokens allowed.

    Bit ``t % 32`` of word ``t // 32`` set means token ``t`` is allowed. Move it to
    the logits' device before ``apply_bitmask`` (xgrammar fills it on CPU).
    """
    return xgr.allocate_token_bitmask(batch, vocab_size)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor
) -> None:
    """Set disallowed logits to ``-inf`` in place, for the given rows only.

    ``logits`` is ``[batch, vocab]`` (vocab may be smaller than 32 * words);
    ``bitmask`` is ``[batch, words]`` and row ``r`` of it masks row ``r`` of
    ``logits``. Rows not listed are untouched (unconstrained requests).
    """
    indices = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
    if not indices:
        return
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=indices)


class GrammarState:
    """The grammar's progress through one request's generated tokens.

    Not thread safe; owned by the request. After ``accept_token`` returns False
    the state is unchanged (the token was not allowed).
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (a CPU int32 tensor)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one generated token; False (state unchanged) if it is not allowed."""
        return bool(self._matcher.accept_token(token_id))

    def is_terminated(self) -> bool:
        """True once the grammar accepted a stop token: the request must finish."""
        return bool(self._matcher.is_terminated())

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (cheap; xgrammar keeps unlimited history)."""
        self._matcher.rollback(n)

    def valid_prefix_length(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows in a row (stopping after one
        that terminates it); the state is left unchanged."""
        n = 0
        for tok in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(tok):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n


class GrammarCompiler:
    """Compiles specs for one tokenizer/vocabulary, with an LRU cache. Thread safe.

    ``tokenizer_info_source`` is a Hugging Face tokenizer (the engine Tokenizer's
    ``.hf``); ``vocab_size`` is the model's embedding rows, which may exceed the
    tokenizer's length (the extra ids are never allowed).
    """

    def __init__(
        self,
        tokenizer_info_source: Any,
        vocab_size: int,
        max_threads: int = 1,
        *,
        cache_size: int = 128,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer_info_source, vocab_size=vocab_size
        )
        # Our own LRU replaces xgrammar's cache so the key is the canonical spec.
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._timeout = compile_timeout_s
        self._lock = threading.Lock()
        self._abandoned = 0

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """Compile (or fetch from cache); ``InvalidRequestError`` if the spec is unusable."""
        key = canonical_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if len(key.encode()) > MAX_SPEC_BYTES:
            raise _invalid(f"the structured output spec is larger than {MAX_SPEC_BYTES} bytes")
        if spec.json_schema is not None:
            _check_json_limits(spec.json_schema)
        compiled = self._compile_with_timeout(spec)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutputSpec) -> GrammarState:
        """A fresh per-request state for ``spec``."""
        return GrammarState(self.compile(spec))

    def _compile_now(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        chosen = [
            spec.json_schema is not None,
            spec.json_object,
            spec.grammar is not None,
            spec.regex is not None,
        ]
        if sum(chosen) != 1:
            raise _invalid("exactly one of json_schema, json_object, grammar, regex must be set")
        # JSON answers use one fixed layout, ``{"a": 1, "b": [2, 3]}``, not free
        # whitespace: measured on SmolLM2-135M, free (even bounded) whitespace let
        # the model spend most of its tokens on "\n\n" between tokens and run out of
        # max_tokens mid-object; the fixed layout also costs fewer tokens per answer.
        if spec.json_schema is not None:
            return self._compiler.compile_json_schema(
                json.dumps(spec.json_schema), any_whitespace=False, strict_mode=True
            )
        if spec.json_object:
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.grammar is not None:
            return self._compiler.compile_grammar(spec.grammar)
        assert spec.regex is not None
        return self._compiler.compile_regex(spec.regex)

    def _compile_with_timeout(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        with self._lock:
            if self._abandoned >= MAX_ABANDONED_COMPILES:
                raise _invalid("too many grammar compilations timed out recently; try later")
        result: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                result["value"] = self._compile_now(spec)
            except BaseException as exc:  # reported to the caller below
                result["error"] = exc
            finally:
                done.set()
                with self._lock:
                    if result.get("abandoned"):
                        self._abandoned -= 1

        # A fresh daemon thread per compile: a hung compile then blocks nobody else.
        thread = threading.Thread(target=work, name="grammar-compile", daemon=True)
        thread.start()
        if not done.wait(self._timeout):
            with self._lock:
                # Re-checked under the lock: the worker may have finished meanwhile.
                timed_out = not done.is_set()
                if timed_out:
                    result["abandoned"] = True
                    self._abandoned += 1
            if timed_out:
                raise _invalid(
                    f"the structured output spec took longer than {self._timeout:g} s to compile"
                )
        error = result.get("error")
        if isinstance(error, InvalidRequestError):
            raise error
        if error is not None:
            raise _invalid(
                f"cannot compile the structured output spec: {_native_message(error)}"
            ) from error
        compiled: xgr.CompiledGrammar = result["value"]
        return compiled

    def build_tool_call_spec(
        self,
        tools: Sequence[Mapping[str, Any]],
        tool_choice: ToolChoice,
        tool_format: ToolCallFormat = "hermes",
        parallel_tool_calls: bool = True,
    ) -> StructuredOutputSpec:
        """A grammar spec forcing tool calls in ``tool_format`` whose arguments follow the schemas.

        ``tool_choice="required"``: one or more calls of any of ``tools``, at most
        ``MAX_PARALLEL_TOOL_CALLS`` (exactly one when ``parallel_tool_calls`` is
        false); ``{"type": "function", "function": {"name": N}}``: exactly one call
        of N. Nothing but calls (and the format's separators) may be generated,
        and after the last call the grammar accepts only the end of the turn, so
        the turn ends with the calls (see ``tool_call_structure``). Errors are
        ``InvalidRequestError`` with ``param="tool_choice"``/``"tools"``.
        """
        functions: dict[str, Any] = {}
        for tool in tools:
            function = tool.get("function")
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise InvalidRequestError("each tool needs function.name", param="tools")
            functions[function["name"]] = function.get("parameters") or {"type": "object"}
        if tool_choice == "required":
            chosen = list(functions)
            max_calls = MAX_PARALLEL_TOOL_CALLS if parallel_tool_calls else 1
        elif isinstance(tool_choice, Mapping):
            function = tool_choice.get("function")
            name = function.get("name") if isinstance(function, Mapping) else None
            if name not in functions:
                raise InvalidRequestError(
                    f"tool_choice names function {name!r}, which is not in tools",
                    param="tool_choice",
                )
            chosen = [name]
            max_calls = 1
        else:
            raise InvalidRequestError(
                f"tool_choice {tool_choice!r} does not force a call", param="tool_choice"
            )
        if not chosen:
            raise InvalidRequestError("tool_choice is 'required' but tools is empty", param="tools")
        for name in chosen:
            _check_json_limits(functions[name])
        structure = tool_call_structure(
            tool_format, [(name, functions[name]) for name in chosen], max_calls
        )
        try:
            grammar = xgr.Grammar.from_structural_tag(xst.StructuralTag(format=structure))
        except Exception as exc:  # xgrammar raises several types for bad schemas
            raise InvalidRequestError(
                f"cannot build a grammar from the tools' parameters: {_native_message(exc)}",
                param="tools",
            ) from exc
        return StructuredOutputSpec(grammar=str(grammar))


# At most this many calls in one forced (``required``) turn: the grammar's
# guarantee that the turn ends. A small model otherwise can repeat calls until
# max_tokens cuts one in half.
MAX_PARALLEL_TOOL_CALLS = 8


def tool_call_structure(
    tool_format: ToolCallFormat, functions: Sequence[tuple[str, Any]], max_calls: int
) -> xst.Format:
    """The structural tag of 1..``max_calls`` calls of ``functions`` in ``tool_format``.

    Each call names one function and its arguments follow that function's JSON
    schema; calls are separated as the format separates them (and as its
    parser in ``server/tool_parsers/`` reads them):

    * hermes: ``<tool_call>\n{"name": N, "arguments": ARGS}\n</tool_call>``,
      newline-separated; one trailing newline may follow the last call (a
      newline alone does not commit the model to another call);
    * llama3_json: ``{"name": N, "parameters": ARGS}``, separated by ``; ``;
    * mistral: ``[TOOL_CALLS][{"name": N, "arguments": ARGS}, ...]`` (one array);
    * mistral_v11: ``[TOOL_CALLS]N[ARGS]ARGS`` per call.
    """

    def args(schema: Any) -> xst.JSONSchemaFormat:
        return xst.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_JSON_WHITESPACE)

    def one_of(make: Callable[[str, Any], xst.Format]) -> xst.Format:
        options = [make(name, schema) for name, schema in functions]
        return options[0] if len(options) == 1 else xst.OrFormat(elements=options)

    def calls(call: xst.Format, separator: str) -> list[xst.Format]:
        if max_calls == 1:
            return [call]
        more = xst.SequenceFormat(elements=[xst.ConstStringFormat(value=separator), call])
        return [call, xst.RepeatFormat(min=0, max=max_calls - 1, content=more)]

    if tool_format == "hermes":
        call = one_of(
            lambda n, s: xst.TagFormat(
                begin=f'<tool_call>\n{{"name": {json.dumps(n)}, "arguments": ',
                content=args(s),
                end="}\n</tool_call>",
            )
        )
        tail = xst.OptionalFormat(content=xst.ConstStringFormat(value="\n"))
        return xst.SequenceFormat(elements=[*calls(call, "\n"), tail])
    if tool_format == "llama3_json":
        call = one_of(
            lambda n, s: xst.TagFormat(
                begin=f'{{"name": {json.dumps(n)}, "parameters": ', content=args(s), end="}"
            )
        )
        return xst.SequenceFormat(elements=calls(call, "; "))
    if tool_format == "mistral":
        call = one_of(
            lambda n, s: xst.TagFormat(
                begin=f'{{"name": {json.dumps(n)}, "arguments": ', content=args(s), end="}"
            )
        )
        return xst.SequenceFormat(
            elements=[
                xst.ConstStringFormat(value="[TOOL_CALLS]["),
                *calls(call, ", "),
                xst.ConstStringFormat(value="]"),
            ]
        )
    if tool_format == "mistral_v11":
        call = one_of(
            lambda n, s: xst.TagFormat(begin=f"[TOOL_CALLS]{n}[ARGS]", content=args(s), end="")
        )
        return xst.SequenceFormat(elements=calls(call, ""))
    raise InvalidRequestError(f"unknown tool-call format {tool_format!r}", param="tool_choice")
