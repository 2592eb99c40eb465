"""Helpers shared by the kernel launchers (host side only)."""

from __future__ import annotations

import torch
from triton.runtime.interpreter import InterpretedFunction


def check_launchable(kernel: object, *tensors: torch.Tensor) -> None:
    """Raise a clear error when a kernel cannot run on these tensors.

    Compiled kernels need CUDA tensors; CPU tensors work only when the kernel was
    built by the Triton interpreter (``TRITON_INTERPRET=1`` set before the kernel
    module was imported).
    """
    on_cpu = any(t.device.type != "cuda" for t in tensors)
    if on_cpu and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "the kernels module is imported to run them on CPU"
        )


def needs_fp32_dot(t: torch.Tensor) -> bool:
    """Whether ``tl.dot`` operands must be upcast to fp32 for this tensor.

    The Triton CPU interpreter (3.9) computes bf16 ``tl.dot`` wrongly (it
    reinterprets the raw bits), so off CUDA we upcast bf16 operands first. On
    CUDA the tensor cores take bf16 directly.
    """
    return t.device.type != "cuda" and t.dtype == torch.bfloat16


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
