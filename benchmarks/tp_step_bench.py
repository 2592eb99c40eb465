"""Tensor parallelism on the CPU: TP=1 against TP=N step time, with the collectives' share.

Both engines live in this process and run alternately per round and batch
size, so the machine's drift hits both. A random Llama checkpoint (no hub:
``transformers`` writes it) with KV heads divisible by N is made once under
``--workdir``. Per configuration and batch size it reports the decode step
(wall ms, best of ``--rounds``), a cold prefill step, and on rank 0 the time
spent in the all-reduces (which includes waiting for the slower rank), the
plan broadcast (pickled command), and the logits exchange (hidden rows
broadcast + vocabulary gather). Threads: TP=1 gets every core, each TP rank
its share (``torch.set_num_threads`` is per process, so it is reset before
each configuration runs). Usage::

    python -m benchmarks.tp_step_bench --batches 1,8 --steps 8 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.loader import resolve_model_path
from engine.parallel.group import TPGroup
from engine.sampling.params import SamplingParams


def make_checkpoint(root: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / f"llama-h{hidden}-l{layers}-kv{kv_heads}"
    if (path / "config.json").is_file():
        return path
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class Timers:
    """Seconds spent in each TPGroup call on rank 0 (wraps the instance's methods)."""

    def __init__(self, group: TPGroup) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name, key in (
            ("all_reduce", "all_reduce"),
            ("send_command", "plan"),
            ("broadcast", "logits"),
            ("gather_columns", "logits"),
        ):
            setattr(group, name, self._timed(getattr(group, name), key))

    def _timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.spent[key] += time.perf_counter() - t0
                self.calls[key] += 1

        return run

    def reset(self) -> None:
        self.spent.clear()
        self.calls.clear()


def run_steps(
    eng: LLMEngine, batch: int, steps: int, prompt_len: int, tag: str, timers: Timers | None
) -> dict[str, float]:
    """Prefill ``batch`` prompts in one step, then time ``steps`` decode steps.

    Returns ms for the prefill step and per decode step, and (with ``timers``)
    rank 0's ms in each collective kind during them."""
    for i in range(batch):
        eng.add_request(
            f"{tag}-{i}-{time.monotonic_ns()}",
            [100 + (i * 7 + j * 13) % 40000 for j in range(prompt_len)],
            SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True),
        )
    out: dict[str, float] = {}
    if timers is not None:
        timers.reset()
    t0 = time.perf_counter()
    eng.step()  # the whole batch's prefill (max_num_batched_tokens fits it)
    out["prefill_ms"] = (time.perf_counter() - t0) * 1000
    if timers is not None:
        out.update({f"prefill_{k}_ms": v * 1000 for k, v in timers.spent.items()})
    eng.step()
    if timers is not None:
        timers.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    out["decode_ms"] = (time.perf_counter() - t0) / steps * 1000
    if timers is not None:
        out.update({f"decode_{k}_ms": v * 1000 / steps for k, v in timers.spent.items()})
    for gid in list(eng.groups):
        eng.abort(gid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/fuel-tp-bench")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-linear", default="onednn")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    ckpt = make_checkpoint(Path(args.workdir), args.hidden, args.layers, args.heads, args.kv_heads)
    cores = len(os.sched_getaffinity(0))
    base: dict[str, Any] = dict(
        model=str(ckpt),
        tokenizer=str(resolve_model_path(None)),  # the default model's (same vocabulary)
        cpu_linear=args.cpu_linear,
        kv_cache_dtype="float32",
        kv_cache_memory=256 << 20,
        max_num_batched_tokens=max(2048, args.prompt_len * 16),
        enable_prefix_caching=False,
    )
    one = LLMEngine(EngineConfig(**base))
    tp_engine = LLMEngine(EngineConfig(**base, tensor_parallel_size=args.tp))
    assert tp_engine.tp is not None
    timers = Timers(tp_engine.tp.group)
    tp = f"tp{args.tp}"
    # (label, engine, threads of this process): TP=1 on every core and on one
    # core (what each rank gets), so the cost of OpenMP sharing cores shows.
    configs = [("tp1", one, cores), ("tp1_1thread", one, 1), (tp, tp_engine, cores // args.tp)]
    batches = [int(b) for b in args.batches.split(",")]
    best: dict[tuple[str, int], dict[str, float]] = {}
    try:
        for rnd in range(args.rounds):
            for b in batches:
                for label, eng, threads in configs:
                    torch.set_num_threads(max(1, threads))
                    tag = f"r{rnd}b{b}{label}"
                    t = timers if eng is tp_engine else None
                    r = run_steps(eng, b, args.steps, args.prompt_len, tag, t)
                    key = (label, b)
                    if key not in best or r["decode_ms"] < best[key]["decode_ms"]:
                        best[key] = r
    finally:
        tp_engine.close()
    rows = []
    for b in batches:
        many = best[(tp, b)]
        row: dict[str, float] = {"batch": b, "prompt_len": args.prompt_len}
        for phase in ("decode", "prefill"):
            for label in ("tp1", "tp1_1thread", tp):
                row[f"{label}_{phase}_ms"] = round(best[(label, b)][f"{phase}_ms"], 2)
            for label in ("tp1", "tp1_1thread"):
                ratio = many[f"{phase}_ms"] / best[(label, b)][f"{phase}_ms"]
                row[f"{phase}_{tp}_over_{label}"] = round(ratio, 2)
            for kind in ("all_reduce", "plan", "logits"):
                v = many.get(f"{phase}_{kind}_ms", 0.0)
                row[f"{phase}_{kind}_ms"] = round(v, 3)
                row[f"{phase}_{kind}_share"] = round(v / many[f"{phase}_ms"], 3)
        rows.append(row)
    with open("/proc/loadavg") as f:
        load = f.read().strip()
    if args.json:
        print(json.dumps({"rows": rows, "loadavg": load, "cores": cores}))
        return
    print(f"cores {cores}; loadavg {load}; model {ckpt.name}; cpu_linear {args.cpu_linear}")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
