"""Long-context quality of the KV policies (issue 17), over HTTP.

One server (``--kv-policy full``, so every request may narrow it with the
``kv_policy`` body extension) on a free loopback port; stopped afterwards.

* Perplexity: the first ``--text-tokens`` tokens of an English text
  (benchmarks/data/GPL-3.txt by default) sent to ``/v1/completions`` with
  ``echo`` and ``logprobs: 0``: the echoed prompt's logprobs give the
  perplexity of the text as the engine streams it through each
  configuration's cache (prefill in chunks of at most ``--kv-evict-interval``
  tokens once the cache is full, so every token is predicted from the window).
  Configurations alternate inside the run, ``--rounds`` times.
* Long generation: ``--gen-tokens`` tokens sampled (temperature 1, seeded)
  after a ``--gen-prompt-tokens`` prefix of the text under ``streaming`` with a
  ``--gen-budget``-token budget; perplexity of the generated tokens per 1,000,
  the server's RSS before/after and its KV-cache usage gauge at the end.

Usage (repository root, venv active)::

    python -m loadtest.long_context --output docs/benchmarks/long-context.json
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.compare import ours_spec, running_process
from loadtest.report import bench_record, write_json
from loadtest.rss import rss_bytes
from loadtest.workloads import default_gguf

ROOT = Path(__file__).resolve().parent.parent


def configs(n: int, window: int, sinks: int) -> list[tuple[str, dict[str, Any] | None]]:
    quarter = n // 4
    return [
        ("full", None),
        (
            f"streaming {window - sinks}+{sinks} sinks",
            {"type": "streaming", "budget_tokens": window, "sink_tokens": sinks},
        ),
        (
            f"sliding window {window}, no sinks",
            {"type": "streaming", "budget_tokens": window, "sink_tokens": 0},
        ),
        (
            f"streaming 25% ({quarter})",
            {"type": "streaming", "budget_tokens": quarter, "sink_tokens": sinks},
        ),
        (f"h2o 25% ({quarter})", {"type": "h2o", "budget_tokens": quarter, "sink_tokens": sinks}),
        (f"rkv 25% ({quarter})", {"type": "rkv", "budget_tokens": quarter, "sink_tokens": sinks}),
        (f"vote 25% ({quarter})", {"type": "vote", "budget_tokens": quarter, "sink_tokens": sinks}),
    ]


def perplexity(client: httpx.Client, ids: list[int], policy: dict[str, Any] | None) -> float:
    body: dict[str, Any] = {
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "echo": True,
        "logprobs": 0,
    }
    if policy is not None:
        body["kv_policy"] = policy
    r = client.post("/v1/completions", json=body)
    r.raise_for_status()
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]
    return math.exp(-sum(lps) / len(lps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=ROOT / "benchmarks/data/GPL-3.txt")
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=260, help="streaming budget (sinks included)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--gen-tokens", type=int, default=10000)
    ap.add_argument("--gen-budget", type=int, default=256)
    ap.add_argument("--gen-prompt-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="extra server flags (space-separated)")
    ap.add_argument("--output", type=Path, default=ROOT / "docs/benchmarks/long-context.json")
    a = ap.parse_args(argv)
    extra = ["--max-model-len", "8192", "--max-num-seqs", "4", *a.server_args.split()]
    spec = ours_spec(default_gguf(), extra)
    rows: dict[str, list[float]] = {}
    secs: dict[str, list[float]] = {}
    gen: dict[str, Any] = {}
    with running_process(spec, ROOT / "loadtest/results/long_context_server.log", 300) as (
        url,
        pid,
    ):
        client = httpx.Client(base_url=url, timeout=3600)
        text = a.text.read_text()
        ids = client.post("/tokenize", json={"prompt": text}).json()["tokens"][: a.text_tokens]
        if len(ids) < a.text_tokens:
            raise SystemExit(f"the text has only {len(ids)} tokens")
        for _ in range(a.rounds):
            for name, policy in configs(len(ids), a.window, a.sinks):
                t0 = time.perf_counter()
                rows.setdefault(name, []).append(perplexity(client, ids, policy))
                secs.setdefault(name, []).append(time.perf_counter() - t0)
                print(f"{name}: ppl {rows[name][-1]:.3f} ({secs[name][-1]:.1f} s)", flush=True)
        if a.gen_tokens:
            rss0 = rss_bytes(pid)
            t0 = time.perf_counter()
            r = client.post(
                "/v1/completions",
                json={
                    "prompt": ids[: a.gen_prompt_tokens],
                    "max_tokens": a.gen_tokens,
                    "temperature": 1.0,
                    "seed": 1,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "kv_policy": {
                        "type": "streaming",
                        "budget_tokens": a.gen_budget,
                        "sink_tokens": a.sinks,
                    },
                },
            )
            r.raise_for_status()
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            per_k = [
                math.exp(-sum(lps[i : i + 1000]) / len(lps[i : i + 1000]))
                for i in range(0, len(lps), 1000)
            ]
            metrics = client.get("/metrics").text
            usage = [
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("vllm:kv_cache_usage_perc")
            ]
            gen = {
                "tokens": len(lps),
                "seconds": time.perf_counter() - t0,
                "ppl_per_1000": per_k,
                "rss_before_bytes": rss0,
                "rss_after_bytes": rss_bytes(pid),
                "kv_cache_usage_after": usage[0] if usage else None,
            }
            print(f"generation: {len(lps)} tokens, ppl per 1000: {[round(p, 2) for p in per_k]}")
    full = rows["full"][0]
    table = {
        k: {"ppl": v, "ratio_to_full": [x / full for x in v], "seconds": secs[k]}
        for k, v in rows.items()
    }
    write_json(
        a.output, bench_record("long_context", a, {"output"}, perplexity=table, generation=gen)
    )
    for k, v in table.items():
        print(f"| {k} | {v['ppl'][0]:.3f} | {v['ratio_to_full'][0]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
