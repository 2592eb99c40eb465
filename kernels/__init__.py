"""Triton kernels, each beside a plain-torch reference with the same signature.

Modules: ``paged_attention`` (mixed decode/extend attention over the paged KV
cache), ``cache_write`` (scatter new k/v into cache slots) and ``fused_ops``
(RMSNorm with fused residual add, rotary embedding, SiLU-and-mul).

Nothing here imports ``engine``. Kernels run on CUDA, or on CPU tensors under
the Triton interpreter, which is chosen by ``TRITON_INTERPRET=1`` at the moment
a kernel module is first imported (Triton decides at ``@triton.jit`` time).
"""
