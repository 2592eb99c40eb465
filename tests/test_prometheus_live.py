"""A real Prometheus scrapes a live metrics target; every dashboard query returns data.

The target is the ``metrics_target`` fixture. Today it is a small FastAPI app
serving ``server.metrics.Metrics`` under synthetic engine traffic; switching to
the real server is one line: make ``metrics_target`` return ``real_server``
(``python -m server.cli --host 127.0.0.1 --port P`` on the default model).

Prometheus runs on loopback with a temporary config (1 s scrapes) and temporary
storage, and is always stopped by a finalizer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from engine.outputs import RequestMetrics
from engine.stats import EngineStats
from server.metrics import Metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "fuel-serve.json"
MODEL = "synthetic-model"


@dataclass
class Target:
    """A live HTTP server exposing /metrics, /health and POST /v1/completions."""

    base_url: str
    model_name: str
    send_request: Callable[[httpx.Client, int], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def synthetic_app() -> FastAPI:
    """Metrics under fake engine traffic: every request moves every dashboard series."""
    metrics = Metrics(MODEL, max_model_len=2048)
    stats = EngineStats(num_total_blocks=100)
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    def get_metrics() -> Response:
        with lock:
            metrics.update_from_stats(stats)
            body, ctype = metrics.render()
        return Response(content=body, media_type=ctype)

    @app.post("/v1/completions")
    def completions(body: dict[str, object]) -> JSONResponse:
        i = int(str(body.get("seed", 0)))
        with lock:
            stats.num_steps += 3
            if i % 7 == 6:  # admission control says no, seen by both engine and server
                stats.rejections["queue_full"] = stats.rejections.get("queue_full", 0) + 1
                metrics.observe_rejection("queue_full")
                return JSONResponse({"error": "queue full"}, status_code=429)
            now = time.monotonic()
            prompt, gen = 20 + i % 13, 4 + i % 5
            stats.prompt_tokens += prompt - 8
            stats.generation_tokens += gen
            stats.prefix_cache_queries += prompt
            stats.prefix_cache_hits += 8
            stats.num_preemptions += i % 2
            stats.num_running = 1 + i % 4
            stats.num_waiting = i % 3
            stats.kv_cache_usage = (i % 10) / 10
            itl = 0.004 + 0.002 * (i % 4)
            first = now - 0.05 - gen * itl
            token_times = [first + k * itl for k in range(gen)]
            rm = RequestMetrics(
                arrival_time=first - 0.2,
                first_scheduled_time=first - 0.15,
                first_token_time=first,
                last_token_time=token_times[-1],
                finished_time=token_times[-1] + 0.001,
            )
            metrics.observe_finished(
                rm, prompt, gen, "stop" if i % 3 else "length", 1, 16, token_times
            )
        return JSONResponse({"id": f"cmpl-{i}", "choices": []})

    return app


@pytest.fixture
def synthetic_server() -> Iterator[Target]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(synthetic_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 30, "synthetic server")

        def send(client: httpx.Client, i: int) -> None:
            client.post(f"{base}/v1/completions", json={"model": MODEL, "seed": i})

        yield Target(base, MODEL, send)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def real_server(tmp_path: Path) -> Iterator[Target]:
    """The real Fuel Serve on the default model (needs server/cli.py)."""
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, 300, "fuel-serve")
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

        def send(client: httpx.Client, i: int) -> None:
            client.post(
                f"{base}/v1/completions",
                json={"model": model, "prompt": f"Count to {i}:", "max_tokens": 8},
                timeout=120,
            )

        yield Target(base, model, send)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def metrics_target(synthetic_server: Target) -> Target:
    # The one line to change for the real server: `(real_server: Target)`.
    return synthetic_server


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
    # Traffic spread over several scrapes so rate() sees increases.
    with httpx.Client(timeout=30) as client:
        for i in range(30):
            metrics_target.send_request(client, i)
            time.sleep(0.2)
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
