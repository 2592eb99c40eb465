"""Builds an attention backend by name (the only module that knows every backend).

``base.py`` holds the contract and imports no implementation; each backend
imports only the contract (and the shared step plan of the torch backend it
extends), so the room has no import circle.
"""

from __future__ import annotations

import logging

import torch

from engine.attention.base import AttentionBackend
from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.cpu_native import CpuKernels, NativeBuildError

logger = logging.getLogger(__name__)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """Build a backend by name: ``torch``, ``triton``, ``cpu`` (native decode
    kernel, CPU only) or ``auto``: Triton on CUDA; on CPU the native backend,
    or torch (with a warning) when the native kernel cannot be built here.

    Raises:
        ValueError: an unknown name, or ``cpu`` on another device.
        kernels.cpu_native.NativeBuildError: ``cpu`` asked for and not buildable.
    """
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        else:
            try:
                return get_attention_backend("cpu", device)
            except NativeBuildError as e:
                logger.warning("native CPU attention unavailable (%s); using torch", e)
                name = "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("--attention-backend cpu is for the CPU device only")
        return CpuNativeAttentionBackend(CpuKernels.load())
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        # Imported here: Triton is an optional dependency on CPU-only installs.
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose auto, torch, triton or cpu")
