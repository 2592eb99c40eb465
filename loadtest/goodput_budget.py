"""Goodput under overload: latency budgets + EDF admission vs plain FCFS, same load.

Open loop: ``--num-requests`` chat requests arrive as a Poisson process of rate
``--rate`` (above capacity), each with ``max_tokens`` drawn from
``--max-tokens-choices`` (ignore_eos) and a latency budget drawn from
``--budgets-ms`` (the same seeded draws for every configuration). A request
*meets its budget* when it completes (HTTP 200, full stream) within its budget,
measured at the client from send to ``[DONE]``. Goodput = requests meeting
their budget / run duration (first send -> last response).

Configurations (each started here on a free port, stopped afterwards):

* ``edf-budgets``: the default priority policy; every request carries its
  ``latency_budget_ms``, so admission rejects (429) what the predictor says
  cannot make it and the queue runs earliest deadline first.
* ``fcfs``: ``--scheduling-policy fcfs``; the budgets are not sent (only used
  to score).

After each run the script reads ``/debug/engine`` for the latency predictor's
error (``predictor_*``) and the engine-side budget-miss count.

Usage (from the repository root, venv active)::

    python -m loadtest.goodput_budget --output loadtest/results/goodput_budget.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.compare import ours_spec, running
from loadtest.metrics import percentile
from loadtest.report import bench_record, write_json
from loadtest.runner import gamma_intervals
from loadtest.workloads import default_gguf, load_questions


@dataclass
class Planned:
    """One request of the load: when it is sent (offset from start) and what it asks."""

    offset_s: float
    question: str
    max_tokens: int
    budget_ms: float


@dataclass
class Result:
    status: int  # HTTP status; 0 for a transport failure or a broken stream
    latency_s: float
    budget_ms: float
    error_code: str | None = None

    @property
    def met(self) -> bool:
        return self.status == 200 and self.latency_s * 1000 <= self.budget_ms


def plan_load(a: argparse.Namespace) -> list[Planned]:
    """The seeded arrival times, prompts, lengths and budgets (same for every config)."""
    rng = random.Random(a.seed)
    gaps = gamma_intervals(a.num_requests, a.rate, 1.0, a.seed)
    questions = load_questions()
    out = []
    t = 0.0
    for gap in gaps:
        t += gap
        out.append(
            Planned(
                offset_s=t,
                question=rng.choice(questions),
                max_tokens=rng.choice(a.max_tokens_choices),
                budget_ms=rng.choice(a.budgets_ms),
            )
        )
    return out


async def _send(client: httpx.AsyncClient, model: str, p: Planned, send_budget: bool) -> Result:
    payload: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": p.question}],
        "max_tokens": p.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    if send_budget:
        payload["latency_budget_ms"] = p.budget_ms
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                await r.aread()
                code = r.json().get("error", {}).get("code")
                return Result(r.status_code, time.perf_counter() - t0, p.budget_ms, code)
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"error"' in line:
                    return Result(0, time.perf_counter() - t0, p.budget_ms, "stream_error")
            return Result(200 if done else 0, time.perf_counter() - t0, p.budget_ms)
    except httpx.HTTPError as e:
        return Result(0, time.perf_counter() - t0, p.budget_ms, type(e).__name__)


async def run_load(
    base: str, model: str, load: Sequence[Planned], send_budget: bool, max_duration_s: float
) -> tuple[list[Result], float]:
    """Send ``load`` open loop; returns the results and the run duration."""
    limits = httpx.Limits(max_connections=len(load) + 4)
    async with httpx.AsyncClient(base_url=base, timeout=max_duration_s, limits=limits) as client:
        start = time.perf_counter()

        async def at(p: Planned) -> Result:
            await asyncio.sleep(max(0.0, start + p.offset_s - time.perf_counter()))
            return await _send(client, model, p, send_budget)

        tasks = [asyncio.create_task(at(p)) for p in load]
        await asyncio.wait(tasks, timeout=max_duration_s)
        results = []
        for task, p in zip(tasks, load, strict=True):
            if task.done():
                results.append(task.result())
            else:
                # Bounded run: whatever is still in flight at the deadline missed its budget.
                task.cancel()
                results.append(Result(0, max_duration_s - p.offset_s, p.budget_ms, "deadline"))
        await asyncio.gather(*tasks, return_exceptions=True)
        return results, min(time.perf_counter() - start, max_duration_s)


def summarize(results: Sequence[Result], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200]
    met = [r for r in results if r.met]
    statuses: dict[str, int] = {}
    for r in results:
        key = str(r.status) + (f":{r.error_code}" if r.error_code else "")
        statuses[key] = statuses.get(key, 0) + 1
    lat = [r.latency_s for r in ok]
    return {
        "requests": len(results),
        "completed": len(ok),
        "met_budget": len(met),
        "duration_s": round(duration_s, 2),
        "goodput_rps": round(len(met) / duration_s, 3),
        "throughput_rps": round(len(ok) / duration_s, 3),
        "statuses": statuses,
        "completed_latency_p50_s": round(percentile(lat, 50), 2) if lat else None,
        "completed_latency_p99_s": round(percentile(lat, 99), 2) if lat else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=4.0, help="arrivals per second (Poisson)")
    p.add_argument("--num-requests", type=int, default=60)
    p.add_argument(
        "--max-tokens-choices", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64]
    )
    p.add_argument(
        "--budgets-ms",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[4000.0, 8000.0, 16000.0],
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-duration", type=float, default=300.0, help="per configuration, seconds")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra flag for both servers (repeatable, e.g. --server-arg=--max-num-seqs=8)",
    )
    p.add_argument("--output", type=Path)
    p.add_argument("--log-dir", type=Path, default=Path("loadtest/results/logs"))
    a = p.parse_args(argv)
    model = "smol"
    load = plan_load(a)
    configs: list[tuple[str, list[str], bool]] = [
        ("edf-budgets", ["--scheduling-policy", "priority"], True),
        ("fcfs", ["--scheduling-policy", "fcfs"], False),
    ]
    results: dict[str, Any] = {}
    for name, flags, send_budget in configs:
        extra = ["--served-model-name", model, "--enable-debug-endpoints", *a.server_arg, *flags]
        spec = ours_spec(default_gguf(), extra)
        with running(spec, a.log_dir / f"goodput-{name}.log", timeout_s=300) as base:
            # One unmeasured request first: it loads lazily built state and gives the
            # predictor measured step times instead of its priors.
            httpx.post(
                base + "/v1/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 8,
                },
                timeout=120,
            ).raise_for_status()
            res, duration = asyncio.run(run_load(base, model, load, send_budget, a.max_duration))
            engine = httpx.get(base + "/debug/engine", timeout=10).json()
        summary = summarize(res, duration)
        summary["server_flags"] = flags + a.server_arg
        summary["budgets_sent"] = send_budget
        summary["engine"] = {
            k: engine.get(k)
            for k in (
                "predictor_samples",
                "predictor_mean_abs_rel_error",
                "predictor_mean_rel_error",
                "latency_budget_misses",
                "rejections",
                "num_preemptions",
            )
        }
        results[name] = summary
        print(f"{name}: {json.dumps(summary)}", flush=True)
    record = bench_record(
        "goodput_budget", a, {"output", "log_dir"}, load=[asdict(x) for x in load], results=results
    )
    if a.output:
        write_json(a.output, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
