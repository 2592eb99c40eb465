"""KV compression (issue 16): quality, capacity, memory and long-context decode per KV format.

For each ``--configs`` KV cache dtype (the first, float32, is the reference),
on the default model with ``--linear`` linears and one block size for all:

- perplexity of the first ``--text-tokens`` tokens of benchmarks/data/GPL-3.txt
  in windows of ``--window`` tokens, from prompt logprobs (``echo`` +
  ``logprobs`` in the API), prefill chunks of ``--chunk`` tokens, so most
  attention reads stored (quantized) KV;
- greedy agreement with the reference over ``--max-tokens`` tokens on the
  standard prompts (loadtest/data/questions.txt, chat template), batched;
- KV capacity at the same ``--kv-cache-memory``: blocks, tokens, bytes per token,
  and the ratio of tokens to float32's;
- resident set size right after start-up (a fresh subprocess per format);
- decode tok/s of one sequence at ``--decode-context`` tokens of context, with
  ``--speed-linear`` linears, the formats alternated ``--repeats`` times in one
  run (the median is reported; the machine is shared, so compare ratios).

Usage::

    python -m benchmarks.kv_compression --json /tmp/kv.json
    python -m benchmarks.kv_compression --render /tmp/kv.json   # the tables again
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_quality import QUESTIONS, TEXT, first_difference, greedy_answers, perplexity
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling.params import SamplingParams


def engine_for(spec: str, linear: str, args: argparse.Namespace, **kw: Any) -> LLMEngine:
    """``spec``: a KV cache dtype, then optionally ``/per_layer`` (decode steps
    layer by layer), ``/gN`` (KIVI group size N instead of ``--group-size`` or
    the format's default), ``/rN`` (float16 window of N tokens) and ``/sN``
    (N sink tokens): e.g. ``kivi2/g32/r32/s0``; ``/kN`` stores keys at rank N
    (``--kv-low-rank-keys N``): e.g. ``float16/k32``."""
    kv, *opts = spec.split("/")
    knobs = {
        "g": "kivi_group_size",
        "r": "kivi_residual_length",
        "s": "kivi_sink_tokens",
        "k": "kv_low_rank_keys",
    }
    if args.group_size is not None:
        kw["kivi_group_size"] = args.group_size
    for o in opts:
        if o[:1] in knobs and o[1:].isdigit():
            kw[knobs[o[:1]]] = int(o[1:])
        else:
            kw["cpu_decode_step"] = o
    return LLMEngine(
        EngineConfig(
            cpu_linear=linear,  # type: ignore[arg-type]
            kv_cache_dtype=kv,  # type: ignore[arg-type]
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=64,
            **kw,
        )
    )


def window_of(eng: LLMEngine) -> str:
    """A KIVI engine's (group, float16 window, sinks), or a low-rank engine's key
    rank and the calibration keys' energy it keeps, as the table states it."""
    cfg = eng.config
    if eng.key_basis is not None:
        b = eng.key_basis
        return f"keys rank {b.rank}/{b.head_dim} ({100 * b.kept_energy():.1f}% score variance)"
    if not cfg.kv_cache_dtype.startswith("kivi"):
        return "-"
    g, ring, sink = cfg.kivi_window
    return f"G{g}, window {ring * g}, sinks {g if sink else 0}"


def rss_after_start(kv: str, args: argparse.Namespace) -> float:
    """MiB resident right after building an engine of ``kv`` in a fresh process."""
    code = (
        "import sys, benchmarks.kv_compression as b; "
        "a = b.parse(sys.argv[1:]); e = b.engine_for(a.rss_kv, a.linear, a); "
        "print([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *sys.argv[1:], "--rss-kv", kv],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip().splitlines()[-1]) / 1024


def decode_tok_s(eng: LLMEngine, ids: list[int], n: int, tag: str) -> float:
    """Output tok/s after the first token of one greedy request over ``ids``."""
    eng.add_request(tag, ids, SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True))
    first: float | None = None
    got = 0
    while eng.has_unfinished():
        for _, out in eng.step():
            got += sum(len(d.delta_token_ids) for d in out.outputs)
            if first is None and got:
                first = time.perf_counter()
    assert first is not None and got == n + 1, got
    return n / (time.perf_counter() - first)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--configs", default="float32,float16,kivi4,kivi2,kivi2/g32/r32/s0")
    ap.add_argument(
        "--speed-configs",
        default="float16,float16/per_layer,kivi4,kivi2",
        help="decode runs (KV dtype[/per_layer])",
    )
    ap.add_argument("--linear", default="onednn", help="linears of the quality runs")
    ap.add_argument("--speed-linear", default="auto", help="linears of the decode runs")
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--group-size", type=int, default=None, help="default: each format's")
    ap.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--text-tokens", type=int, default=2560)
    ap.add_argument("--window", type=int, default=2560)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decode-context", type=int, default=4000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--rss-kv", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def quality(kvs: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    ref: list[list[int]] = []
    for kv in kvs:
        eng = engine_for(kv, args.linear, args, max_num_batched_tokens=args.chunk)
        text_ids = eng.tokenizer.encode(TEXT.read_text())[: args.text_tokens]
        questions = [q.strip() for q in QUESTIONS.read_text().splitlines() if q.strip()]
        prompts = [
            eng.tokenizer.apply_chat_template([{"role": "user", "content": q}])
            for q in questions[: args.num_prompts]
        ]
        t0 = time.perf_counter()
        ppl = perplexity(eng, text_ids, args.window)
        answers, _ = greedy_answers(eng, prompts, args.max_tokens, alone=False)
        if not ref:
            ref = answers
        diffs = [first_difference(a, r) for a, r in zip(answers, ref)]
        agree = [
            sum(x == y for x, y in zip(a[: args.max_tokens], r[: args.max_tokens]))
            / max(1, len(r[: args.max_tokens]))
            for a, r in zip(answers, ref)
        ]
        i = eng.info
        row = {
            "kv": kv,
            "window": window_of(eng),
            "perplexity": ppl,
            "text_tokens": len(text_ids),
            "identical_answers": sum(d is None for d in diffs),
            "prompts": len(prompts),
            "token_agreement": statistics.fmean(agree),
            "kv_blocks": i.num_blocks,
            "kv_tokens": i.num_blocks * i.block_size,
            "kv_bytes_per_token": i.kv_bytes_per_token,
            "seconds": time.perf_counter() - t0,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eng
    return rows


def speed(kvs: list[str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engines = {
        kv: engine_for(kv, args.speed_linear, args, max_num_batched_tokens=2048) for kv in kvs
    }
    for kv, eng in engines.items():
        print(kv, eng.info.execution(), flush=True)
    first = next(iter(engines.values()))
    ids = first.tokenizer.encode(TEXT.read_text() * 2)[: args.decode_context]
    runs: dict[str, list[float]] = {kv: [] for kv in kvs}
    for r in range(args.repeats):
        for kv, eng in engines.items():  # alternated: the load changes under us
            runs[kv].append(decode_tok_s(eng, ids, args.decode_tokens, f"d{r}"))
        print({kv: round(v[-1], 2) for kv, v in runs.items()}, os.getloadavg(), flush=True)
    return {
        kv: {"median": statistics.median(v), "runs": v, "decode_step": engines[kv].info.decode_step}  # type: ignore[dict-item]
        for kv, v in runs.items()
    }


def render(result: dict[str, Any]) -> str:
    """The markdown tables of a result (``--render JSON`` prints them)."""
    rows = result["quality"]
    ref = rows[0] if rows else None
    lines = [
        "| KV format | KIVI window / key rank | perplexity | vs float32 | identical greedy answers "
        "| token agreement | KV bytes/token | KV tokens | capacity vs float32 "
        "| RSS at start-up (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        assert ref is not None
        lines.append(
            f"| {r['kv']} | {r.get('window', '-')} | {r['perplexity']:.3f} | {100 * (r['perplexity'] / ref['perplexity'] - 1):+.2f}% "
            f"| {r['identical_answers']}/{r['prompts']} | {100 * r['token_agreement']:.1f}% "
            f"| {r['kv_bytes_per_token']:.0f} | {r['kv_tokens']} "
            f"| {r['kv_tokens'] / ref['kv_tokens']:.2f}x | {result['rss_mib'].get(r['kv'], 0):.0f} |"
        )
    sp = result["speed"]
    if not sp:
        return "\n".join(lines)
    base = next(iter(sp.values()))["median"]
    lines += [
        "",
        "| KV format (decode path) | decode tok/s, median | runs | vs first |",
        "|---|---|---|---|",
    ]
    for kv, v in sp.items():
        runs = ", ".join(f"{x:.2f}" for x in v["runs"])
        lines.append(
            f"| {kv} ({v['decode_step']}) | {v['median']:.2f} | {runs} | {v['median'] / base:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--render":
        print(render(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    args = parse(argv)
    kvs = args.configs.split(",")
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()}", flush=True)
    rss = {kv: rss_after_start(kv, args) for kv in kvs}
    print("rss MiB", rss, flush=True)
    rows = [] if args.skip_quality else quality(kvs, args)
    load_mid = os.getloadavg()
    sp = {} if args.skip_speed else speed(args.speed_configs.split(","), args)
    result = {
        "args": vars(args) | {"json": str(args.json)},
        "quality": rows,
        "rss_mib": rss,
        "speed": sp,
        "load_after_quality": load_mid,
        "load_end": os.getloadavg(),
    }
    print(json.dumps(result, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
