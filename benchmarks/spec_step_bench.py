"""What verification costs: a step of B sequences each verifying k drafts, against plain decode.

For each batch size B and draft count k, one target step where every
sequence (``--context`` cached tokens) computes its last token plus k drafts,
timed best of ``--rounds`` (configurations alternate inside each round, so
drift on a shared machine hits all alike). From ``T(B, k) / T(B, 0)`` follows
the break-even acceptance: with per-draft acceptance ``a``, k drafts yield
``1 + a + ... + a^k`` tokens per sequence per step, so speculation pays iff
that exceeds ``T(B, k) / T(B, 0)``; where no ``a < 1`` does, speculation cannot
pay at that batch size (the crossover the adaptive rule finds by itself).

``--min-rows`` compares oneDNN thresholds of the float32 linears
(engine/models/linear.py ``PackedLinear``): rows below it use torch's default
GEMM, rows from it the prepacked oneDNN kernel. Usage::

    python -m benchmarks.spec_step_bench --batches 1,4,16 --drafts 0,1,2,4 --min-rows 8,2
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.linear import PackedLinear
from engine.request import Request
from engine.sampling.params import SamplingParams
from engine.scheduler import ScheduledRequest


def chunks(batch: int, k: int, context: int, block_size: int) -> list[ScheduledRequest]:
    out = []
    per = -(-(context + 1 + k) // block_size)
    for i in range(batch):
        req = Request(
            f"b{i}",
            "bench",
            0,
            [100 + (7 * j + i) % 1000 for j in range(context + 1)],
            SamplingParams(temperature=0.0),
        )
        req.output_token_ids = [req.all_token_ids[-1]]
        req.block_ids = list(range(i * per, (i + 1) * per))
        s = ScheduledRequest(req, 1, context)
        if k:
            s.num_lookahead_slots = k
            s.num_new_tokens += k
            s.num_draft_tokens = k
            s.set_drafts([101 + j for j in range(k)])
        out.append(s)
    return out


def break_even(ratio: float, k: int) -> float | None:
    """The per-draft acceptance a with 1 + a + ... + a^k == ratio (None: none below 1)."""
    if k == 0 or ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < ratio:
            lo = mid
        else:
            hi = mid
    return hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--drafts", default="0,1,2,4")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-rows", default="8", help="oneDNN row thresholds to compare")
    ap.add_argument(
        "--cpu-linear", default="onednn", help="onednn (with --min-rows), or torch, q4_1, ..."
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    a = ap.parse_args(argv)
    batches = [int(x) for x in a.batches.split(",")]
    drafts = [int(x) for x in a.drafts.split(",")]
    engines: dict[str, LLMEngine] = {}
    for mr in a.min_rows.split(","):
        linear: Any = a.cpu_linear
        eng = LLMEngine(
            EngineConfig(
                kv_cache_memory=512 << 20,
                cpu_linear=linear,
                max_num_seqs=64,
                num_threads=a.threads,
            )
        )
        if a.cpu_linear == "onednn":
            # The threshold each prepacked linear switches to oneDNN at.
            for m in eng.model.modules():
                if isinstance(m, PackedLinear):
                    m.min_rows = int(mr)
        engines[f"min_rows={mr}" if a.cpu_linear == "onednn" else a.cpu_linear] = eng
    best: dict[tuple[str, int, int], float] = {}
    for _ in range(a.rounds):
        for b in batches:
            for k in drafts:
                for name, eng in engines.items():
                    batch = chunks(b, k, a.context, eng.kv.block_size)
                    eng.runner.execute(batch)  # warm
                    t0 = time.perf_counter()
                    eng.runner.execute(batch)
                    dt = time.perf_counter() - t0
                    key = (name, b, k)
                    best[key] = min(best.get(key, float("inf")), dt)
    print(
        f"context {a.context} tokens, best of {a.rounds}, torch threads {torch.get_num_threads()}"
    )
    print("| linears | batch | drafts | step ms | vs no drafts | break-even acceptance |")
    print("|---|---|---|---|---|---|")
    for name in engines:
        for b in batches:
            for k in drafts:
                t = best[(name, b, k)]
                r = t / best[(name, b, 0)] if 0 in drafts else float("nan")
                be = break_even(r, k)
                be_s = "-" if k == 0 else ("never" if be is None else f"{be:.2f}")
                print(f"| {name} | {b} | {k} | {t * 1e3:.1f} | {r:.2f}x | {be_s} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
