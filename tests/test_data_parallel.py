"""The ``--data-parallel-size`` supervisor with stand-in children (fast, no model).

The replicas and the router are tiny Python scripts that write what happens
to them (start, SIGTERM) to a journal, so the order of a shutdown and the exit
statuses can be checked exactly; tests/test_scaleout_e2e.py runs the real thing.
"""

from __future__ import annotations

import stat
import sys
import threading
import time
from pathlib import Path

import pytest

from server.cli import build_configs, resolve_settings
from server.config import ServerConfig
from server.data_parallel import Supervisor, replica_ports, router_command, worker_host

CHILD = """\
import signal, sys, time
journal, name = sys.argv[1], sys.argv[2]
def note(what):
    with open(journal, "a") as f:
        f.write(f"{time.monotonic():.6f} {name} {what}\\n")
def stop(sig, frame):
    note("sigterm")
    time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)  # a drain
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
note("start")
while True:
    time.sleep(0.05)
"""


class FakeSupervisor(Supervisor):
    """Replicas are CHILD scripts; the router is CHILD behind an executable shim."""

    def __init__(self, tmp: Path, cfg: ServerConfig, drain_s: float = 0.0) -> None:
        self.tmp = tmp
        self.journal = tmp / "journal"
        self.script = tmp / "child.py"
        self.script.write_text(CHILD)
        router = tmp / "fake-router"
        router.write_text(f"#!/bin/sh\nexec {sys.executable} {self.script} {self.journal} router\n")
        router.chmod(router.stat().st_mode | stat.S_IEXEC)
        cfg.router_executable = str(router)
        self.drain_s = drain_s
        super().__init__([], cfg, num_threads=1)

    def replica_command(self, port: int) -> list[str]:
        name = f"replica-{port}"
        return [sys.executable, str(self.script), str(self.journal), name, str(self.drain_s)]

    def events(self) -> list[tuple[str, str]]:
        if not self.journal.exists():
            return []
        lines = [ln.split() for ln in self.journal.read_text().splitlines()]
        return [(name, what) for _, name, what in sorted(lines, key=lambda x: float(x[0]))]

    def wait_started(self, n: int) -> None:
        deadline = time.monotonic() + 20
        while sum(1 for _, w in self.events() if w == "start") < n:
            assert time.monotonic() < deadline, self.events()
            time.sleep(0.05)


def cfg(**kw: object) -> ServerConfig:
    return ServerConfig(**{"port": 18000, "data_parallel_size": 2, **kw})  # type: ignore[arg-type]


def run_watch(sup: Supervisor) -> tuple[threading.Thread, list[int]]:
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(sup.watch()))
    t.start()
    return t, out


def test_ports_and_hosts() -> None:
    assert replica_ports(cfg()) == [18001, 18002]
    assert replica_ports(cfg(data_parallel_ports=[9001, 9002])) == [9001, 9002]
    for bad in (
        cfg(data_parallel_ports=[9001]),  # one port for two replicas
        cfg(data_parallel_ports=[9001, 9001]),
        cfg(data_parallel_ports=[18000, 9002]),  # the router's own port
        cfg(data_parallel_ports=[29000, 9002]),  # the router's metrics port
        cfg(port=0),
    ):
        with pytest.raises(SystemExit):
            replica_ports(bad)
    assert worker_host("0.0.0.0") == "127.0.0.1"
    assert worker_host("::") == "[::1]"
    assert worker_host("10.1.2.3") == "10.1.2.3"
    assert worker_host("fe80::1") == "[fe80::1]"
    assert worker_host("node-a") == "node-a"


def test_router_command() -> None:
    cmd = router_command(
        "vllm-router",
        host="0.0.0.0",
        port=8000,
        worker_urls=["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
        policy="round_robin",
        metrics_port=29001,
        log_level="trace",
    )
    assert cmd[0] == "vllm-router"
    at = cmd.index("--worker-urls")
    assert cmd[at + 1 : at + 3] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert cmd[at + 3] == "--policy" and cmd[at + 4] == "round_robin"
    assert cmd[cmd.index("--prometheus-port") + 1] == "29001"
    assert cmd[cmd.index("--log-level") + 1] == "debug"  # the router has no "trace"


def test_replica_command_appends_its_port_and_threads(tmp_path: Path) -> None:
    argv = ["model.gguf", "--data-parallel-size", "2", "--port", "18000", "--api-key", "k"]
    settings = resolve_settings(argv)
    _, server_cfg = build_configs(settings)
    FakeSupervisor(tmp_path, server_cfg)  # points server_cfg at a stand-in router
    cmd = Supervisor(argv, server_cfg, num_threads=None).replica_command(18002)
    assert cmd[:3] == [sys.executable, "-m", "server.cli"]
    assert cmd[3:10] == argv
    assert cmd[10:14] == ["--data-parallel-size", "1", "--port", "18002"]
    assert cmd[14] == "--num-threads" and int(cmd[15]) >= 1
    assert cmd[16:] == ["--data-parallel-rank", "1"]  # ports 18001, 18002: the second
    # The appended flags win: the replica is one server on its own port.
    engine_cfg, replica_cfg = build_configs(resolve_settings(cmd[3:]))
    assert replica_cfg.data_parallel_size == 1 and replica_cfg.port == 18002
    assert engine_cfg.data_parallel_rank == 1
    assert replica_cfg.api_key == "k"


def test_sigterm_drains_replicas_before_the_router(tmp_path: Path) -> None:
    sup = FakeSupervisor(tmp_path, cfg(), drain_s=0.3)
    sup.start()
    sup.wait_started(3)
    t, status = run_watch(sup)
    sup.on_signal(15, None)
    t.join(timeout=10)
    assert status == [0]
    assert sup.stop() is True
    events = sup.events()
    router_term = events.index(("router", "sigterm"))
    replica_terms = [i for i, (n, w) in enumerate(events) if n != "router" and w == "sigterm"]
    assert len(replica_terms) == 2 and max(replica_terms) < router_term
    assert all(c.proc.poll() is not None for c in [*sup.replicas, sup.router])  # type: ignore[list-item]


def test_a_dead_replica_is_reported_and_the_rest_keep_serving(tmp_path: Path) -> None:
    sup = FakeSupervisor(tmp_path, cfg())
    sup.start()
    sup.wait_started(3)
    t, status = run_watch(sup)
    sup.replicas[0].proc.kill()
    deadline = time.monotonic() + 10
    while not sup.replicas[0].reported:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert t.is_alive() and sup.replicas[1].proc.poll() is None  # still serving
    sup.on_signal(15, None)
    t.join(timeout=10)
    assert status == [1]  # a replica died: not a clean run
    sup.stop()
    assert sup.router is not None and sup.router.proc.poll() is not None


def test_no_replica_left_or_no_router_stops_everything(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    sup = FakeSupervisor(tmp_path / "a", cfg())
    sup.start()
    sup.wait_started(3)
    for r in sup.replicas:
        r.proc.kill()
    t, status = run_watch(sup)
    t.join(timeout=10)
    assert status == [1]
    sup.stop()
    assert sup.router is not None and sup.router.proc.poll() is not None

    (tmp_path / "b").mkdir()
    sup = FakeSupervisor(tmp_path / "b", cfg())
    sup.start()
    sup.wait_started(3)
    assert sup.router is not None
    sup.router.proc.kill()
    t, status = run_watch(sup)
    t.join(timeout=10)
    assert status == [1]
    sup.stop()
    assert all(r.proc.poll() is not None for r in sup.replicas)
