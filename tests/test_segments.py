"""Prompt segments: the chat template renderer's per-message token spans (issue 17).

Expected spans are independent of the renderer: on the default model's ChatML
template each message's block is tokenized on its own by transformers (ChatML
blocks start at a special token, so per-block ids concatenate to the whole);
on tiny tokenizers built here the spans are counted by hand.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.request import Segment
from engine.text.tokenizer import Tokenizer

CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


@pytest.fixture(scope="module")
def tok(default_model_path: Path) -> Tokenizer:
    return Tokenizer.load(default_model_path)


def spans(segments: tuple[Segment, ...]) -> list[tuple[int, int, str, int]]:
    return [(s.start, s.end, s.kind, s.turn) for s in segments]


def block_lengths(tok: Tokenizer, blocks: list[str]) -> list[int]:
    hf = tok.hf_tokenizer
    return [len(hf.encode(b, add_special_tokens=False)) for b in blocks]


def test_chatml_spans_match_per_message_blocks(tok: Tokenizer) -> None:
    ids, segments = tok.apply_chat_template_segments(CONVO)
    hf_ids = tok.hf_tokenizer.apply_chat_template(
        CONVO, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert ids == list(hf_ids) == tok.apply_chat_template(CONVO)
    blocks = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVO]
    lengths = block_lengths(tok, blocks)
    assert lengths == [8, 7, 8, 12]  # pins the literal spans below
    assert spans(segments) == [
        (0, 8, "system", 0),
        (8, 15, "user", 1),
        (15, 23, "assistant", 2),
        (23, 35, "user", 3),
    ]
    # The generation prompt follows the last message and is in no segment.
    assert tok.decode(ids[35:], skip_special_tokens=False) == "<|im_start|>assistant\n"
    for s, block in zip(segments, blocks, strict=True):
        assert tok.decode(ids[s.start : s.end], skip_special_tokens=False) == block


def test_default_system_prompt_belongs_to_the_first_message(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    ids, segments = tok.apply_chat_template_segments(msgs, add_generation_prompt=False)
    default = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
        "Hugging Face<|im_end|>\n"
    )
    first, second = block_lengths(
        tok, [default + "<|im_start|>user\nHi<|im_end|>\n", "<|im_start|>assistant\nYo<|im_end|>\n"]
    )
    assert spans(segments) == [(0, first, "user", 0), (first, first + second, "assistant", 1)]
    assert len(ids) == first + second


def test_typed_special_strings_stay_text_and_spans_hold(tok: Tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a <|im_end|> b"},
        {"role": "assistant", "content": "ok"},
    ]
    ids, segments = tok.apply_chat_template_segments(msgs, add_generation_prompt=False)
    assert ids == tok.apply_chat_template(msgs, add_generation_prompt=False)
    _, user, assistant = segments
    im_end = tok.hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # One special <|im_end|> per message (the template's); the typed one is plain text.
    assert ids[user.start : user.end].count(im_end) == 1
    assert tok.decode(ids[user.start : user.end], skip_special_tokens=False) == (
        "<|im_start|>user\na <|im_end|> b<|im_end|>\n"
    )
    assert (assistant.start, assistant.end) == (user.end, len(ids))


def test_tool_calls_and_merged_tool_results(tok: Tokenizer) -> None:
    """Two tool results render as one Hermes ``user`` turn; each still gets its own span."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    calls = [
        {"id": c, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
        for c in ("a", "b")
    ]
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    ids, segments = tok.apply_chat_template_segments(msgs, tools=tools)
    assert ids == tok.apply_chat_template(msgs, tools=tools)
    assert [(s.kind, s.turn) for s in segments] == [
        ("system", 0),
        ("user", 1),
        ("assistant", 2),
        ("tool", 3),
        ("tool", 4),
    ]
    text = [tok.decode(ids[s.start : s.end], skip_special_tokens=False) for s in segments]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert text[2] == f"<|im_start|>assistant\n{call}\n{call}<|im_end|>\n"
    assert text[3] == "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
    assert text[4] == "\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
    assert all(a.end == b.start for a, b in itertools.pairwise(segments))


def test_continue_final_message_ends_the_last_span(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1 2"}]
    ids, segments = tok.apply_chat_template_segments(
        msgs, add_generation_prompt=False, continue_final_message=True
    )
    assert segments[-1].end == len(ids)
    assert tok.decode(ids[segments[-1].start :], skip_special_tokens=False) == (
        "<|im_start|>assistant\n1 2"
    )


# ------------------------------------------------------------ tiny tokenizers


def _tiny(tmp_path: Path, raw: RawTokenizer, template: str) -> Tokenizer:
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    hf.chat_template = template
    hf.save_pretrained(str(tmp_path))
    return Tokenizer.load(tmp_path)


def test_word_level_spans_by_hand(tmp_path: Path) -> None:
    words = ["<unk>", "system", "user", "bot", "says", "be", "brief", "hi", "there", "."]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}{{ m['role'] }} says {{ m['content'] }} . {% endfor %}"
        "{% if add_generation_prompt %}bot says{% endif %}"
    )
    tok = _tiny(tmp_path, raw, template)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids, segments = tok.apply_chat_template_segments(msgs)
    # system says be brief . | user says hi there . | bot says
    assert ids == [1, 4, 5, 6, 9, 2, 4, 7, 8, 9, 3, 4]
    assert spans(segments) == [(0, 5, "system", 0), (5, 10, "user", 1)]


def test_token_across_a_boundary_belongs_to_the_message_it_starts_in(tmp_path: Path) -> None:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "bc": 5}
    raw = RawTokenizer(models.BPE(vocab, [("b", "c")], unk_token="<unk>"))
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = _tiny(tmp_path, raw, template)
    msgs = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    ids, segments = tok.apply_chat_template_segments(msgs, add_generation_prompt=False)
    assert ids == [1, 5, 4]  # a | bc | d: "bc" starts in message 0
    assert spans(segments) == [(0, 2, "user", 0), (2, 3, "assistant", 1)]


def test_template_refusing_a_prefix_gives_no_segments(tmp_path: Path) -> None:
    words = ["<unk>", "q", "r", "x", "y"]
    raw = RawTokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% if messages|length < 3 %}{{ raise_exception('need three messages') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    )
    tok = _tiny(tmp_path, raw, template)
    msgs = [{"role": "user", "content": c} for c in ("q", "r", "x")]
    ids, segments = tok.apply_chat_template_segments(msgs)
    assert ids == tok.apply_chat_template(msgs) == [1, 2, 3]
    assert segments == ()
