"""Start a real Fuel Serve on 127.0.0.1 for end-to-end tests (shared by the e2e modules)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def live_server(
    flags: Sequence[str], log: Path, ready_timeout_s: float = 240.0
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Run ``python -m server.cli --port P *flags`` until /health is 200; yield (process, base URL).

    The server's output goes to ``log``. It is stopped with SIGINT (graceful drain),
    then killed if it has not exited within 30 s. A server that exits early or is
    not ready in time fails the test with the log's tail.
    """
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "--port", str(port), *flags],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited early:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
