"""A model that cannot be loaded stops the server: exit status 1 within seconds, one clear line.

Each case runs ``python -m server.cli`` as an orchestrator would (a subprocess,
all cases at once to share the import time) and checks that it exits by
itself, non-zero, and that the last stderr line names the cause; no process
is left answering ``/health`` 503 forever.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import default_gguf_path
from tests.live_server import REPO, free_port
from tests.model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # starts a server process per case

EXIT_WITHIN_S = 120.0  # generous for a loaded CI machine; the load itself fails in < 1 s
PREFIX = "fuel-serve: error: the model could not be loaded: "


def _cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    tok = ["--tokenizer", str(default_gguf_path())]
    good = make_tiny_checkpoint(tmp_path / "good", "llama")
    unsupported = make_tiny_checkpoint(tmp_path / "unsupported", "llama")
    cfg = json.loads((unsupported / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (unsupported / "config.json").write_text(json.dumps(cfg))
    missing = make_tiny_checkpoint(tmp_path / "missing", "llama")
    (missing / "model.safetensors").unlink()
    corrupt = make_tiny_checkpoint(tmp_path / "corrupt", "llama")
    (corrupt / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 100)
    return {
        "unsupported_architecture": (
            [str(unsupported), *tok],
            "unsupported model architecture 'GPT2LMHeadModel'",
        ),
        "missing_weights": ([str(missing), *tok], "safetensors"),
        "corrupt_weights": ([str(corrupt), *tok], "model.safetensors"),
        "no_tokenizer": ([str(good)], "tokenizer"),
        "kv_cache_does_not_fit": (
            [str(good), *tok, "--kv-cache-memory", "1024"],
            "fewer than 2 blocks",
        ),
        "no_such_model": ([str(tmp_path / "nope")], "nope"),
        "low_rank_above_head_size": (
            [str(good), *tok, "--kv-low-rank-keys", "999"],
            "--kv-low-rank-keys 999 must be between 1 and the head size",
        ),
    }


def test_startup_failures_exit_nonzero_with_one_clear_line(tmp_path: Path) -> None:
    cases = _cases(tmp_path)
    procs: dict[str, subprocess.Popen[str]] = {}
    for name, (args, _) in cases.items():
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "--port", str(free_port()), *args],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ},
        )
    t0 = time.monotonic()
    results: dict[str, tuple[int, str]] = {}
    try:
        for name, proc in procs.items():
            left = max(1.0, EXIT_WITHIN_S - (time.monotonic() - t0))
            try:
                _, err = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: still running after {EXIT_WITHIN_S} s (a zombie server)")
            results[name] = (proc.returncode, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (code, err) in results.items():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 1, (name, code, err[-2000:])
        assert lines and lines[-1].startswith(PREFIX), (name, err[-2000:])
        needle = cases[name][1]
        assert needle in lines[-1], (name, lines[-1])
        # One line says it: no traceback is printed at the default log level.
        assert "Traceback" not in err, (name, err[-2000:])
