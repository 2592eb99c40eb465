"""A real Prometheus scrapes the real server; every dashboard query returns data.

The target is Fuel Serve itself (``python -m server.cli`` on the default model,
random free port) started with ``--max-num-seqs 1 --max-waiting-requests 1``
so a small concurrent burst is answered 429 and the admission-rejections panel
has data. The rest of the traffic mixes chat and completions, streaming and
not, and repeats a long system prompt so the prefix cache hits.

Prometheus runs on loopback with a temporary config (1 s scrapes) and temporary
storage, and is always stopped by a finalizer.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.live_server import free_port, live_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "fuel-serve.json"
# Long enough to fill whole KV blocks (16 tokens), so repeats hit the prefix cache.
SYSTEM_PROMPT = (
    "You are the on-call assistant of a small observatory. You answer in one short sentence, "
    "you never guess telescope serial numbers, you prefer metric units, and you always "
    "mention the weather if the question is about observing tonight. "
)


@dataclass
class Target:
    """The live server: base URL and the model name its metrics are labelled with."""

    base_url: str
    model_name: str


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def real_server(tmp_path: Path) -> Iterator[Target]:
    """The real Fuel Serve on the default model, one sequence at a time, queue of one."""
    # n-gram speculation on (fixed draft counts, 1-token lookups: drafts every
    # step), so the dashboard's speculative-decoding panels have series too.
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, '
    spec += '"prompt_lookup_max": 2, "adaptive": false}'
    flags = [
        "--host",
        "127.0.0.1",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
        "--speculative-config",
        spec,
    ]
    with live_server(flags, tmp_path / "server.log", ready_timeout_s=300) as (_proc, base):
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        yield Target(base, model)


@pytest.fixture
def metrics_target(real_server: Target) -> Target:
    return real_server


def send_mixed(client: httpx.Client, target: Target, i: int) -> int:
    """Request ``i`` of the steady traffic: chat/completions x stream/not. Returns the status."""
    stream = i % 4 >= 2
    common = {"model": target.model_name, "max_tokens": 6, "temperature": 0, "stream": stream}
    if i % 2 == 0:
        url = f"{target.base_url}/v1/chat/completions"
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Is tonight good for observing, question {i}?"},
        ]
        body: dict[str, object] = {**common, "messages": messages}
    else:
        url = f"{target.base_url}/v1/completions"
        body = {**common, "prompt": f"{SYSTEM_PROMPT}Count to {i}:"}
    r = client.post(url, json=body, timeout=120)
    r.read()  # a stream is only finished (and observed) once read to [DONE]
    return r.status_code


def send_burst(target: Target, size: int) -> list[int]:
    """``size`` concurrent completions; with one running and one waiting slot most get 429."""
    body = {"model": target.model_name, "prompt": "Burst", "max_tokens": 16, "ignore_eos": True}

    def one(_: int) -> int:
        with httpx.Client(timeout=120) as c:
            return c.post(f"{target.base_url}/v1/completions", json=body).status_code

    with ThreadPoolExecutor(max_workers=size) as pool:
        return list(pool.map(one, range(size)))


@pytest.fixture
def prometheus(tmp_path: Path, metrics_target: Target) -> Iterator[str]:
    """Prometheus on loopback scraping ``metrics_target`` every second; always stopped."""
    binary, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if binary is None or promtool is None:
        pytest.skip("prometheus/promtool missing: run scripts/install-prometheus.sh")
    target = metrics_target.base_url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "fuel", "static_configs": [{"targets": [target]}]}],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    check = subprocess.run([promtool, "check", "config", str(config_path)], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(f"{url}/-/ready").status_code == 200, 60, "prometheus")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(prom: str, expr: str) -> list[dict[str, object]]:
    reply = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return list(reply["data"]["result"])


def dashboard_queries(model_name: str) -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$model_name", model_name)
            out.append((panel["title"], expr.replace("$__rate_interval", "1m")))
    return out


def test_promtool_accepts_shipped_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool missing: run scripts/install-prometheus.sh")
    config = ROOT / "configs" / "prometheus.yml"
    result = subprocess.run([promtool, "check", "config", str(config)], capture_output=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_dashboard_query_returns_data(prometheus: str, metrics_target: Target) -> None:
    wait_until(
        lambda: any(r["value"][1] == "1" for r in query(prometheus, 'up{job="fuel"}')),  # type: ignore[index]
        30,
        "first successful scrape",
    )
    # The burst first, so the rejection series exists for several scrapes before we query.
    statuses = send_burst(metrics_target, 6)
    assert 429 in statuses and 200 in statuses, statuses
    # Steady traffic spread over many scrapes so rate() sees increases.
    with httpx.Client() as client:
        codes = [send_mixed(client, metrics_target, i) for i in range(12)]
    assert codes == [200] * len(codes), codes
    time.sleep(3)  # a few more scrapes after the last request

    queries = dashboard_queries(metrics_target.model_name)
    assert len(queries) >= 15
    empty, non_finite = [], []
    for title, expr in queries:
        result = query(prometheus, expr)
        if not result:
            empty.append(f"{title}: {expr}")
            continue
        values = [float(r["value"][1]) for r in result]  # type: ignore[index]
        if not any(math.isfinite(v) for v in values):
            non_finite.append(f"{title}: {expr} -> {values}")
    assert not empty, "queries without data:\n" + "\n".join(empty)
    assert not non_finite, "queries without a finite value:\n" + "\n".join(non_finite)
    # The traffic really moved the series the panels are about.
    hits = query(
        prometheus, f'vllm:prefix_cache_hits_total{{model_name="{metrics_target.model_name}"}}'
    )
    assert float(hits[0]["value"][1]) > 0  # type: ignore[index]
    rejected = query(prometheus, "sum(fuel:admission_rejections_total)")
    assert float(rejected[0]["value"][1]) == statuses.count(429)  # type: ignore[index]
