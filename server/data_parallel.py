"""``--data-parallel-size N`` on one host: N Fuel Serve replicas behind vllm-router.

No home-made load balancer: routing, health checks, retries and circuit
breaking are vllm-router's (PyPI ``vllm-router==0.1.17``, a Rust binary). This
module only starts the processes and stops them in order.

Wiring:

* The router binds ``--host:--port``, the address clients use.
* Replica ``i`` binds ``--host:ports[i]``: ``--data-parallel-ports`` when given,
  else ``--port+1 ... --port+N``. Each replica is this process's own command
  line with ``--data-parallel-size 1 --port P --data-parallel-rank i`` appended
  (later flags win; the rank offsets ``--kv-events-config`` ports), so
  model, engine flags, API key and ``--config`` file are the same everywhere.
  On the CPU, each replica gets ``cores // N`` torch threads unless
  ``--num-threads`` is given (two replicas must not both spread over every core).
* The router's worker URLs are the replicas on loopback (or on ``--host`` when
  that is a specific address); its own Prometheus metrics are on
  ``--host:--router-metrics-port``. Its health checks (every 2 s, unhealthy
  after 2 failures) and circuit breaker (open after 3 failures) take a dead
  replica out of rotation within seconds; see :func:`router_command`.

Lifecycle (this process, the supervisor):

* Children run in their own sessions, so a terminal's Ctrl-C reaches only the
  supervisor, which stops them in order.
* SIGTERM/SIGINT: every replica gets SIGTERM and drains (``/health`` 503, new
  requests 503 + Retry-After, in-flight requests finish within
  ``--shutdown-timeout``); then the router is stopped. Exit status 0 when every
  child exited cleanly.
* A replica that exits on its own is logged with its status and is not
  restarted (restarting is the orchestrator's job: compose ``restart:``,
  Kubernetes); the router routes around it. When no replica is left, or the
  router exits, the rest are stopped and the supervisor exits 1.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from server.config import RouterPolicy, ServerConfig

logger = logging.getLogger("fuel_serve.data_parallel")

POLL_S = 0.2
# Time a replica gets beyond --shutdown-timeout to exit after SIGTERM (engine shutdown).
EXIT_GRACE_S = 15.0
ROUTER_STOP_S = 10.0


def replica_ports(cfg: ServerConfig) -> list[int]:
    """The replicas' ports; SystemExit naming the problem if they cannot work."""
    n = cfg.data_parallel_size
    if cfg.data_parallel_ports:
        ports = list(cfg.data_parallel_ports)
        if len(ports) != n:
            raise SystemExit(
                f"fuel-serve: --data-parallel-ports lists {len(ports)} port(s) for "
                f"--data-parallel-size {n}"
            )
    else:
        if cfg.port == 0:
            raise SystemExit("fuel-serve: --data-parallel-size needs a fixed --port (not 0)")
        ports = [cfg.port + 1 + i for i in range(n)]
    taken = {cfg.port, cfg.router_metrics_port}
    if len(set(ports)) != n or taken & set(ports) or any(not 0 < p < 65536 for p in ports):
        raise SystemExit(
            f"fuel-serve: replica ports {ports} must be distinct valid ports, other than "
            f"--port {cfg.port} and --router-metrics-port {cfg.router_metrics_port}"
        )
    return ports


def worker_host(host: str) -> str:
    """Where the router reaches a replica bound to ``host``: loopback for a wildcard."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a host name: the replicas bound what it resolves to
    if address.is_unspecified:
        return "127.0.0.1" if address.version == 4 else "[::1]"
    return f"[{host}]" if address.version == 6 else host


def router_command(
    executable: str,
    *,
    host: str,
    port: int,
    worker_urls: Sequence[str],
    policy: RouterPolicy,
    metrics_port: int,
    log_level: str = "info",
    startup_timeout_s: int = 600,
) -> list[str]:
    """vllm-router's command line for plain routing over ``worker_urls``.

    Health: every 2 s, a replica is out after 2 failed checks and back after 1
    good one; the circuit breaker opens after 3 failed requests (connection
    refused, 5xx, a draining replica's 503), so traffic leaves a dead replica
    within seconds while the router retries the failed requests elsewhere.
    """
    level = {"trace": "debug"}.get(log_level, log_level)
    return [
        executable,
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-timeout-secs",
        str(startup_timeout_s),
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        "2",
        "--health-failure-threshold",
        "2",
        "--health-success-threshold",
        "1",
        "--health-check-timeout-secs",
        "5",
        "--cb-failure-threshold",
        "3",
        "--log-level",
        level,
    ]


def find_router(executable: str) -> str:
    """The router's path: as given, on PATH, or next to this Python (a venv's bin)."""
    for candidate in (
        shutil.which(executable),
        shutil.which(executable, path=str(Path(sys.executable).parent)),
    ):
        if candidate:
            return candidate
    raise SystemExit(
        f"fuel-serve: router {executable!r} not found: pip install vllm-router==0.1.17 "
        "(or give --router-executable)"
    )


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Child:
    """One supervised process."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    reported: bool = False  # its exit was logged


