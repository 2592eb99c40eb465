"""Structured outputs with xgrammar on the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import random
import re
import time
from typing import Any

import jsonschema
import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling.grammar import (
    GrammarCompiler,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
    canonical_key,
)
from engine.sampling.params import StructuredOutputSpec
from server.tool_parsers import get_tool_parser, validate_tool_calls

pytestmark = pytest.mark.slow  # loads the real model's tokenizer from its GGUF (~15 s)

VOCAB = 49152

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "active": {"type": "boolean"},
        "pet": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 4}]},
    },
    "required": ["name", "age", "tags", "active", "pet"],
    "additionalProperties": False,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    },
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Any) -> Any:
    from transformers import AutoTokenizer

    path = default_model_path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab: int = VOCAB) -> torch.Tensor:
    bits = (bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def random_walk(
    state: GrammarState,
    tokenizer: Any,
    rng: random.Random,
    max_steps: int = 400,
    stop_prob: float = 0.7,
) -> str:
    """Sample uniformly among allowed tokens (stop token preferred) until termination."""
    bitmask = allocate_bitmask(1, VOCAB)
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for _ in range(max_steps):
        state.fill_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, 0).nonzero().flatten().tolist()
        assert allowed, "the grammar allows nothing but is not terminated"
        token = eos if eos in allowed and rng.random() < stop_prob else rng.choice(allowed)
        assert state.accept_token(token)
        if state.is_terminated():
            assert token == eos
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError(f"no termination after {max_steps} tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_validate_against_schema(
    compiler: GrammarCompiler, tokenizer: Any, seed: int
) -> None:
    state = compiler.new_state(StructuredOutputSpec(json_schema=SCHEMA))
    text = random_walk(state, tokenizer, random.Random(seed))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_and_regex(compiler: GrammarCompiler, tokenizer: Any) -> None:
    rng = random.Random(7)
    text = random_walk(
        compiler.new_state(StructuredOutputSpec(regex=r"(yes|no)-[0-9]{2}")), tokenizer, rng
    )
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", text)
    grammar = 'root ::= "x" ("ab" | "cd") "!"'
    text = random_walk(compiler.new_state(StructuredOutputSpec(grammar=grammar)), tokenizer, rng)
    assert text in {"xab!", "xcd!"}


def test_bitmask_blocks_disallowed_tokens_exactly(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    state = compiler.new_state(StructuredOutputSpec(json_schema=SCHEMA))
    assert state.accept_token(tokenizer.encode('{"', add_special_tokens=False)[0])
    bitmask = allocate_bitmask(3, VOCAB)
    state.fill_bitmask(bitmask, 1)  # rows 0 and 2: unconstrained requests
    allowed = allowed_tokens(bitmask, 1)
    assert 0 < int(allowed.sum()) < VOCAB
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.equal(logits[1][allowed], before[1][allowed])
    assert bool(torch.isneginf(logits[1][~allowed]).all())
    # The mask agrees with the matcher on sampled allowed and disallowed tokens.
    rng = random.Random(0)
    ok = allowed.nonzero().flatten().tolist()
    bad = (~allowed).nonzero().flatten().tolist()
    for token in rng.sample(ok, min(20, len(ok))):
        assert state.accept_token(token), tokenizer.decode([token])
        state.rollback(1)
    for token in rng.sample(bad, 50):
        assert not state.accept_token(token), tokenizer.decode([token])
    # Tensor row indices work the same way.
    logits2 = before.clone()
    apply_bitmask(logits2, bitmask, torch.tensor([1]))
    assert torch.equal(logits2, logits)


def test_vocab_larger_than_tokenizer(tokenizer: Any) -> None:
    padded = GrammarCompiler(tokenizer, VOCAB + 64)
    state = padded.new_state(StructuredOutputSpec(json_object=True))
    bitmask = allocate_bitmask(1, VOCAB + 64)
    state.fill_bitmask(bitmask, 0)
    allowed = allowed_tokens(bitmask, 0, VOCAB + 64)
    assert not bool(allowed[VOCAB:].any())  # padding rows are never sampled


def test_cache_is_keyed_by_canonical_spec(compiler: GrammarCompiler) -> None:
    a = StructuredOutputSpec(json_schema={"type": "object", "properties": {"x": {}, "y": {}}})
    b = StructuredOutputSpec(json_schema={"properties": {"y": {}, "x": {}}, "type": "object"})
    assert canonical_key(a) != canonical_key(StructuredOutputSpec(json_object=True))
    assert compiler.compile(a) is compiler.compile(b)


HOSTILE: dict[str, StructuredOutputSpec] = {
    "deep": StructuredOutputSpec(json_schema=json.loads('{"items":' * 100 + "{}" + "}" * 100)),
    "big_enum": StructuredOutputSpec(json_schema={"enum": list(range(20_000))}),
    "huge": StructuredOutputSpec(
        json_schema={
            "type": "object",
            "properties": {f"p{i}": {"type": "string"} for i in range(9000)},
        }
    ),
    "bad_pattern": StructuredOutputSpec(json_schema={"type": "string", "pattern": "(["}),
    "bad_type": StructuredOutputSpec(json_schema={"type": "nonsense"}),
    "bad_regex": StructuredOutputSpec(regex="(["),
    "bad_grammar": StructuredOutputSpec(grammar="root ::= undefined_rule"),
    "nothing_set": StructuredOutputSpec(),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_specs_are_rejected_quickly(compiler: GrammarCompiler, name: str) -> None:
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(HOSTILE[name])
    assert time.monotonic() - start < 10
    assert info.value.param == "response_format"
    assert str(info.value)


def test_compile_timeout_rejects(tokenizer: Any) -> None:
    # Under the size limit, but xgrammar needs well over 30 s on this schema (2000
    # optional pattern properties): the timeout must answer instead.
    impatient = GrammarCompiler(tokenizer, VOCAB, compile_timeout_s=1.0)
    slow = {f"p{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(2000)}
    spec = StructuredOutputSpec(json_schema={"type": "object", "properties": slow})
    start = time.monotonic()
    with pytest.raises(InvalidRequestError, match="longer than 1 s") as info:
        impatient.compile(spec)
    assert time.monotonic() - start < 10
    assert info.value.param == "response_format"


@pytest.mark.parametrize(
    ("choice", "parallel", "names"),
    [
        ("required", True, {"get_weather", "now"}),
        ("required", False, {"get_weather", "now"}),
        ({"type": "function", "function": {"name": "get_weather"}}, True, {"get_weather"}),
    ],
)
def test_forced_tool_calls_parse_and_validate(
    compiler: GrammarCompiler, tokenizer: Any, choice: Any, parallel: bool, names: set[str]
) -> None:
    spec = compiler.build_tool_call_spec(TOOLS, choice, parallel_tool_calls=parallel)
    counts: set[int] = set()
    parallel_calls = parallel and not isinstance(choice, dict)
    # After a call the grammar allows the end of the turn or another call (which a
    # uniform random walk takes about one time in four): walk until one shows up.
    for seed in range(16 if parallel_calls else 4):
        if parallel_calls and max(counts, default=0) > 1:
            break
        # A walk that rarely stops where it may, so that a second call shows up.
        stop_prob = 0.1 if parallel_calls else 0.7
        text = random_walk(compiler.new_state(spec), tokenizer, random.Random(seed), 600, stop_prob)
        parsed = get_tool_parser("hermes", TOOLS).parse(text)
        assert parsed.content is None, text
        assert parsed.tool_calls and {c.name for c in parsed.tool_calls} <= names
        assert validate_tool_calls(parsed.tool_calls, TOOLS) == []
        counts.add(len(parsed.tool_calls))
    if not parallel_calls:
        assert counts == {1}
    else:
        assert max(counts) > 1  # parallel calls are allowed and these seeds produce some


def test_forced_tool_call_errors(compiler: GrammarCompiler) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compiler.build_tool_call_spec(TOOLS, {"type": "function", "function": {"name": "x"}})
    assert info.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        compiler.build_tool_call_spec([], "required")
    with pytest.raises(InvalidRequestError):
        compiler.build_tool_call_spec(TOOLS, "required", tool_format="nope")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tool_format", "parser"),
    [("llama3_json", "llama3_json"), ("mistral", "mistral"), ("mistral_v11", "mistral")],
)
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_every_format(
    compiler: GrammarCompiler, tokenizer: Any, tool_format: Any, parser: str, parallel: bool
) -> None:
    """Whatever the grammar lets a model generate, the format's parser reads as calls only."""
    spec = compiler.build_tool_call_spec(TOOLS, "required", tool_format, parallel)
    for seed in range(2):
        text = random_walk(compiler.new_state(spec), tokenizer, random.Random(seed), 600)
        parsed = get_tool_parser(parser, TOOLS).parse(text)
        assert not (parsed.content or "").strip(), text
        assert 1 <= len(parsed.tool_calls) <= (8 if parallel else 1), text
        assert validate_tool_calls(parsed.tool_calls, TOOLS) == []
