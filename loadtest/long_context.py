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
* Beyond the context: ``--long-text-tokens`` tokens of the ``--long-text``
  files joined (GPL-3, GFDL-1.3 and Apache-2.0 from Debian's common-licenses,
  copied into benchmarks/data/; 10,000 tokens exceed the default model's 8,192
  positions) streamed the same way through ``--gen-budget`` tokens with sinks
  and without, perplexity per 1,000 tokens; the full cache over the part that
  fits the context, for reference.
* Long generation: ``--gen-tokens`` tokens sampled (temperature 1, seed 1)
  after a ``--gen-prompt-tokens`` prefix of the text under ``streaming`` with a
  ``--gen-budget``-token budget (sinks included); beside it, in the same run, the
  same request under a sliding window without sinks (the contrast) and with
  the full cache (as far as the context allows). For each: the perplexity of
  the sampled tokens per 1,000 (at temperature 1 its log is the model's own
  entropy, so it measures how sure the model stays, not a text's fit), the
  most KV tokens the server held (``/get_load``'s usage, polled every 0.2 s,
  times the pool's tokens) and its RSS before and after.

Usage (repository root, venv active)::

    python -m loadtest.long_context --output docs/benchmarks/long-context.json
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.compare import ours_spec, running_process
from loadtest.prom import info_labels, scrape
from loadtest.report import bench_record, write_json
from loadtest.rss import rss_bytes
from loadtest.workloads import default_gguf

ROOT = Path(__file__).resolve().parent.parent


Policy = dict[str, Any] | None


def windows(budget: int, sinks: int, with_sinks: str) -> list[tuple[str, Policy]]:
    """``streaming`` over ``budget`` tokens with ``sinks`` sinks (named
    ``with_sinks``), and the same window without sinks: the contrast."""
    return [
        (with_sinks, {"type": "streaming", "budget_tokens": budget, "sink_tokens": sinks}),
        (
            f"sliding window {budget}, no sinks",
            {"type": "streaming", "budget_tokens": budget, "sink_tokens": 0},
        ),
    ]


def configs(n: int, window: int, sinks: int) -> list[tuple[str, Policy]]:
    quarter = n // 4
    return [
        ("full", None),
        *windows(window, sinks, f"streaming {window - sinks}+{sinks} sinks"),
        (
            f"streaming 25% ({quarter})",
            {"type": "streaming", "budget_tokens": quarter, "sink_tokens": sinks},
        ),
        (f"h2o 25% ({quarter})", {"type": "h2o", "budget_tokens": quarter, "sink_tokens": sinks}),
        (f"rkv 25% ({quarter})", {"type": "rkv", "budget_tokens": quarter, "sink_tokens": sinks}),
        (f"vote 25% ({quarter})", {"type": "vote", "budget_tokens": quarter, "sink_tokens": sinks}),
    ]


def echo_logprobs(client: httpx.Client, ids: list[int], policy: Policy) -> list[float]:
    """Logprobs of ``ids[1:]`` as the engine streams ``ids`` through ``policy``'s cache."""
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
    return [float(x) for x in r.json()["choices"][0]["logprobs"]["token_logprobs"][1 : len(ids)]]


def ppl(lps: list[float]) -> float:
    return math.exp(-sum(lps) / len(lps))


def per_thousand(lps: list[float]) -> list[float]:
    return [ppl(lps[i : i + 1000]) for i in range(0, len(lps), 1000)]


def long_text(
    client: httpx.Client, ids: list[int], budget: int, sinks: int, max_len: int
) -> dict[str, Any]:
    """A text longer than the context streamed through ``budget`` tokens with
    sinks and without, per 1,000 tokens; the full cache over the part that fits."""
    runs: list[tuple[str, Policy, list[int]]] = [
        *((name, p, ids) for name, p in windows(budget, sinks, _with_sinks(budget, sinks))),
        (f"full cache (first {min(len(ids), max_len - 1)} tokens)", None, ids[: max_len - 1]),
    ]
    out: dict[str, Any] = {}
    for name, policy, part in runs:
        t0 = time.perf_counter()
        lps = echo_logprobs(client, part, policy)
        out[name] = {
            "tokens": len(part),
            "ppl": ppl(lps),
            "ppl_per_1000": per_thousand(lps),
            "seconds": time.perf_counter() - t0,
        }
        print(
            f"long text ({name}): ppl {ppl(lps):.2f}, per 1000: "
            f"{[round(p, 2) for p in out[name]['ppl_per_1000']]}",
            flush=True,
        )
    return out


def _with_sinks(budget: int, sinks: int) -> str:
    return f"streaming, budget {budget} ({sinks} sinks)"


def pool_tokens(url: str) -> int:
    """The device pool's KV tokens, from vLLM's ``vllm:cache_config_info`` labels."""
    labels = info_labels(scrape(url), "vllm:cache_config_info")
    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])