class Supervisor:
    """Starts the replicas and the router; stops them in order (module docstring)."""

    def __init__(self, argv: Sequence[str], cfg: ServerConfig, num_threads: int | None) -> None:
        self.argv = list(argv)
        self.cfg = cfg
        self.num_threads = num_threads
        self.ports = replica_ports(cfg)
        self.router_path = find_router(cfg.router_executable)
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.stop_requested = False

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT: stop in order; a second one kills every child at once."""
        if self.stop_requested:
            logger.warning("second signal %s: killing every child now", sig)
            for child in self._children():
                if child.proc.poll() is None:
                    child.proc.kill()
        self.stop_requested = True

    def _children(self) -> list[Child]:
        return [*self.replicas, *([self.router] if self.router is not None else [])]

    def _spawn(self, name: str, cmd: list[str], port: int) -> Child:
        # Own session: the terminal's Ctrl-C reaches only the supervisor.
        proc = subprocess.Popen(cmd, start_new_session=True)
        logger.info("%s: pid %d on %s:%d", name, proc.pid, self.cfg.host, port)
        return Child(name, proc, port)

    def replica_command(self, port: int) -> list[str]:
        """This process's command line, as one replica on ``port``."""
        cmd = [sys.executable, "-m", "server.cli", *self.argv]
        cmd += ["--data-parallel-size", "1", "--port", str(port)]
        if self.num_threads is None:
            cmd += ["--num-threads", str(max(1, usable_cores() // len(self.ports)))]
        # The rank offsets the KV event endpoints' ports (--kv-events-config) and
        # is stamped on the replica's event batches, as vLLM's DP ranks do.
        cmd += ["--data-parallel-rank", str(self.ports.index(port))]
        return cmd

    def start(self) -> None:
        for i, port in enumerate(self.ports):
            self.replicas.append(self._spawn(f"replica {i}", self.replica_command(port), port))
        host = worker_host(self.cfg.host)
        urls = [f"http://{host}:{port}" for port in self.ports]
        cmd = router_command(
            self.router_path,
            host=self.cfg.host,
            port=self.cfg.port,
            worker_urls=urls,
            policy=self.cfg.router_policy,
            metrics_port=self.cfg.router_metrics_port,
            log_level=self.cfg.uvicorn_log_level,
        )
        self.router = self._spawn(f"router ({self.cfg.router_policy})", cmd, self.cfg.port)

    def watch(self) -> int:
        """Poll until a stop is requested or the set-up cannot serve; return the exit status."""
        assert self.router is not None
        status = 0
        while not self.stop_requested:
            for child in self.replicas:
                code = child.proc.poll()
                if code is not None and not child.reported:
                    child.reported = True
                    status = 1
                    logger.error(
                        "%s (pid %d, port %d) exited with status %s; the router routes "
                        "around it; it is not restarted",
                        child.name,
                        child.proc.pid,
                        child.port,
                        code,
                    )
            if all(c.reported for c in self.replicas):
                logger.error("no replica left: stopping")
                return 1
            if self.router.proc.poll() is not None:
                logger.error("the router exited with status %s: stopping", self.router.proc.poll())
                return 1
            time.sleep(POLL_S)
        logger.info("stopping: draining %d replica(s), then the router", len(self.replicas))
        return status

    def stop(self) -> bool:
        """Replicas first (they drain), then the router. True if all exited cleanly."""
        clean = True
        live = [c for c in self.replicas if c.proc.poll() is None]
        for child in live:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.shutdown_timeout + EXIT_GRACE_S
        clean &= self._reap(live, deadline)
        if self.router is not None and self.router.proc.poll() is None:
            self.router.proc.send_signal(signal.SIGTERM)
            clean &= self._reap([self.router], time.monotonic() + ROUTER_STOP_S)
        return clean

    @staticmethod
    def _reap(children: list[Child], deadline: float) -> bool:
        clean = True
        for child in children:
            try:
                code = child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not exit in time: killed", child.name)
                child.proc.kill()
                code = child.proc.wait()
            # The router exits on SIGTERM by the signal or with 0; both are a clean stop.
            if code not in (0, -signal.SIGTERM):
                clean = False
                logger.warning("%s exited with status %s", child.name, code)
        return clean


def run_data_parallel(argv: Sequence[str], cfg: ServerConfig, num_threads: int | None) -> int:
    """Supervise N replicas and the router until SIGTERM/SIGINT; return the exit status.

    ``argv``: this process's flags (replicas get them plus their port);
    ``num_threads``: the ``--num-threads`` setting (None: split the cores).
    """
    sup = Supervisor(argv, cfg, num_threads)
    previous = {sig: signal.signal(sig, sup.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        sup.start()
        status = sup.watch()
    finally:
        clean = sup.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status if status else (0 if clean else 1)
