"""A small random Mixture-of-Experts model against a dense one with the same active parameters.

Two random checkpoints are written to a temporary directory: a Mixtral-style
MoE (``E`` experts of width ``I``, top-``k``) and a Mistral-style dense model
whose MLP has width ``k * I``, so both compute the same number of MLP
multiply-adds per token (the router's ``E x H`` aside); attention, norms,
vocabulary and depth are identical. Both run in this process through the
whole engine (exact mode: float32, oneDNN-packed linears, float32 KV).

1. Decode step time and output tokens/s at each ``--streams`` count, MoE and
   dense alternating per round (drift hits both); best of ``--rounds``.
2. Expert load under each ``--capacities`` setting (``none`` = no capacity),
   one engine each, stepped in turn: the same workload (``--load-streams``
   prompts, prefill then decode), and per step and MoE layer the max over mean
   token slots per expert, averaged separately over prefill and decode steps;
   the fraction of slots the capacity rerouted or dropped; the median decode
   step time.

Usage::

    python -m benchmarks.moe_bench
    python -m benchmarks.moe_bench --streams 1,16 --capacities none,1.0,1.25 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.loader import resolve_model_path
from engine.sampling.params import SamplingParams
from engine.stats import MoeLayerStats


def write_checkpoints(out: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """(MoE dir, dense dir): random weights, unit-scale rows (logits O(1))."""
    from transformers import AutoModelForCausalLM, MistralConfig, MixtralConfig

    common: dict[str, Any] = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        sliding_window=None,
        tie_word_embeddings=False,
    )
    moe_cfg = MixtralConfig(
        **common,
        intermediate_size=args.expert_size,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    dense_cfg = MistralConfig(**common, intermediate_size=args.top_k * args.expert_size)
    dirs = []
    for name, cfg in (("moe", moe_cfg), ("dense", dense_cfg)):
        gen = torch.Generator().manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.save_pretrained(str(out / name), safe_serialization=True)
        dirs.append(out / name)
    return dirs[0], dirs[1]


def make_engine(path: Path, capacity: float | None = None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            tokenizer=str(resolve_model_path(None)),
            cpu_linear="onednn",
            kv_cache_dtype="float32",
            kv_cache_memory=256 << 20,
            max_num_seqs=64,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
            moe_capacity_factor=capacity,
        )
    )


def _prompts(n: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    return [[3 + (salt + i * 131 + j * 17) % (vocab - 3) for j in range(length)] for i in range(n)]


def decode_step_ms(eng: LLMEngine, streams: int, steps: int, prompt_len: int, salt: int) -> float:
    """Wall ms per decode step with ``streams`` running sequences (prefill excluded)."""
    vocab = eng.model_config.vocab_size
    for i, p in enumerate(_prompts(streams, prompt_len, vocab, salt)):
        eng.add_request(
            f"s{salt}-{i}",
            p,
            SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True),
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or (
        eng.scheduler.waiting
    ):
        eng.step()
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    ms = (time.perf_counter() - t0) / steps * 1000
    for gid in list(eng.groups):
        eng.abort(gid)
    return ms


def _imbalance(prev: tuple[MoeLayerStats, ...], cur: tuple[MoeLayerStats, ...]) -> list[float]:
    """Per MoE layer: max over mean slots per expert in the step between ``prev`` and ``cur``."""
    out = []
    for a, b in zip(prev, cur):
        delta = [y - x for x, y in zip(a.expert_tokens, b.expert_tokens)]
        total = sum(delta)
        if total:
            out.append(max(delta) * len(delta) / total)
    return out


def expert_loads(
    engines: dict[str, LLMEngine], streams: int, prompt_len: int, gen: int
) -> dict[str, dict[str, float]]:
    """Run the same ``streams`` requests on every engine, one step each in turn (drift
    hits all); load statistics per engine and step kind (prefill or decode)."""
    state: dict[str, dict[str, Any]] = {}
    for name, eng in engines.items():
        vocab = eng.model_config.vocab_size
        for i, p in enumerate(_prompts(streams, prompt_len, vocab, 7)):
            eng.add_request(
                f"load-{i}", p, SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
            )
        model: Any = eng.model
        state[name] = {"prev": model.routing_stats(), "prefill": [], "decode": [], "ms": []}
    while any(eng.has_unfinished() for eng in engines.values()):
        for name, eng in engines.items():
            if not eng.has_unfinished():
                continue
            st = state[name]
            is_decode = not eng.scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in eng.scheduler.running
            )
            t0 = time.perf_counter()
            eng.step()
            dt = (time.perf_counter() - t0) * 1000
            cur = eng.stats.moe_layers
            st["decode" if is_decode else "prefill"].extend(_imbalance(st["prev"], cur))
            if is_decode:
                st["ms"].append(dt)
            st["prev"] = cur
    out = {}
    for name, eng in engines.items():
        st = state[name]
        layers = eng.stats.moe_layers
        slots = sum(sum(x.expert_tokens) + x.dropped_tokens for x in layers)
        out[name] = {
            "prefill_max_over_mean": sum(st["prefill"]) / max(1, len(st["prefill"])),
            "decode_max_over_mean": sum(st["decode"]) / max(1, len(st["decode"])),
            "rerouted_frac": sum(x.rerouted_tokens for x in layers) / slots,
            "dropped_frac": sum(x.dropped_tokens for x in layers) / slots,
            "decode_step_ms": sorted(st["ms"])[len(st["ms"]) // 2],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacities", default="none,1.0,1.25")
    ap.add_argument("--load-streams", type=int, default=16)
    ap.add_argument("--load-gen", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    caps = [None if c == "none" else float(c) for c in args.capacities.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, dense_dir = write_checkpoints(Path(tmp), args)
        engines = {"moe": make_engine(moe_dir), "dense": make_engine(dense_dir)}
        times: dict[tuple[int, str], list[float]] = {(s, n): [] for s in streams for n in engines}
        salt = 0
        for _ in range(args.rounds):
            for s in streams:
                for name, eng in engines.items():  # alternate: drift hits both
                    salt += 1
                    times[(s, name)].append(
                        decode_step_ms(eng, s, args.steps, args.prompt_len, salt)
                    )
        load_engines = {
            "none" if cap is None else f"{cap:g}": make_engine(moe_dir, cap) for cap in caps
        }
        loads = expert_loads(load_engines, args.load_streams, args.prompt_len, args.load_gen)
    print(f"threads={torch.get_num_threads()} {vars(args)}")
    print("| streams | MoE step ms | dense step ms | MoE/dense | MoE tok/s | dense tok/s |")
    print("|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    for s in streams:
        m, d = min(times[(s, "moe")]), min(times[(s, "dense")])
        rows.append({"streams": s, "moe_ms": m, "dense_ms": d})
        print(f"| {s} | {m:.2f} | {d:.2f} | {m / d:.2f} | {s / m * 1e3:.0f} | {s / d * 1e3:.0f} |")
    print()
    print("| capacity | prefill max/mean | decode max/mean | rerouted | dropped | decode step ms |")
    print("|---|---|---|---|---|---|")
    for name, v in loads.items():
        print(
            f"| {name} | {v['prefill_max_over_mean']:.2f} | {v['decode_max_over_mean']:.2f} "
            f"| {v['rerouted_frac']:.1%} | {v['dropped_frac']:.1%} | {v['decode_step_ms']:.2f} |"
        )
    print(json.dumps({"decode": rows, "load": loads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
