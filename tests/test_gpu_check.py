"""CPU test of benchmarks/gpu_check.py: argument parsing, guarded sections, report writing.

``--dry-run`` runs the kernel sections at tiny sizes under the Triton
interpreter; the engine sections load the real model, so they are in a slow test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check


def test_parse_args_defaults_and_errors() -> None:
    args = gpu_check.parse_args(["--dry-run", "--sections", "attention, decode"])
    assert args.dry_run and args.sections == ["attention", "decode"] and args.num_seqs == 256
    assert gpu_check.parse_args([]).sections == list(gpu_check.SECTIONS)
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sections", "attention,bogus"])


def test_default_out_path_follows_out_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.default_out_path() == tmp_path / "gpu-check.md"
    monkeypatch.delenv("OUT")
    assert gpu_check.default_out_path().parts[-3:] == ("docs", "benchmarks", "gpu-check.md")


def test_dry_run_writes_report_and_survives_failing_section(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def broken(args: argparse.Namespace, device: torch.device, sizes: gpu_check.Sizes) -> None:
        raise RuntimeError("boom in throughput")

    monkeypatch.setitem(gpu_check.SECTION_FUNCS, "throughput", broken)
    # Kernels on CPU need the interpreter; keep the setting local to this test.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "report" / "gpu.md"
    rc = gpu_check.main(
        ["--dry-run", "--out", str(out), "--sections", "pytest,throughput,attention"]
    )
    assert rc == 1  # one section failed
    text = out.read_text()
    assert "DRY RUN" in text and "| commit |" in text and "| torch |" in text
    assert "## Paged decode attention" in text
    assert "**FAILED**" in text and "boom in throughput" in text
    # Each section's table has its header row plus one row per case.
    assert "| tiny 4/2x32 | 2 x 40 |" in text
    data = json.loads(out.with_suffix(".json").read_text())
    assert [s["error"] is None for s in data["sections"]] == [True, False, True]


def test_budget_skips_remaining_sections(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "gpu.md"
    rc = gpu_check.main(
        ["--dry-run", "--out", str(out), "--sections", "attention", "--budget-s", "-1"]
    )
    assert rc == 1
    assert "skipped: time budget" in out.read_text()


@pytest.mark.slow
def test_dry_run_engine_sections(tmp_path: Path) -> None:
    """Throughput and decode sections through ``engine.llm.LLM`` on CPU, tiny sizes."""
    out = tmp_path / "gpu.md"
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--sections", "throughput,decode"])
    text = out.read_text()
    assert rc == 0, text
    assert "| eager | 2 |" in text and "## Decode speed" in text
