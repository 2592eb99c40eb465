"""Where one stream's decode step goes on the CPU: a per-step profile.

In process, for each engine configuration (``--configs``, default: the
defaults with the fused native decode step, then the same with
``--cpu-decode-step per_layer``), one sequence decodes ``--steps`` tokens
after a short chat prompt while wrappers time each part of
``LLMEngine.step``: scheduling, batch building (``ModelRunner.prepare``), the
forward, the logits projection, sampling, and the output processing
(``process_token``: token stops and incremental detokenizing); the rest of
the step is the engine's Python glue. For the per-layer forward the linears,
the attention backend and the small ops are timed too; what remains of the
forward is Python and dispatch overhead, reported per layer. The wrappers
themselves cost ~0.3 us per timed call (the per-layer path has ~10 per layer).

With ``--http``, the same defaults then serve over HTTP (a server on a free
loopback port started here, the default flags) and ``--http-requests``
streaming chat requests run one at a time; the median inter-token gap over
HTTP minus the in-process step time is what HTTP, SSE framing, the event
loop and the thread hand-off add per token. Configurations alternate across
``--rounds``; medians are reported. Usage::

    python -m benchmarks.cpu_step_profile --steps 64 --rounds 3 --http
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.llm_engine as llm_engine_mod
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models.linear import BlockQuantLinear
from engine.sampling.params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper."


class Timers:
    """Accumulated seconds per part, reset every step."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.acc[name] += time.perf_counter() - t0
                self.calls[name] += 1

        return timed


def instrument(eng: LLMEngine, timers: Timers) -> None:
    """Wrap the parts of one engine's step (instance attributes, module function)."""
    sched = eng.scheduler
    sched.schedule = timers.wrap("schedule", sched.schedule)  # type: ignore[method-assign]
    runner = eng.runner
    runner.prepare = timers.wrap("prepare", runner.prepare)  # type: ignore[method-assign]
    model = runner.model
    model.compute_logits = timers.wrap("logits", model.compute_logits)
    if runner.native_step is not None:
        step = runner.native_step
        step.run = timers.wrap("forward", step.run)  # type: ignore[method-assign]
    else:
        model.forward = timers.wrap("forward", model.forward)
        for m in model.model.modules():
            if isinstance(m, BlockQuantLinear):
                m.forward = timers.wrap("linears", m.forward)  # type: ignore[method-assign]
        layer0 = model.model.layers[0]
        backend = layer0.self_attn.attn_backend
        backend.forward = timers.wrap("attention", backend.forward)  # type: ignore[method-assign]
        ops = layer0.self_attn.ops
        for name in ("add_rms_norm", "rope", "silu_mul"):
            setattr(ops, name, timers.wrap("small ops", getattr(ops, name)))

    sampler = runner.sampler

    class TimedSampler:
        def __call__(self, *a: Any, **k: Any) -> Any:
            return timers.wrap("sampling", sampler)(*a, **k)

    runner.sampler = TimedSampler()  # type: ignore[assignment]


def profile(eng: LLMEngine, timers: Timers, steps: int) -> dict[str, float]:
    """Median ms per decode step of each part, one sequence (``eng`` instrumented
    with ``timers``)."""
    ids = eng.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    eng.add_request(
        f"p{time.monotonic_ns()}",
        ids,
        SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True),
    )
    eng.step()  # the prefill
    eng.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    # The step calls the module-level name: swap it there (restored below).
    names = vars(llm_engine_mod)
    original = names["process_token"]
    names["process_token"] = timers.wrap("output processing", original)
    try:
        for _ in range(steps):
            timers.acc.clear()
            t0 = time.perf_counter()
            eng.step()
            total = time.perf_counter() - t0
            parts = dict(timers.acc)
            per_step["step"].append(total * 1e3)
            inner = sum(v for k, v in parts.items() if k in ("linears", "attention", "small ops"))
            for k, v in parts.items():
                per_step[k].append(v * 1e3)
            if "linears" in parts:
                per_step["forward: python + dispatch"].append((parts["forward"] - inner) * 1e3)
            top = ("schedule", "prepare", "forward", "logits", "sampling", "output processing")
            per_step["engine glue"].append((total - sum(parts.get(k, 0.0) for k in top)) * 1e3)
    finally:
        names["process_token"] = original
    for gid in list(eng.groups):
        eng.abort(gid)
    return {k: statistics.median(v) for k, v in per_step.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_itl(requests: int, max_tokens: int, server_args: list[str]) -> dict[str, float]:
    """Median inter-token gap (ms) of one stream over HTTP, default flags."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "server.cli", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, *server_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        with httpx.Client(timeout=600, trust_env=False) as client:
            while True:
                try:
                    if client.get(f"{base}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the server did not become ready")
                time.sleep(0.5)
            gaps: list[float] = []
            body = {
                "model": client.get(f"{base}/v1/models").json()["data"][0]["id"],
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            for i in range(requests + 1):  # the first warms up
                stamps: list[float] = []
                with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"content"' in line:
                            stamps.append(time.perf_counter())
                if i:
                    gaps += [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    gaps.sort()
    return {"itl_p50_ms": statistics.median(gaps), "itl_p99_ms": gaps[int(0.99 * (len(gaps) - 1))]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--configs",
        default="auto,per_layer",
        help="--cpu-decode-step values to profile, one engine each (defaults otherwise)",
    )
    ap.add_argument("--http", action="store_true", help="also measure one stream over HTTP")
    ap.add_argument("--http-requests", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    engines = {
        c: LLMEngine(EngineConfig(cpu_decode_step=c, kv_cache_memory=256 << 20))
        for c in args.configs.split(",")
    }
    timers = {c: Timers() for c in engines}
    for c, eng in engines.items():
        instrument(eng, timers[c])
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in engines}
    for _ in range(args.rounds):
        for c, eng in engines.items():  # alternating: drift hits every configuration
            runs[c].append(profile(eng, timers[c], args.steps))
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()} steps={args.steps}")
    for c, eng in engines.items():
        print(f"\n{c}: {eng.describe()}")
        keys = list(runs[c][0])
        med = {k: statistics.median(r[k] for r in runs[c]) for k in keys}
        layers = eng.model_config.num_hidden_layers
        print("| part | ms per step |\n|---|---|")
        for k in keys:
            extra = f" ({med[k] / layers * 1e3:.0f} us per layer)" if "dispatch" in k else ""
            print(f"| {k} | {med[k]:.3f}{extra} |")
    result: dict[str, Any] = {"runs": runs}
    if args.http:
        del engines
        result["http"] = http_itl(args.http_requests, args.steps, [])
        print(f"\nHTTP, default flags, one stream: {result['http']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
