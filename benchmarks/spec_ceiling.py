"""How far speculation can go on the grounded workload: tokens per step, and
the output tok/s it would reach if verification were free.

In-process (no HTTP), default flags, greedy, the bundled input-grounded tasks
(loadtest/data/grounded.txt, chat template), one request at a time, each
``--max-tokens`` long, for each ``--configs`` entry (``off`` or a
``--speculative-config`` JSON). For every configuration: output tokens,
engine steps after the first token, time to first token and decode time, so
output tok/s counts the prompt as the HTTP benchmark's does.

The ceiling: a speculative step that cost no more than a plain decode step
(``off``'s decode time per step) would take ``ttft + steps x plain step``;
output tok/s over that, against ``off``'s, bounds what any verification
speed-up can give at this acceptance. Reaching more needs more tokens per
step (drafts the model accepts), not cheaper verification.

    python -m benchmarks.spec_ceiling --configs off \\
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams
from loadtest.workloads import load_grounded_tasks


@dataclass
class Totals:
    tokens: int = 0
    steps: int = 0  # steps after each request's first token
    ttft: float = 0.0
    decode: float = 0.0

    @property
    def tok_s(self) -> float:
        return self.tokens / (self.ttft + self.decode)


def run_one(eng: LLMEngine, prompt: list[int], rid: str, max_tokens: int, t: Totals) -> None:
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    t0 = time.perf_counter()
    first: float | None = None
    n = 0
    while eng.has_unfinished():
        for _, out in eng.step():
            n += sum(len(d.delta_token_ids) for d in out.outputs)
        if first is None and n:
            first = time.perf_counter()
        elif first is not None:
            t.steps += 1
    assert first is not None
    t.tokens += n
    t.ttft += first - t0
    t.decode += time.perf_counter() - first


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["off"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the tasks per config")
    args = ap.parse_args(argv)
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()}", flush=True)
    tasks = load_grounded_tasks()
    results: dict[str, Totals] = {}
    for cfg in args.configs:
        spec: dict[str, Any] | None = None if cfg == "off" else json.loads(cfg)
        eng = LLMEngine(EngineConfig(speculative_config=spec))
        prompts = [
            eng.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in tasks
        ]
        run_one(eng, prompts[0], "warm-up", args.max_tokens, Totals())
        tot = Totals()
        for r in range(args.repeats):
            for i, p in enumerate(prompts):
                run_one(eng, p, f"r{r}-{i}", args.max_tokens, tot)
        results[cfg] = tot
        print(json.dumps({"config": cfg, **vars(tot), "tok_s": tot.tok_s}), flush=True)
        del eng
    print(f"load={os.getloadavg()}")
    off = results.get("off")
    print(
        "| config | output tokens | tokens / step | TTFT total (s) | decode (s) | output tok/s "
        "| vs off | ceiling (free verification) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for cfg, t in results.items():
        per_step = t.tokens / max(1, t.steps + len(tasks) * args.repeats)
        vs = f"{t.tok_s / off.tok_s:.2f}x" if off else "-"
        ceiling = "-"
        if off is not None and cfg != "off":
            plain_step = off.decode / max(1, off.steps)
            ceiling_tok_s = t.tokens / (t.ttft + t.steps * plain_step)
            ceiling = f"{ceiling_tok_s:.1f} tok/s ({ceiling_tok_s / off.tok_s:.2f}x)"
        name = cfg if len(cfg) < 60 else cfg[:57] + "..."
        print(
            f"| {name} | {t.tokens} | {per_step:.2f} | {t.ttft:.2f} | {t.decode:.2f} "
            f"| {t.tok_s:.1f} | {vs} | {ceiling} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