def generate(
    client: httpx.Client, prompt: list[int], max_tokens: int, policy: Policy
) -> tuple[list[float], float, float]:
    """Sampled tokens' logprobs, seconds, and the peak KV usage fraction meanwhile."""
    peak = [0.0]
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=str(client.base_url), timeout=10) as c:
            while not done.wait(0.2):
                peak[0] = max(peak[0], float(c.get("/get_load").json()["kv_cache_usage_perc"]))

    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": 1,
        "ignore_eos": True,
        "logprobs": 0,
    }
    if policy is not None:
        body["kv_policy"] = policy
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.perf_counter()
    try:
        r = client.post("/v1/completions", json=body)
        r.raise_for_status()
    finally:
        done.set()
        poller.join()
    lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    return [float(x) for x in lps], time.perf_counter() - t0, peak[0]


def generations(
    client: httpx.Client,
    url: str,
    pid: int,
    prompt: list[int],
    max_len: int,
    a: argparse.Namespace,
) -> dict[str, Any]:
    """The long generation under sinks + window, its no-sink contrast, and full."""
    tokens = pool_tokens(url)
    budget, sinks = a.gen_budget, a.sinks
    runs: list[tuple[str, Policy, int]] = [
        *(
            (name, p, a.gen_tokens)
            for name, p in windows(budget, sinks, _with_sinks(budget, sinks))
        ),
        ("full cache", None, min(a.gen_tokens, max_len - len(prompt))),
    ]
    out: dict[str, Any] = {"pool_tokens": tokens, "runs": {}}
    for name, policy, n in runs:
        rss0 = rss_bytes(pid)
        lps, seconds, peak = generate(client, prompt, n, policy)
        per_k = per_thousand(lps)
        out["runs"][name] = {
            "tokens": len(lps),
            "seconds": seconds,
            "ppl_per_1000": per_k,
            "peak_kv_tokens": round(peak * tokens),
            "rss_before_bytes": rss0,
            "rss_after_bytes": rss_bytes(pid),
        }
        print(
            f"generation ({name}): {len(lps)} tokens in {seconds:.1f} s, peak KV "
            f"{round(peak * tokens)} tokens, ppl per 1000: {[round(p, 2) for p in per_k]}",
            flush=True,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=ROOT / "benchmarks/data/GPL-3.txt")
    ap.add_argument("--text-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=260, help="streaming budget (sinks included)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--long-text",
        type=Path,
        nargs="+",
        default=[ROOT / f"benchmarks/data/{n}.txt" for n in ("GPL-3", "GFDL-1.3", "Apache-2.0")],
        help="texts joined for the beyond-the-context run",
    )
    ap.add_argument("--long-text-tokens", type=int, default=10000, help="0: skip that run")
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
                rows.setdefault(name, []).append(ppl(echo_logprobs(client, ids, policy)))
                secs.setdefault(name, []).append(time.perf_counter() - t0)
                print(f"{name}: ppl {rows[name][-1]:.3f} ({secs[name][-1]:.1f} s)", flush=True)
        max_len = int(client.get("/v1/models").json()["data"][0]["max_model_len"])
        longer: dict[str, Any] = {}
        if a.long_text_tokens:
            joined = "\n\n".join(p.read_text() for p in a.long_text)
            long_ids = client.post("/tokenize", json={"prompt": joined}).json()["tokens"]
            if len(long_ids) < a.long_text_tokens:
                raise SystemExit(f"the long text has only {len(long_ids)} tokens")
            longer = long_text(
                client, long_ids[: a.long_text_tokens], a.gen_budget, a.sinks, max_len
            )
        if a.gen_tokens:
            gen = generations(client, url, pid, ids[: a.gen_prompt_tokens], max_len, a)
    full = rows["full"][0]
    table = {
        k: {"ppl": v, "ratio_to_full": [x / full for x in v], "seconds": secs[k]}
        for k, v in rows.items()
    }
    write_json(
        a.output,
        bench_record(
            "long_context", a, {"output"}, perplexity=table, long_text=longer, generation=gen
        ),
    )
    for k, v in table.items():
        print(f"| {k} | {v['ppl'][0]:.3f} | {v['ratio_to_full'][0]:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
