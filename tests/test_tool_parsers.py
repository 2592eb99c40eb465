"""Tool-call parsers: recorded model outputs, malformed input, and chunking invariance."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.tool_parsers import (
    ParsedMessage,
    ToolCall,
    assemble,
    get_tool_parser,
    sequential_ids,
    validate_tool_calls,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]


def call(i: int, name: str, args: dict) -> ToolCall:
    return ToolCall(f"call_{i}", name, json.dumps(args, ensure_ascii=False, separators=(",", ":")))


def parse(parser: str, text: str) -> ParsedMessage:
    return get_tool_parser(parser, TOOLS).parse(text, sequential_ids())


def stream(parser: str, chunks: list[str]) -> ParsedMessage:
    s = get_tool_parser(parser, TOOLS).stream(sequential_ids())
    deltas = [s.feed(c) for c in chunks]
    deltas.append(s.finish())
    # The OpenAI streaming shape: a call's first delta has id+name, later ones only arguments.
    seen: set[int] = set()
    for d in deltas:
        for piece in d.tool_calls:
            if piece.index in seen:
                assert piece.id is None and piece.name is None
            else:
                assert piece.id is not None and piece.name is not None
                seen.add(piece.index)
    return assemble(deltas)


HERMES_CASES: list[tuple[str, ParsedMessage]] = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ParsedMessage(None, [call(0, "get_weather", {"city": "Paris"})]),
    ),
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        ParsedMessage(
            None,
            [call(0, "get_weather", {"city": "Paris", "unit": "c"}), call(1, "now", {})],
        ),
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\nDone, bye.',
        ParsedMessage("Let me check.\nDone, bye.", [call(0, "now", {})]),
    ),
    (  # braces, quotes and the end tag inside strings must not end the block
        '<tool_call>{"name": "get_weather", "arguments": {"city": "a}b\\"</tool_call>{", '
        '"unit": "c"}}</tool_call>',
        ParsedMessage(None, [call(0, "get_weather", {"city": 'a}b"</tool_call>{', "unit": "c"})]),
    ),
    (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 東京 🌧"}}</tool_call>',
        ParsedMessage(None, [call(0, "get_weather", {"city": "Zürich 東京 🌧"})]),
    ),
    (  # nested arguments, arguments given as a JSON string, and a missing arguments key
        '<tool_call>{"name": "now", "arguments": {"a": {"b": [1, {"c": null}]}}}</tool_call>'
        '<tool_call>{"name": "now", "arguments": "{\\"x\\": 1}"}</tool_call>'
        '<tool_call>{"name": "now"}</tool_call>',
        ParsedMessage(
            None,
            [
                call(0, "now", {"a": {"b": [1, {"c": None}]}}),
                call(1, "now", {"x": 1}),
                call(2, "now", {}),
            ],
        ),
    ),
    ("Just text, no calls.  \n", ParsedMessage("Just text, no calls.  \n", [])),
    ("", ParsedMessage("", [])),
]

HERMES_MALFORMED = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # unterminated
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}',  # no end tag
    '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>',  # bad JSON
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # unknown function
    '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',  # arguments not an object
    '<tool_call>{"name": "now", "arguments": {"x": NaN}}</tool_call>',  # not JSON
    '<tool_call>{"name": "now", "arguments": {}]</tool_call>',  # bracket mismatch
    '<tool_call>{"name": "now"} trailing</tool_call>',  # junk before the end tag
    "<tool_call>no json here</tool_call>",
    "a < b and <tool_ca",  # a marker prefix at the end is content
]


@pytest.mark.parametrize(("text", "expected"), HERMES_CASES)
def test_hermes_recorded(text: str, expected: ParsedMessage) -> None:
    assert parse("hermes", text) == expected
    assert stream("hermes", list(text)) == expected


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_is_content(text: str) -> None:
    assert parse("hermes", text) == ParsedMessage(text, [])
    assert stream("hermes", list(text)) == ParsedMessage(text, [])


def test_hermes_valid_calls_survive_a_later_malformed_block() -> None:
    text = 'A <tool_call>{"name": "now", "arguments": {}}</tool_call> B <tool_call>{"name": "x"}'
    expected = ParsedMessage('A B <tool_call>{"name": "x"}', [call(0, "now", {})])
    assert parse("hermes", text) == expected
    assert stream("hermes", list(text)) == expected


def test_no_tools_list_accepts_any_name_and_ids_are_random() -> None:
    text = '<tool_call>{"name": "anything", "arguments": {"k": 1}}</tool_call>'
    a = get_tool_parser("hermes").parse(text)
    b = get_tool_parser("hermes").parse(text)
    assert a.tool_calls[0].name == "anything" and a.tool_calls[0].arguments == '{"k":1}'
    assert a.tool_calls[0].id.startswith("call_") and a.tool_calls[0].id != b.tool_calls[0].id


LLAMA_CASES: list[tuple[str, ParsedMessage | None]] = [
    (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        ParsedMessage(None, [call(0, "get_weather", {"city": "Oslo"})]),
    ),
    (
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"type": "function", "name": "now", "parameters": {}}',
        ParsedMessage(None, [call(0, "get_weather", {"city": "Oslo"}), call(1, "now", {})]),
    ),
    (
        'Checking. <|python_tag|>{"name": "now", "parameters": {"s": "};{"}}',
        ParsedMessage("Checking.", [call(0, "now", {"s": "};{"})]),
    ),
    ('  {"answer": 42}', ParsedMessage('  {"answer": 42}', [])),  # JSON but not a call
    ('<|python_tag|>{"name": "nope", "parameters": {}}', None),  # unknown name
    ('{"name": "now", "parameters": {}', None),  # unterminated
    ("The capital is Paris.", ParsedMessage("The capital is Paris.", [])),
]


@pytest.mark.parametrize(("text", "expected"), LLAMA_CASES)
def test_llama3_recorded(text: str, expected: ParsedMessage | None) -> None:
    expected = expected or ParsedMessage(text, [])
    assert parse("llama3_json", text) == expected
    assert stream("llama3_json", list(text)) == expected


def test_llama3_invalid_second_call_keeps_the_first() -> None:
    text = '{"name": "now", "parameters": {}}; {"name": "bad", "parameters": {}}'
    got = parse("llama3_json", text)
    assert got == ParsedMessage('; {"name": "bad", "parameters": {}}', [call(0, "now", {})])


MISTRAL_CASES: list[tuple[str, ParsedMessage | None]] = [
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]',
        ParsedMessage(None, [call(0, "get_weather", {"city": "Rome"})]),
    ),
    (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "[x]"}}, '
        '{"name": "now", "arguments": {}}]',
        ParsedMessage(None, [call(0, "get_weather", {"city": "[x]"}), call(1, "now", {})]),
    ),
    (
        'Sure.[TOOL_CALLS][{"name": "now", "arguments": {}}]',
        ParsedMessage("Sure.", [call(0, "now", {})]),
    ),
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "bad"}]', None),
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}', None),
    ("[TOOL_CALLS][]", None),
]


@pytest.mark.parametrize(("text", "expected"), MISTRAL_CASES)
def test_mistral_recorded(text: str, expected: ParsedMessage | None) -> None:
    expected = expected or ParsedMessage(text, [])
    assert parse("mistral", text) == expected
    assert stream("mistral", list(text)) == expected


def test_registry() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("nope")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),  # our tool prompt
        ("{{ tools }}{{ '<tool_call>' }}", "hermes"),
        ("{{ tools }}{% if m.role == 'ipython' %}{% endif %}", "llama3_json"),
        ("{{ tools }}<|python_tag|>", "llama3_json"),
        ("{{ tools }}[TOOL_CALLS] {{ calls }}", "mistral"),
        ("{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ args }}", "mistral_v11"),
        ("{{ tools }}<function_call>", None),
    ],
)
def test_tool_call_format_from_template(template: str, expected: str | None) -> None:
    from transformers import PreTrainedTokenizerFast

    from engine.text.tokenizer import Tokenizer

    hf = PreTrainedTokenizerFast(tokenizer_object=_tiny_backend(), chat_template=template)
    assert Tokenizer(hf).tool_call_format == expected


def _tiny_backend() -> object:
    import tokenizers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    return backend


V11_TEXT = (
    'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]abc123[ARGS]{}'
)


def test_mistral_v11_format() -> None:
    expected = ParsedMessage(
        "Sure.", [call(0, "get_weather", {"city": "Paris"}), call(1, "now", {})]
    )
    assert parse("mistral", V11_TEXT) == expected
    assert stream("mistral", list(V11_TEXT)) == expected
    # Not a function name, an undeclared function, or no [ARGS] before the JSON: content.
    for bad in (
        '[TOOL_CALLS]not a name[ARGS]{"a": 1}',
        "[TOOL_CALLS]nope[ARGS]{}",
        '[TOOL_CALLS]now{"a": 1}',
    ):
        assert parse("mistral", bad) == ParsedMessage(bad, []), bad


@pytest.mark.parametrize(
    ("name", "text", "sep"),
    [
        ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "\n"),
        ("llama3_json", '{"name": "now", "parameters": {}}', "; "),
        ("mistral", "[TOOL_CALLS]now[ARGS]{}", ""),
    ],
)
def test_drop_incomplete_cuts(name: str, text: str, sep: str) -> None:
    """Cut anywhere in a second call: with drop_incomplete, one call and no markup as content."""
    parser = get_tool_parser(name, TOOLS)
    assert len(parser.parse(text + sep + text, drop_incomplete=True).tool_calls) == 2
    for cut in range(1, len(text)):
        cut_text = text + sep + text[:cut]
        parsed = parser.parse(cut_text, drop_incomplete=True)
        assert [c.name for c in parsed.tool_calls] == ["now"], cut
        assert not parsed.content, (cut, parsed.content)
        s = parser.stream()
        deltas = [s.feed(ch) for ch in cut_text] + [s.finish(drop_incomplete=True)]
        assert "".join(d.content for d in deltas) == "", cut
        assert sum(1 for d in deltas for c in d.tool_calls if c.name) == 1, cut


def test_without_dropping_a_cut_block_is_content() -> None:
    text = '<tool_call>\n{"name": "now", "arguments": {'
    assert parse("hermes", text) == ParsedMessage(text, [])
    assert get_tool_parser("hermes", TOOLS).parse(text, drop_incomplete=True) == ParsedMessage(
        "", []
    )


def test_feed_after_finish_raises() -> None:
    s = get_tool_parser("hermes").stream()
    s.finish()
    with pytest.raises(RuntimeError):
        s.feed("x")


def test_validate_tool_calls() -> None:
    calls = [
        call(0, "get_weather", {"city": "Paris"}),
        call(1, "get_weather", {"unit": "k"}),
        call(2, "missing", {}),
        ToolCall("call_3", "now", "[1]"),
        ToolCall("call_4", "now", "{bad"),
    ]
    problems = validate_tool_calls(calls, TOOLS)
    assert not any(p.startswith("tool_calls[0]") for p in problems)
    assert any(p.startswith("tool_calls[1]") and "'city' is a required" in p for p in problems)
    assert any(p.startswith("tool_calls[1]") and "unit" in p for p in problems)
    assert any(p.startswith("tool_calls[2]") and "no such function" in p for p in problems)
    assert any(p.startswith("tool_calls[3]") and "JSON object" in p for p in problems)
    assert any(p.startswith("tool_calls[4]") and "not valid JSON" in p for p in problems)
    assert validate_tool_calls(calls[:1], TOOLS) == []


# ---- chunking invariance -------------------------------------------------------------

HERMES_PIECES = [
    "Hello ",
    "ünï 🌧 < text ",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}\\"</tool_call>"}}\n</tool_call>',
    '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    '\n<tool_call>{"name": "now", "arguments": {"n": [1, {"x": "]"}]}}</tool_call>\n',
    '<tool_call>{"name": "ghost", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "now", "arguments": {"x": ',
    " <tool_",
]
LLAMA_PIECES = [
    '{"name": "now", "parameters": {}}',
    '; {"name": "get_weather", "parameters": {"city": "x;}"}}',
    ";",
    " more text ",
    '<|python_tag|>{"name": "now", "parameters": {"u": "é"}}',
    '{"name": "ghost", "parameters": {}}',
    "<|python",
]
MISTRAL_PIECES = [
    "Hi ",
    '[TOOL_CALLS][{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": '
    '{"city": "]["}}]',
    '[TOOL_CALLS]{"name": "now", "arguments": {"a": 1}}',
    " then ",
    '[TOOL_CALLS][{"name": "ghost", "arguments": {}}]',
    "[TOOL_",
]
PIECES = {"hermes": HERMES_PIECES, "llama3_json": LLAMA_PIECES, "mistral": MISTRAL_PIECES}


@st.composite
def chunked_text(draw: st.DrawFn, parser: str) -> tuple[str, list[str]]:
    """A text made of format pieces, and a random chunking of it.

    Chunk boundaries are either random 1-4 character cuts or piece boundaries
    (so whole calls, or two calls, arrive in one chunk).
    """
    pieces = draw(st.lists(st.sampled_from(PIECES[parser]), min_size=1, max_size=6))
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        mode = draw(st.sampled_from(["small", "whole", "merge"]))
        if mode == "merge":
            current += piece
            continue
        if current:
            chunks.append(current)
            current = ""
        if mode == "whole":
            chunks.append(piece)
            continue
        i = 0
        while i < len(piece):
            n = draw(st.integers(1, 4))
            chunks.append(piece[i : i + n])
            i += n
    if current:
        chunks.append(current)
    return "".join(chunks), chunks


@pytest.mark.parametrize("parser", sorted(PIECES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_streaming_equals_non_streaming(parser: str, data: st.DataObject) -> None:
    text, chunks = data.draw(chunked_text(parser))
    expected = parse(parser, text)
    assert stream(parser, chunks) == expected
    assert stream(parser, list(text)) == expected
    assert [c.id for c in expected.tool_calls] == [
        f"call_{i}" for i in range(len(expected.tool_calls))
    ]
    for c in expected.tool_calls:
        assert json.loads(c.arguments) is not None
