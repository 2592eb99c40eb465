"""Quality of the CPU execution paths against the exact mode, beside their speed.

For each configuration (``--configs``, ``CPU_LINEAR:KV_CACHE_DTYPE`` items;
the first is the reference, by default the exact mode ``onednn:float32``):

- perplexity of a long text (benchmarks/data/GPL-3.txt, the GNU GPL v3, ~8k
  tokens) in windows of ``--window`` tokens, from the engine's prompt
  logprobs; prefill chunks of ``--chunk`` tokens, so later chunks attend
  over keys and values read back from the KV cache in its dtype;
- greedy agreement with the reference on the standard prompts (the load
  test's questions, chat template, ``--max-tokens`` tokens, temperature 0):
  how many answers are token-identical, and where the others first differ.
  The reference runs each prompt alone; the others run all prompts batched
  (the serving case);
- the generate run's output tokens per second (same process, one after
  another; the machine's load is printed).

Usage::

    python -m benchmarks.cpu_quality --configs onednn:float32,auto:auto,q4_1:float32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams

TEXT = Path(__file__).parent / "data" / "GPL-3.txt"
QUESTIONS = Path(__file__).resolve().parent.parent / "loadtest" / "data" / "questions.txt"


def engine_for(spec: str, chunk: int) -> LLMEngine:
    linear, _, kv = spec.partition(":")
    return LLMEngine(
        EngineConfig(
            cpu_linear=linear,  # type: ignore[arg-type]
            kv_cache_dtype=(kv or "auto"),  # type: ignore[arg-type]
            max_num_batched_tokens=chunk,
            kv_cache_memory=256 << 20,
            max_num_seqs=128,
        )
    )


def perplexity(eng: LLMEngine, ids: list[int], window: int) -> float:
    """exp(mean NLL) of every token after the first of each window."""
    nll: list[float] = []
    for w, start in enumerate(range(0, len(ids) - 1, window)):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        eng.add_request(f"ppl-{w}", chunk, SamplingParams(max_tokens=1, prompt_logprobs=0))
        while eng.has_unfinished():
            for _, out in eng.step():
                for p in out.prompt_logprobs or []:
                    if p is not None:
                        nll.append(-p.chosen.logprob)
    return math.exp(statistics.fmean(nll))


def greedy_answers(
    eng: LLMEngine, prompts: list[list[int]], n: int, alone: bool
) -> tuple[list[list[int]], float]:
    """Greedy continuations and output tok/s (all prompts batched unless ``alone``)."""
    llm = LLM(engine=eng)
    p = SamplingParams(temperature=0.0, max_tokens=n)
    t0 = time.perf_counter()
    if alone:
        outs = [llm.generate([q], p)[0].token_ids for q in prompts]
    else:
        outs = [r.token_ids for r in llm.generate(prompts, p)]
    dt = time.perf_counter() - t0
    return outs, sum(len(o) for o in outs) / dt


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="onednn:float32,auto:auto")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    specs = args.configs.split(",")
    rows: list[dict[str, Any]] = []
    ref_answers: list[list[int]] = []
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()}")
    for i, spec in enumerate(specs):
        eng = engine_for(spec, args.chunk)
        text_ids = eng.tokenizer.encode(TEXT.read_text())
        questions = [q.strip() for q in QUESTIONS.read_text().splitlines() if q.strip()]
        prompts = [
            eng.tokenizer.apply_chat_template([{"role": "user", "content": q}])
            for q in questions[: args.num_prompts]
        ]
        ppl = perplexity(eng, text_ids, args.window)
        answers, tok_s = greedy_answers(eng, prompts, args.max_tokens, alone=i == 0)
        if i == 0:
            ref_answers = answers
        diffs = [first_difference(a, r) for a, r in zip(answers, ref_answers)]
        same = sum(d is None for d in diffs)
        differ = [d for d in diffs if d is not None]
        row = {
            "config": spec,
            "execution": eng.info.execution(),
            "text_tokens": len(text_ids),
            "perplexity": ppl,
            "identical_answers": same,
            "prompts": len(prompts),
            "first_difference_median": statistics.median(differ) if differ else None,
            "generate_tok_s": tok_s,
        }
        rows.append(row)
        print(json.dumps(row))
        del eng
    print(f"\nload={os.getloadavg()}")
    print(
        "| config | linears | KV | perplexity | identical greedy answers | median first difference | generate tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        e = r["execution"]
        print(
            f"| {r['config']} | {e['cpu_linear']} | {e['kv_cache_dtype']} | {r['perplexity']:.4f} | "
            f"{r['identical_answers']}/{r['prompts']} | {r['first_difference_median']} | "
            f"{r['generate_tok_s']:.1f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
