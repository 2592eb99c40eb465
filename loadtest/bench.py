"""One benchmark run (or a concurrency sweep) against one server.

Shared by ``loadtest run`` and ``loadtest compare``: build the workload, warm
up, drive the load, compute the metrics and assemble the JSON record.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx

from loadtest.client import ClientConfig, Endpoint
from loadtest.guard import check_loopback_url
from loadtest.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, compute_metrics
from loadtest.runner import LoadResult, LoadSpec, run_load
from loadtest.workloads import NEEDS_TOKENIZER, WorkloadOptions, build_sessions, load_tokenizer

WARMUP_SEED_OFFSET = 10_007  # warm-up prompts differ from measured ones (no prefix-cache gift)


@dataclass
class BenchOptions:
    """Everything that defines a run, as given on the command line."""

    base_url: str
    endpoint: Endpoint = "chat"
    model: str | None = None  # None: the first id in the server's /v1/models
    api_key: str | None = None
    workload: str = "questions"
    workload_opts: WorkloadOptions = field(default_factory=WorkloadOptions)
    tokenizer: str | None = None
    num_requests: int = 64
    num_warmup: int = 0
    max_duration_s: float = 300.0
    concurrency: list[int] | None = field(default_factory=lambda: [1])
    request_rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0
    slos: dict[str, float] = field(default_factory=dict)  # seconds
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    request_timeout_s: float = 600.0
    show_progress: bool = True
    count_chunks_without_usage: bool = False  # see ClientConfig

    def levels(self) -> list[int | None]:
        """The concurrency levels to run: one run per level; [None] for an uncapped open loop."""
        return list(self.concurrency) if self.concurrency else [None]


@dataclass
class RunOutcome:
    """A finished run: its load result, metrics and JSON record."""

    concurrency: int | None
    load: LoadResult
    metrics: BenchmarkMetrics
    record: dict[str, Any]


def make_client(opts: BenchOptions, max_conn: int) -> httpx.AsyncClient:
    """An HTTP client for loopback: no proxies from the environment, enough connections."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(opts.request_timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn),
        trust_env=False,  # an HTTP(S)_PROXY must not reroute loopback traffic
    )


async def resolve_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    """The first model id the server lists at ``/v1/models``; raises RuntimeError if none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = await client.get(base_url + "/v1/models", headers=headers, timeout=10.0)
        r.raise_for_status()
        data = r.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise RuntimeError(f"--model not given and {base_url}/v1/models failed: {e}") from e
    if not data or "id" not in data[0]:
        raise RuntimeError(f"--model not given and {base_url}/v1/models lists no model")
    return str(data[0]["id"])


class Bench:
    """Runs levels of one BenchOptions; loads the tokenizer at most once."""

    def __init__(self, opts: BenchOptions) -> None:
        opts.base_url = check_loopback_url(opts.base_url)
        if opts.workload in ("multi-turn", "conversations") and opts.endpoint != "chat":
            # The completions endpoint has no roles; a transcript would be a different workload.
            raise ValueError("the multi-turn workload needs --endpoint chat")
        self.opts = opts
        self.tokenizer: Any = None
        if opts.workload in NEEDS_TOKENIZER:
            self.tokenizer = load_tokenizer(opts.tokenizer)

    async def run_level(
        self, client: httpx.AsyncClient, model: str, concurrency: int | None, label: str = ""
    ) -> RunOutcome:
        """Warm up, then run the measured requests at ``concurrency``."""
        o = self.opts
        cfg = ClientConfig(
            base_url=o.base_url,
            endpoint=o.endpoint,
            model=model,
            api_key=o.api_key,
            count_chunks_without_usage=o.count_chunks_without_usage,
        )
        if o.num_warmup > 0:
            wopts = WorkloadOptions(
                **{**asdict(o.workload_opts), "seed": o.seed + WARMUP_SEED_OFFSET}
            )
            warm = build_sessions(o.workload, o.num_warmup, wopts, self.tokenizer)
            wspec = LoadSpec(
                num_requests=o.num_warmup,
                max_duration_s=o.max_duration_s,
                concurrency=min(concurrency or o.num_warmup, o.num_warmup),
            )
            wres = await run_load(client, cfg, warm, wspec, o.show_progress, desc="warm-up")
            wfail = sum(1 for r in wres.results if not r.success)
            if wfail:
                errs = {r.error for r in wres.results if not r.success}
                print(f"warning: {wfail}/{len(wres.results)} warm-up requests failed: {errs}")
        sessions = build_sessions(o.workload, o.num_requests, o.workload_opts, self.tokenizer)
        spec = LoadSpec(
            num_requests=o.num_requests,
            max_duration_s=o.max_duration_s,
            concurrency=concurrency,
            request_rate=o.request_rate,
            burstiness=o.burstiness,
            seed=o.seed,
        )
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        t0 = time.time()
        load = await run_load(
            client, cfg, sessions, spec, o.show_progress, desc=label or f"c={concurrency}"
        )
        metrics = compute_metrics(load.results, load.duration_s, o.slos, o.percentiles)
        record: dict[str, Any] = {
            "started_at": started,
            "wall_start_unix": t0,
            "model": model,
            "concurrency": concurrency,
            "request_rate": o.request_rate,
            "burstiness": o.burstiness,
            "workload": o.workload,
            "workload_options": asdict(o.workload_opts),
            "endpoint": o.endpoint,
            "base_url": o.base_url,
            "num_requests_budget": o.num_requests,
            "num_warmup": o.num_warmup,
            "max_duration_s": o.max_duration_s,
            "hit_deadline": load.hit_deadline,
            "cancelled_at_deadline": load.cancelled,
            "count_chunks_without_usage": o.count_chunks_without_usage,
            "metrics": metrics.to_json(),
            "errors": sorted({r.error for r in load.results if not r.success}),
            "requests": [r.to_json() for r in load.results],
        }
        return RunOutcome(concurrency, load, metrics, record)
