"""Kernels vs their torch references (Triton, and the native CPU decode kernel), and the
attention backends against each other.

Without CUDA the kernels run under the Triton CPU interpreter, which Triton
selects when a kernel is decorated (``@triton.jit`` at kernel-module import),
so ``TRITON_INTERPRET`` is set here before anything imports the kernels. With
CUDA (``benchmarks/gpu_check.py`` runs this file with ``TRITON_INTERPRET=0``)
the same tests run compiled kernels on the GPU.

Tolerances are absolute+relative per dtype (``TOL``): fp32 near-exact (ieee
dots), fp16 ~ a few ulps of 2^-10 after the fp16 P@V dot, bf16 ~ a few ulps of
2^-7 for the same reason.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass, replace
from typing import Any

import pytest
from triton.runtime.interpreter import InterpretedFunction

from engine.attention.base import AttentionMetadata
from engine.attention.cpu_backend import CpuNativeAttentionBackend
from engine.attention.registry import get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from engine.models.ops import NativeCpuModelOps, RopeInputs, TorchModelOps
from kernels import cache_write, cpu_native, fused_moe, paged_attention
from kernels.cache_write import store_kvcache, store_kvcache_ref
from kernels.cpu_native import CpuKernels, NativeBuildError
from kernels.fused_moe import fused_moe_ref, moe_align
from kernels.paged_attention import (
    choose_num_kv_splits,
    paged_attention_ref,
)
from kernels.quant_linear import (
    Q4_1,
    Q8_0,
    ROWS,
    X16,
    QuantWeight,
    dequantize,
    pack_x16,
    quant_linear_ref,
    quantize_q4_1,
    quantize_q8_0,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRET else "cpu")

# (atol, rtol) per dtype.
TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_interpreter_really_active() -> None:
    """Off CUDA every kernel must have been built by the interpreter, else nothing ran."""
    kernels = [
        paged_attention._attn_kernel,
        paged_attention._reduce_splits_kernel,
        cache_write._store_kvcache_kernel,
        fused_moe._moe_gate_up_kernel,
        fused_moe._moe_down_kernel,
    ]
    for kernel in kernels:
        assert isinstance(kernel, InterpretedFunction) == (DEVICE.type == "cpu"), kernel


# ------------------------------------------------------------------ batch builder


T = torch.Tensor
# Positional arguments of paged_attention / paged_attention_ref before ``out``.
AttnArgs = tuple[T, T, T, T, T, T, int, int, float, int]


@dataclass
class Batch:
    """A random mixed batch: new q/k/v, caches holding random prefixes, metadata."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def attn_args(self) -> AttnArgs:
        m = self.meta
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            m.block_tables,
            m.seq_lens,
            m.query_start_loc,
            m.max_query_len,
            m.max_seq_len,
            self.scale,
            m.num_decodes,
        )


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 0,
    seed: int = 0,
) -> Batch:
    """Blocks are handed out in a shuffled order so block tables really matter.

    ``pad_tokens`` extra rows of q/k/v get slot -1 (CUDA-graph padding).
    """
    g = torch.Generator().manual_seed(seed)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    nblks = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(nblks) + 2
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max(nblks) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(nblks):
        block_tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    slots: list[int] = []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(sl - ql, sl):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * pad_tokens
    t = len(slots)
    shape_c = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = [0]
    for ql in query_lens:
        starts.append(starts[-1] + ql)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)

    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        query_start_loc_cpu=starts,
    )
    return Batch(
        q=rnd(t, num_heads, head_dim),
        k=rnd(t, num_kv_heads, head_dim),
        v=rnd(t, num_kv_heads, head_dim),
        k_cache=rnd(*shape_c),
        v_cache=rnd(*shape_c),
        meta=meta,
        scale=head_dim**-0.5,
    )


# Mixed batch (block_size 4): decodes of length 1, 17 (mid-block) and 8 (block
# boundary); extends with a prefix ending at a block boundary (ctx 8), mid-block
# (ctx 7), a fresh prefill (ctx 0) and a long chunk spanning several query tiles.
MIXED_Q = [1, 1, 1, 5, 3, 6, 19]
MIXED_S = [1, 17, 8, 13, 10, 6, 26]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------ cache write


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_matches_ref(dtype: torch.dtype) -> None:
    b = make_batch(MIXED_Q, MIXED_S, dtype=dtype, pad_tokens=3)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    store_kvcache(b.k, b.v, b.k_cache, b.v_cache, b.meta.slot_mapping)
    store_kvcache_ref(b.k, b.v, kc, vc, b.meta.slot_mapping)
    assert torch.equal(b.k_cache, kc) and torch.equal(b.v_cache, vc)
    # The written slots really hold the new tokens (the ref is not a no-op).
    s = int(b.meta.slot_mapping[0])
    assert torch.equal(kc.view(-1, *kc.shape[2:])[s], b.k[0])


def test_store_kvcache_casts_and_skips() -> None:
    b = make_batch([3], [3], dtype=torch.float32)
    kc = torch.zeros_like(b.k_cache, dtype=torch.float16)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([5, -1, 0], dtype=torch.int64, device=DEVICE)
    store_kvcache(b.k, b.v, kc, vc, slots)
    flat = kc.view(-1, *kc.shape[2:])
    assert torch.equal(flat[5], b.k[0].half()) and torch.equal(flat[0], b.k[2].half())
    assert int((flat.abs().sum(dim=(1, 2)) > 0).sum()) == 2  # slot -1 wrote nothing


# ------------------------------------------------------------------ paged attention


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype"),
    [
        (2, 2, torch.float32),
        (4, 2, torch.float16),
        (8, 2, torch.bfloat16),
        (4, 1, torch.float32),
    ],
)
def test_paged_attention_mixed_batch(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    b = make_batch(MIXED_Q, MIXED_S, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    got = paged_attention.paged_attention(*b.attn_args())
    want = paged_attention_ref(*b.attn_args())
    _assert_close(got, want, dtype)


class LaunchRecorder:
    """Stands in for a Triton kernel object and records the grid of every launch."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_split_k(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force flash-decoding: several splits, some empty for the shorter sequences."""
    q_lens, s_lens = [1, 1, 1, 1, 4], [45, 1, 9, 33, 12]
    b = make_batch(q_lens, s_lens, num_heads=6, num_kv_heads=2, dtype=dtype, seed=3)
    assert choose_num_kv_splits(45, 4, 2, DEVICE, kv_split_size=8) == 6
    reduce_launches = LaunchRecorder(paged_attention._reduce_splits_kernel)
    monkeypatch.setattr(paged_attention, "_reduce_splits_kernel", reduce_launches)
    got = paged_attention.paged_attention(*b.attn_args(), kv_split_size=8)
    assert reduce_launches.grids == [(4, 6)]  # the split path really ran: 4 decodes x 6 heads
    want = paged_attention_ref(*b.attn_args())
    _assert_close(got, want, dtype)
    unsplit = paged_attention.paged_attention(*b.attn_args(), kv_split_size=1 << 20)
    assert len(reduce_launches.grids) == 1  # one split: no reduction pass
    _assert_close(got, unsplit, dtype)


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(64, torch.bfloat16), (128, torch.float16), (48, torch.float32)]
)
def test_paged_attention_head_dims(head_dim: int, dtype: torch.dtype) -> None:
    """64 and 128 as used by real models; 48 checks the padded (non power of two) path."""
    b = make_batch([1, 1, 7], [20, 3, 11], head_dim=head_dim, block_size=8, dtype=dtype, seed=1)
    out = torch.full_like(b.q, float("nan"))
    got = paged_attention.paged_attention(*b.attn_args(), out=out, kv_split_size=8)
    assert got is out
    _assert_close(got, paged_attention_ref(*b.attn_args()), dtype)


@pytest.mark.parametrize(
    ("q_lens", "s_lens"),
    [([1], [1]), ([1, 1], [4, 5]), ([9], [9]), ([2, 16], [6, 16])],
    ids=["single-token", "decodes-only", "prefill-only", "extends-only"],
)
def test_paged_attention_edge_batches(q_lens: list[int], s_lens: list[int]) -> None:
    b = make_batch(q_lens, s_lens, num_heads=4, num_kv_heads=2, seed=2)
    _assert_close(
        paged_attention.paged_attention(*b.attn_args()),
        paged_attention_ref(*b.attn_args()),
        torch.float32,
    )


def test_paged_attention_loose_bounds() -> None:
    """max_query_len/max_seq_len may overstate the batch (CUDA-graph capture sizes)."""
    b = make_batch([1, 5, 3], [9, 5, 12], num_heads=4, num_kv_heads=1, seed=4)
    a = b.attn_args()
    got = paged_attention.paged_attention(*a[:6], a[6] + 20, a[7] + 100, *a[8:])
    _assert_close(got, paged_attention_ref(*a), torch.float32)


def test_paged_attention_ref_rejects_broken_metadata() -> None:
    b = make_batch([2, 1], [4, 4])
    a = b.attn_args()
    with pytest.raises(ValueError, match="decode"):
        # num_decodes 1 claims the 2-token first sequence is a decode.
        paged_attention_ref(*a[:9], 1)


def test_choose_num_kv_splits() -> None:
    cpu = torch.device("cpu")
    assert choose_num_kv_splits(4096, 1, 1, cpu) == 1
    assert choose_num_kv_splits(100, 2, 2, cpu, kv_split_size=32) == 4
    assert choose_num_kv_splits(10**6, 2, 2, cpu, kv_split_size=1) == 64
    with pytest.raises(ValueError):
        choose_num_kv_splits(100, 2, 2, cpu, kv_split_size=0)


# ------------------------------------------------------------------ backends


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype"),
    [(4, 2, torch.float32), (4, 1, torch.float16), (3, 3, torch.bfloat16)],
)
def test_triton_backend_matches_torch_backend(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    b = make_batch(
        MIXED_Q, MIXED_S, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, pad_tokens=2
    )
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = TritonAttentionBackend().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
    want = TorchAttentionBackend().forward(b.q, b.k, b.v, kc, vc, b.meta, b.scale)
    assert torch.equal(b.k_cache, kc) and torch.equal(b.v_cache, vc)
    t = b.meta.query_start_loc_cpu[-1]  # padding rows are unspecified in both
    _assert_close(got[:t], want[:t], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_backend_matches_ref(dtype: torch.dtype) -> None:
    b = make_batch(MIXED_Q, MIXED_S, num_heads=4, num_kv_heads=2, dtype=dtype, seed=5)
    ref_batch = replace(b, k_cache=b.k_cache.clone(), v_cache=b.v_cache.clone())
    got = TorchAttentionBackend().forward(b.q, b.k, b.v, b.k_cache, b.v_cache, b.meta, b.scale)
    store_kvcache_ref(b.k, b.v, ref_batch.k_cache, ref_batch.v_cache, b.meta.slot_mapping)
    want = paged_attention_ref(*ref_batch.attn_args())
    _assert_close(got, want, dtype)


# ------------------------------------------------------------------ native CPU decode kernel


@pytest.fixture(scope="module")
def cpu_kernels() -> CpuKernels:
    try:
        return CpuKernels.load()
    except NativeBuildError as e:  # e.g. a device image without a C compiler
        pytest.skip(f"native CPU kernels not buildable here: {e}")


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        ([1, 17, 8, 4, 33], 4, 2, 32, 4),  # length 1, block boundaries, mid-block ends
        ([5], 9, 3, 64, 16),  # one sequence, fewer than threads
        ([40, 3, 16, 9, 1, 64, 2, 7], 9, 3, 64, 16),  # more sequences than threads
        ([12, 30, 7], 8, 1, 128, 8),  # GQA ratio 8
        ([6, 11], 3, 3, 24, 4),  # no GQA; head_dim not a multiple of 16 (scalar path)
        # The fast path's edges: 8-token score groups and 128-token value chunks
        # that straddle 12-token blocks, and ragged tails.
        ([131, 260, 9, 300], 6, 2, 128, 12),
    ],
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_cpu_decode_attention_matches_ref(
    cpu_kernels: CpuKernels,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_threads: int,
) -> None:
    b = make_batch(
        [1] * len(seq_lens),
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=len(seq_lens),
    )
    q, kc, vc = b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu()
    bt, sl = b.meta.block_tables.cpu(), b.meta.seq_lens.cpu()
    got = cpu_kernels.paged_decode_attention(q, kc, vc, bt, sl, b.scale, num_threads=num_threads)
    args = (q, kc, vc, bt, sl, b.meta.query_start_loc.cpu(), 1, max(seq_lens), b.scale, len(sl))
    want = paged_attention_ref(*args)
    _assert_close(got, want, torch.float32)


def test_cpu_decode_attention_rejects_what_it_cannot_read(cpu_kernels: CpuKernels) -> None:
    b = make_batch([1, 1], [5, 9])
    q, kc, vc = b.q.cpu(), b.k_cache.cpu(), b.v_cache.cpu()
    bt, sl = b.meta.block_tables.cpu(), b.meta.seq_lens.cpu()
    run = cpu_kernels.paged_decode_attention
    with pytest.raises(ValueError, match="float32"):
        run(q.half(), kc, vc, bt, sl, 1.0)
    with pytest.raises(ValueError, match="int32"):
        run(q, kc, vc, bt.long(), sl, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        run(q.transpose(0, 1).contiguous().transpose(0, 1), kc, vc, bt, sl, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        run(q, kc, vc, bt, torch.tensor([0, 9], dtype=torch.int32), 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        run(q, kc, vc, bt, torch.tensor([5, bt.shape[1] * 4 + 1], dtype=torch.int32), 1.0)


def test_cpu_backend_matches_torch_backend(cpu_kernels: CpuKernels) -> None:
    """Mixed decodes + extends with padding rows: decodes on the kernel, the rest on torch."""
    b = make_batch(MIXED_Q, MIXED_S, num_heads=6, num_kv_heads=2, pad_tokens=2, seed=3)
    b = replace(
        b,
        q=b.q.cpu(),
        k=b.k.cpu(),
        v=b.v.cpu(),
        k_cache=b.k_cache.cpu(),
        v_cache=b.v_cache.cpu(),
    )
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    meta = b.meta
    if meta.slot_mapping.device.type != "cpu":
        pytest.skip("the batch helper built device metadata")
    backend = CpuNativeAttentionBackend(cpu_kernels)
    got = backend.forward(b.q, b.k, b.v, b.k_cache, b.v_cache, meta, b.scale)
    want = TorchAttentionBackend().forward(b.q, b.k, b.v, kc, vc, meta, b.scale)
    assert torch.equal(b.k_cache, kc) and torch.equal(b.v_cache, vc)
    t = meta.query_start_loc_cpu[-1]
    _assert_close(got[:t], want[:t], torch.float32)
    # bf16 caches fall back to the torch path, same answer as the torch backend.
    b16 = make_batch(MIXED_Q, MIXED_S, dtype=torch.bfloat16, seed=4)
    if b16.q.device.type == "cpu":
        kc16, vc16 = b16.k_cache.clone(), b16.v_cache.clone()
        got16 = backend.forward(b16.q, b16.k, b16.v, b16.k_cache, b16.v_cache, b16.meta, 0.3)
        want16 = TorchAttentionBackend().forward(b16.q, b16.k, b16.v, kc16, vc16, b16.meta, 0.3)
        torch.testing.assert_close(got16, want16, atol=0.0, rtol=0.0)


def test_auto_backend_falls_back_without_a_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native.shutil, "which", lambda _name: None)
    with pytest.raises(NativeBuildError, match="compiler"):
        get_attention_backend("cpu", torch.device("cpu"))
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), TorchAttentionBackend)
    assert not isinstance(
        get_attention_backend("auto", torch.device("cpu")), CpuNativeAttentionBackend
    )


# ------------------------------------------------------------------ native CPU fused ops


def test_native_model_ops_match_torch_ops(cpu_kernels: CpuKernels) -> None:
    """Each native op against TorchModelOps (the reference), including the fallbacks."""
    ref, nat = TorchModelOps(), NativeCpuModelOps(cpu_kernels)
    g = torch.Generator().manual_seed(0)
    # rows chosen on both sides of the kernels' threading threshold
    for rows, dim in [(1, 96), (5, 576), (200, 576)]:
        x = torch.randn(rows, dim, generator=g)
        w = torch.randn(dim, generator=g)
        res = torch.randn(rows, dim, generator=g)
        want, want_h = ref.add_rms_norm(x, w, 1e-5, res.clone())
        mine = res.clone()
        got, got_h = nat.add_rms_norm(x, w, 1e-5, mine)
        _assert_close(got, want, torch.float32)
        assert got_h is mine and torch.equal(got_h, want_h)  # the residual is updated in place
        got, got_h = nat.add_rms_norm(x, w, 1e-5, None)
        _assert_close(got, ref.add_rms_norm(x, w, 1e-5, None)[0], torch.float32)
        assert got_h is x
        gu = torch.randn(rows, 2 * dim, generator=g)
        _assert_close(nat.silu_mul(gu), ref.silu_mul(gu), torch.float32)
    # SiLU's vector exp: widths off the 8-lane grid, and gates far into both tails.
    gu = torch.randn(3, 2 * 100, generator=g) * 4
    gu[0, :8] = torch.tensor([-200.0, -88.5, -87.0, -20.0, 20.0, 87.5, 90.0, 300.0])
    _assert_close(nat.silu_mul(gu), ref.silu_mul(gu), torch.float32)
    # RoPE in place on a fused qkv buffer (q then k adjacent), and out of place otherwise.
    hq, hkv, d, t = 6, 2, 32, 7
    cache = torch.randn(64, d, generator=g)
    pos = torch.tensor([0, 1, 63, 7, 7, 30, 2])
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v_before = qkv[:, (hq + hkv) * d :].clone()
    want_q, want_k = ref.rope(q.clone(), k.clone(), RopeInputs(pos, cache, torch.float32))
    got_q, got_k = nat.rope(q, k, RopeInputs(pos, cache, torch.float32))
    assert got_q.data_ptr() == qkv.data_ptr()  # rotated in place
    _assert_close(got_q, want_q, torch.float32)
    _assert_close(got_k, want_k, torch.float32)
    assert torch.equal(qkv[:, (hq + hkv) * d :], v_before)  # v untouched
    # One row (a one-sequence decode step): a size-1 dim's view stride is
    # arbitrary, which must not push it off the in-place native path.
    qkv1 = qkv[:1].clone()
    q1, k1 = qkv1[:, : hq * d].view(1, hq, d), qkv1[:, hq * d : (hq + hkv) * d].view(1, hkv, d)
    want_q1, want_k1 = ref.rope(q1.clone(), k1.clone(), RopeInputs(pos[:1], cache, torch.float32))
    got_q1, got_k1 = nat.rope(q1, k1, RopeInputs(pos[:1], cache, torch.float32))
    assert got_q1.data_ptr() == qkv1.data_ptr() and got_k1.data_ptr() == k1.data_ptr()
    _assert_close(got_q1, want_q1, torch.float32)
    _assert_close(got_k1, want_k1, torch.float32)
    q2, k2 = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    fq, fk = nat.rope(q2, k2, RopeInputs(pos, cache, torch.float32))  # not adjacent: fallback
    rq, rk = ref.rope(q2, k2, RopeInputs(pos, cache, torch.float32))
    assert torch.equal(fq, rq) and torch.equal(fk, rk)
    with pytest.raises(ValueError, match="position"):
        cpu_kernels.rope_neox_(qkv, hq + hkv, d, torch.tensor([0, 1, 64, 0, 0, 0, 0]), cache)
    # bf16 goes to the reference
    xb = torch.randn(3, 96, generator=g).bfloat16()
    wb = torch.randn(96, generator=g).bfloat16()
    assert torch.equal(
        nat.add_rms_norm(xb, wb, 1e-5, None)[0], ref.add_rms_norm(xb, wb, 1e-5, None)[0]
    )


# ------------------------------------------------------------------ fused decode store + attention


def _fused_qkv(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's q/k/v copied into one [t, (hq + 2 hkv) d] buffer, as views."""
    t, hq, d = b.q.shape
    hkv = b.k.shape[1]
    qkv = torch.cat([b.q.reshape(t, -1), b.k.reshape(t, -1), b.v.reshape(t, -1)], dim=1).cpu()
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    return qkv, q, k, v


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "pad"),
    [
        ([1, 17, 8, 4, 33], 4, 2, 32, 0),
        ([70], 9, 3, 64, 0),  # one sequence: a one-row view
        ([300], 9, 3, 64, 0),  # fewer sequences than threads, long: split-K and merge
        ([257], 4, 1, 32, 0),
        ([40, 3, 16, 9, 1], 9, 3, 64, 3),  # padding rows (slot -1) after the decodes
        ([523, 131], 6, 2, 128, 0),  # value chunks and ragged score groups, split-K
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_cpu_decode_store_attention_matches_ref(
    cpu_kernels: CpuKernels,
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    pad: int,
    cache_dtype: torch.dtype,
) -> None:
    n = len(seq_lens)
    b = make_batch(
        [1] * n,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        pad_tokens=pad,
        seed=n + pad,
    )
    if b.q.device.type != "cpu":
        pytest.skip("the batch helper built device tensors")
    _, q, k, v = _fused_qkv(b)
    b = replace(b, k_cache=b.k_cache.to(cache_dtype), v_cache=b.v_cache.to(cache_dtype))
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    meta = b.meta
    # Padding rows attend over block 0 with length 1 (as graph padding does).
    bt = torch.cat(
        [meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.int32)]
    )
    sl = torch.cat([meta.seq_lens, torch.ones(pad, dtype=torch.int32)])
    got = cpu_kernels.paged_decode_store_attention(
        q, k, v, b.k_cache, b.v_cache, meta.slot_mapping, bt, sl, b.scale
    )
    # Reference: the torch store (skips slot -1; rounds to the cache dtype the
    # way the kernel does), then the reference attention over the stored values.
    from engine.attention.torch_backend import store_kv

    keep = torch.nonzero(meta.slot_mapping >= 0).squeeze(1)
    store_kv(b.k, b.v, kc, vc, meta.slot_mapping, keep if pad else None)
    assert torch.equal(b.k_cache, kc) and torch.equal(b.v_cache, vc)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    want = paged_attention_ref(
        b.q[:n],
        kc.float(),
        vc.float(),
        meta.block_tables,
        meta.seq_lens,
        qsl,
        1,
        max(seq_lens),
        b.scale,
        n,
    )
    _assert_close(got[:n], want, torch.float32)
    # The plain decode kernel reads the same cache the same way.
    plain = cpu_kernels.paged_decode_attention(
        b.q[:n].contiguous(), b.k_cache, b.v_cache, meta.block_tables, meta.seq_lens, b.scale
    )
    _assert_close(plain, want, torch.float32)


def test_cpu_decode_store_attention_rejects_bad_slots_and_layouts(cpu_kernels: CpuKernels) -> None:
    b = make_batch([1, 1], [5, 9])
    if b.q.device.type != "cpu":
        pytest.skip("the batch helper built device tensors")
    _, q, k, v = _fused_qkv(b)
    m = b.meta
    run = cpu_kernels.paged_decode_store_attention
    bad_slot = torch.tensor([0, b.k_cache.shape[0] * b.k_cache.shape[1]], dtype=torch.int64)
    with pytest.raises(ValueError, match="out of range"):
        run(q, k, v, b.k_cache, b.v_cache, bad_slot, m.block_tables, m.seq_lens, 1.0)
    with pytest.raises(ValueError, match="out of range"):
        run(
            q,
            k,
            v,
            b.k_cache,
            b.v_cache,
            m.slot_mapping,
            m.block_tables,
            torch.tensor([0, 9], dtype=torch.int32),
            1.0,
        )
    with pytest.raises(ValueError, match="layout"):  # k/v rows not strided like q's
        run(
            q, b.k.clone(), v, b.k_cache, b.v_cache, m.slot_mapping, m.block_tables, m.seq_lens, 1.0
        )
    with pytest.raises(ValueError, match="layout"):
        run(q, k, v, b.k_cache.half(), b.v_cache, m.slot_mapping, m.block_tables, m.seq_lens, 1.0)


def test_cpu_backend_decode_only_step_matches_torch_backend(cpu_kernels: CpuKernels) -> None:
    """Decode-only steps take the fused path; separate q/k/v tensors take the generic one."""
    seq_lens = [1, 17, 8, 30]
    b = make_batch([1] * 4, seq_lens, num_heads=6, num_kv_heads=2, pad_tokens=2, seed=9)
    if b.q.device.type != "cpu":
        pytest.skip("the batch helper built device tensors")
    # Padding rows are decodes of length 1 over block 0, as in a captured graph.
    meta = replace(
        b.meta,
        block_tables=torch.cat(
            [b.meta.block_tables, torch.zeros(2, b.meta.block_tables.shape[1], dtype=torch.int32)]
        ),
        seq_lens=torch.cat([b.meta.seq_lens, torch.ones(2, dtype=torch.int32)]),
        query_start_loc=torch.arange(7, dtype=torch.int32),
        num_decodes=6,
        query_lens_cpu=[1] * 6,
        seq_lens_cpu=[*seq_lens, 1, 1],
        query_start_loc_cpu=list(range(7)),
    )
    _, q, k, v = _fused_qkv(b)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    backend = CpuNativeAttentionBackend(cpu_kernels)
    got = backend.forward(q, k, v, b.k_cache, b.v_cache, meta, b.scale)
    want = TorchAttentionBackend().forward(b.q, b.k, b.v, kc, vc, meta, b.scale)
    assert torch.equal(b.k_cache, kc) and torch.equal(b.v_cache, vc)
    _assert_close(got[:4], want[:4], torch.float32)
    # Not one buffer (k rows strided unlike q's): the generic path, same answer.
    kc2, vc2 = b.k_cache.clone(), b.v_cache.clone()
    got2 = backend.forward(q, b.k.clone(), b.v.clone(), kc2, vc2, meta, b.scale)
    _assert_close(got2[:4], want[:4], torch.float32)


# ------------------------------------------------------------------ block-quantized linears


@pytest.fixture(scope="module")
def scalar_cpu_kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    """The same library built without AVX2: the portable code paths."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" or os.uname().machine != "x86_64":
        pytest.skip("-mno-avx2 is an x86 flag")
    try:
        return CpuKernels.load(
            tmp_path_factory.mktemp("scalar"), extra_flags=("-mno-avx2", "-mno-f16c")
        )
    except NativeBuildError as e:
        pytest.skip(f"native CPU kernels not buildable here: {e}")


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False


@pytest.fixture(scope="module")
def avx2_cpu_kernels(tmp_path_factory: pytest.TempPathFactory) -> CpuKernels:
    """The same library built without AVX-512: the AVX2 integer-dot path, which
    CPUs without AVX-512 VNNI run."""
    if not _cpu_has("avx2") or os.uname().machine != "x86_64":
        pytest.skip("this CPU has no AVX2")
    try:
        kern = CpuKernels.load(tmp_path_factory.mktemp("avx2"), extra_flags=("-mno-avx512f",))
    except NativeBuildError as e:
        pytest.skip(f"native CPU kernels not buildable here: {e}")
    assert kern.quant_caps == cpu_native.QUANT_CAPS_AVX2
    return kern


@pytest.fixture(scope="module")
def vnni_cpu_kernels(cpu_kernels: CpuKernels) -> CpuKernels:
    """The default (-march=native) build, which has the AVX-512 VNNI path
    exactly where the CPU has AVX-512 VNNI."""
    has = all(_cpu_has(f) for f in ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
    assert cpu_kernels.has_avx512_vnni == has
    if not has:
        pytest.skip("this CPU has no AVX-512 VNNI")
    return cpu_kernels


# (build, layout): the VNNI build reads both layouts; the others row-major blocks.
_BUILDS = [
    ("vnni_cpu_kernels", X16),
    ("vnni_cpu_kernels", ROWS),
    ("avx2_cpu_kernels", ROWS),
    ("scalar_cpu_kernels", ROWS),
]


@pytest.mark.parametrize("quantize", [quantize_q8_0, quantize_q4_1])
@pytest.mark.parametrize("k", [32, 96, 576, 1536])  # 96: an odd block count (Q4_1 pads a block)
@pytest.mark.parametrize(("build", "layout"), _BUILDS)
def test_quant_linear_matches_ref(
    request: pytest.FixtureRequest, quantize: Any, k: int, build: str, layout: int
) -> None:
    kern: CpuKernels = request.getfixturevalue(build)
    g = torch.Generator().manual_seed(k)
    for n in (1, 7, 200):
        w = torch.randn(n, k, generator=g)
        qw = quantize(w)
        if layout == X16:
            qw = pack_x16(qw)  # 200 rows: 12 whole groups of 16 and a partial one
            assert torch.equal(dequantize(qw), dequantize(quantize(w)))
        bias = torch.randn(n, generator=g)
        # rows on both sides of the 4-row tile and of the 64-row block; 300 x 200
        # x 18 blocks crosses the kernel's threading threshold
        for rows in (1, 3, 4, 5, 9, 70, 300 if k == 576 else 2):
            x = torch.randn(rows, k, generator=g) * 3
            x[0, :5] *= 50  # an outlier block: 8-bit activation codes would lose the rest
            for b in (None, bias):
                got = kern.quant_linear(x, qw, b)
                want = quant_linear_ref(x, qw, b)
                scale = float(want.abs().max()) + 1.0
                torch.testing.assert_close(got, want, atol=2e-5 * scale, rtol=1e-5)
        # and the blocks really stand for the weight (quantization error bounds)
        err = (dequantize(qw) - w).abs()
        blocks = w.reshape(n, -1, 32)
        step = (
            blocks.abs().amax(-1) / 127
            if qw.qtype == Q8_0
            else (blocks.amax(-1) - blocks.amin(-1)) / 15
        )
        # half a step, plus float16 rounding of the scale(s) times the largest code
        slack = step * (0.5 + 16 * 2.0**-10) + blocks.abs().amax(-1) * 2.0**-10
        assert bool((err.reshape(n, -1, 32) <= slack[..., None] + 1e-6).all())


def test_activation_codes_are_15_bit() -> None:
    """The reference's activation rounding: 128 codes per 8-bit step of the
    block's amax / 127, so an outlier block keeps its small entries."""
    from kernels.quant_linear import quantize_activations_ref

    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.3, -0.004
    got = quantize_activations_ref(x)
    # dx = 1, codes of 1/128: 0.3 -> 38/128, -0.004 -> -1/128 (8-bit codes: 0 and 0)
    assert got[0, :3].tolist() == [127.0, 38 / 128, -1 / 128]


@pytest.mark.parametrize("quantize", [quantize_q8_0, quantize_q4_1])
@pytest.mark.parametrize(("build", "layout"), _BUILDS)
def test_quant_linear_rows_do_not_depend_on_the_batch(
    request: pytest.FixtureRequest, quantize: Any, build: str, layout: int
) -> None:
    """Each output row is bit for bit the same alone as inside any batch: the
    kernel computes every output by one sequence of operations (tiles of any
    shape, any split of the weight rows across threads)."""
    kern: CpuKernels = request.getfixturevalue(build)
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(203, 96, generator=g))
    qw = pack_x16(qw) if layout == X16 else qw
    bias = torch.randn(203, generator=g)
    x = torch.randn(75, 96, generator=g)
    whole = kern.quant_linear(x, qw, bias)
    for lo, hi in ((0, 1), (5, 6), (3, 10), (70, 75), (0, 64), (1, 75)):
        assert torch.equal(kern.quant_linear(x[lo:hi].contiguous(), qw, bias), whole[lo:hi])


def test_quant_linear_rejects_mismatches(cpu_kernels: CpuKernels) -> None:
    qw = quantize_q4_1(torch.randn(8, 64))
    with pytest.raises(ValueError, match="shape"):
        cpu_kernels.quant_linear(torch.randn(2, 32), qw)
    with pytest.raises(ValueError, match="shape"):
        cpu_kernels.quant_linear(torch.randn(2, 64), qw, torch.zeros(7))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.quant_linear(torch.randn(2, 64).double(), qw)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 48))
    assert cpu_kernels.quant_linear(torch.zeros(0, 64), qw).shape == (0, 8)


def test_q4_1_gguf_weights_quantize_back_to_the_same_blocks(default_model_path: Any) -> None:
    """Dequantized Q4_1 GGUF weights requantize to the file's blocks, bit for bit."""
    import numpy as np

    from engine.models.loader import _dequantize, read_gguf

    g = read_gguf(default_model_path)
    data = np.memmap(default_model_path, dtype=np.uint8, mode="r").view(np.ndarray)
    for name in ("blk.0.attn_q.weight", "blk.11.ffn_down.weight", "blk.29.ffn_up.weight"):
        info = g.tensors[name]
        raw = np.ascontiguousarray(data[info.offset : info.offset + info.nbytes])
        raw = raw.reshape(info.shape[0], -1, 20)  # Q4_1 block: f16 d, f16 m, 16 nibble bytes
        qw = quantize_q4_1(_dequantize(g, data, info))
        n, nb = raw.shape[:2]
        assert torch.equal(
            qw.d[:, :nb], torch.from_numpy(raw[:, :, 0:2].copy()).view(torch.int16)[..., 0]
        )
        assert qw.m is not None
        assert torch.equal(
            qw.m[:, :nb], torch.from_numpy(raw[:, :, 2:4].copy()).view(torch.int16)[..., 0]
        )
        nib = torch.from_numpy(raw[:, :, 4:].copy())
        file_q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # elements 0..15, then 16..31
        ours_q = torch.stack([qw.qs & 0x0F, qw.qs >> 4], dim=2).reshape(n, -1, 32)[:, :nb]
        assert torch.equal(ours_q, file_q)


def test_block_quant_linear_routes_by_rows(cpu_kernels: CpuKernels) -> None:
    from engine.models.linear import BlockQuantLinear

    g = torch.Generator().manual_seed(1)
    w, bias = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    small, large = torch.randn(4, 64, generator=g), torch.randn(5, 64, generator=g)
    # No row limit (the AVX-512 VNNI default): every batch through the native kernel.
    lin = BlockQuantLinear(w, bias, cpu_kernels, Q4_1, layout=ROWS)
    assert isinstance(lin.qweight, QuantWeight) and lin.qweight.qtype == Q4_1
    assert lin.large is None
    assert torch.equal(lin(large), cpu_kernels.quant_linear(large, lin.qweight, lin.bias_f32))
    assert torch.equal(lin(large.view(5, 1, 64)).view(5, 48), lin(large))
    # A row limit (builds without VNNI): fp16 weights above it.
    lin = BlockQuantLinear(w, bias, cpu_kernels, Q4_1, max_native_rows=4)
    assert lin.large is not None
    assert torch.equal(lin(small), cpu_kernels.quant_linear(small, lin.qweight, lin.bias_f32))
    assert torch.equal(lin(large), lin.large(large))
    # Both stand for the Q4_1 blocks' weight: fp16 weights (large) and 15-bit
    # activation codes (native) nearly exactly.
    for x in (small, large):
        exact = x @ dequantize(lin.qweight).T + bias
        assert float((lin(x) - exact).abs().max()) < 2e-3 * float(exact.abs().max())


def test_portable_half_cache_matches_f16c(
    cpu_kernels: CpuKernels, scalar_cpu_kernels: CpuKernels
) -> None:
    """The portable float <-> half code (no F16C) stores the same bits and reads
    the same values as the F16C instructions, including rounding ties, tiny
    (subnormal) and huge (overflowing) keys."""
    b = make_batch([1, 1, 1], [5, 20, 9], num_heads=4, num_kv_heads=2, head_dim=32, seed=5)
    if b.q.device.type != "cpu":
        pytest.skip("the batch helper built device tensors")
    qkv, q, k, v = _fused_qkv(b)
    hq = 4 * 32
    qkv[0, hq : hq + 4] = torch.tensor(
        [1e-7, 3e-8, 7e4, 1.0 + 2.0**-11]
    )  # subnormal, tiny, inf, tie
    outs, caches = [], []
    for kern in (cpu_kernels, scalar_cpu_kernels):
        kc, vc = b.k_cache.half(), b.v_cache.half()
        m = b.meta
        outs.append(
            kern.paged_decode_store_attention(
                q, k, v, kc, vc, m.slot_mapping, m.block_tables, m.seq_lens, b.scale
            )
        )
        caches.append((kc, vc))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    slot = int(b.meta.slot_mapping[0])
    stored = caches[0][0].view(-1, 2 * 32)[slot, :4]
    assert torch.equal(stored, torch.tensor([1e-7, 3e-8, 7e4, 1.0 + 2.0**-11]).half())
    # inf in a key makes that sequence's scores inf/nan in both builds alike
    torch.testing.assert_close(outs[0][1:], outs[1][1:], rtol=1e-5, atol=1e-5)


def test_cpu_split_k_with_short_neighbours(cpu_kernels: CpuKernels) -> None:
    """More threads than sequences, one long: every sequence is split into one
    key range per thread, so the short one gets empty ranges, which the merge
    must skip (threads oversubscribed on purpose; results do not depend on it)."""
    b = make_batch([1, 1], [300, 3], num_heads=4, num_kv_heads=2, head_dim=32, seed=8)
    if b.q.device.type != "cpu":
        pytest.skip("the batch helper built device tensors")
    _, q, k, v = _fused_qkv(b)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        m = b.meta
        got = cpu_kernels.paged_decode_store_attention(
            q, k, v, b.k_cache, b.v_cache, m.slot_mapping, m.block_tables, m.seq_lens, b.scale
        )
    finally:
        torch.set_num_threads(before)
    from engine.attention.torch_backend import store_kv

    store_kv(b.k, b.v, kc, vc, b.meta.slot_mapping)
    qsl = torch.arange(3, dtype=torch.int32)
    want = paged_attention_ref(
        b.q, kc, vc, b.meta.block_tables, b.meta.seq_lens, qsl, 1, 300, b.scale, 2
    )
    _assert_close(got, want, torch.float32)


def test_x16_layout_needs_the_vnni_build(
    vnni_cpu_kernels: CpuKernels, avx2_cpu_kernels: CpuKernels
) -> None:
    """x16-interleaved blocks are read by the VNNI build and refused (not
    misread) by the others; the strategy picks the layout its build reads."""
    from engine.models.linear import BlockQuantLinears

    qw = pack_x16(quantize_q4_1(torch.randn(16, 64)))
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x16"):
        avx2_cpu_kernels.quant_linear(x, qw)
    assert BlockQuantLinears(vnni_cpu_kernels, Q4_1).layout == X16
    assert BlockQuantLinears(avx2_cpu_kernels, Q4_1).layout == ROWS
    assert BlockQuantLinears(avx2_cpu_kernels, Q4_1).max_native_rows == 8


# ------------------------------------------------------------------ fused MoE


def _moe_case(
    t: int, h: int, i: int, e: int, k: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Routed-expert inputs on DEVICE: every token on k distinct experts, one slot dropped."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[min(1, t - 1), -1] = -1  # a dropped slot adds nothing
    w = torch.rand(t, k, generator=g)
    return tuple(a.to(DEVICE) for a in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, w))


def test_moe_align_groups_slots_by_expert() -> None:
    ids = torch.tensor([[2, 0], [0, -1], [2, 1], [0, 2]], device=DEVICE)
    slots, blocks = moe_align(ids, 4, 4)
    pad = ids.numel()
    # Expert 0: slots 1, 2, 6; expert 1: slot 5; expert 2: slots 0, 4, 7; each padded
    # to a 4-row block; the block count is the no-sync upper bound (8 + 4 * 3) / 4.
    want = [1, 2, 6, pad, 5, pad, pad, pad, 0, 4, 7, pad] + [pad] * 8
    assert slots.tolist() == want
    assert blocks.tolist() == [0, 1, 2, -1, -1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("t", "h", "i", "e", "k"), [(7, 48, 40, 5, 2), (1, 32, 16, 4, 1), (19, 64, 32, 8, 3)]
)
def test_fused_moe_matches_reference(
    dtype: torch.dtype, t: int, h: int, i: int, e: int, k: int
) -> None:
    """Gather, grouped GEMMs with SiLU-and-mul, weighted scatter vs every slot on its own
    (ragged sizes: H and I not multiples of the tiles, experts with no tokens)."""
    x, w13, w2, ids, w = _moe_case(t, h, i, e, k, dtype)
    ref = fused_moe_ref(x, w13, w2, ids, w).float()
    got = fused_moe.fused_moe(x, w13, w2, ids, w)
    assert got.dtype == dtype and got.shape == (t, h)
    atol, rtol = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3)}.get(dtype, (3e-2, 3e-2))
    torch.testing.assert_close(got.float(), ref, atol=atol, rtol=rtol)


# ------------------------------------------------------------------ RoPE position shift


def _cos_sin(rope_scaling: dict[str, Any] | None, head_dim: int, max_pos: int) -> torch.Tensor:
    """The model's own cos|sin table (engine/models/llama.py) for a tiny config."""
    from engine.models.config import ModelConfig
    from engine.models.llama import RotaryEmbedding

    cfg = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=head_dim * 2,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=500000.0 if rope_scaling else 10000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
    )
    return RotaryEmbedding(cfg).cos_sin_cache


_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short: all three frequency bands occur
}


@pytest.mark.parametrize("scaling", [None, _LLAMA3], ids=["plain", "llama3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_shift_matches_keys_rotated_at_new_positions(
    scaling: dict[str, Any] | None, dtype: torch.dtype
) -> None:
    """Keys rotated at p, shifted to p' in place (Triton and the torch reference),
    equal the raw keys rotated at p' directly; untouched slots stay as they were."""
    from engine.models.ops import apply_rope
    from kernels.rope_shift import rope_shift_paged, rope_shift_paged_ref

    gen = torch.Generator().manual_seed(5)
    nb, bs, hkv, d, max_pos = 5, 4, 3, 32, 512
    table = _cos_sin(scaling, d, max_pos)
    raw = torch.randn(nb * bs, hkv, d, generator=gen)
    old = torch.randint(0, max_pos, (nb * bs,), generator=gen)
    new = torch.randint(0, max_pos, (nb * bs,), generator=gen)

    def rotated(pos: torch.Tensor) -> torch.Tensor:
        cos, sin = table[pos].unsqueeze(1).chunk(2, dim=-1)
        return apply_rope(raw, cos, sin)

    cache = rotated(old).view(nb, bs, hkv, d).to(dtype)
    slots = torch.tensor([3, 0, 17, 9, 12, 5])  # a subset, out of order
    want = cache.clone().view(nb * bs, hkv, d)
    want[slots] = rotated(new)[slots].to(dtype)
    for fn in (rope_shift_paged, rope_shift_paged_ref):
        got = cache.clone().to(DEVICE)
        fn(got, slots.to(DEVICE), old[slots].to(DEVICE), new[slots].to(DEVICE), table.to(DEVICE))
        # Shifting costs one rounding to the cache dtype: fp32 ~1e-6; fp16/bf16
        # the dtype's ulp of O(1) keys (the shift itself is computed in fp32).
        atol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(got.view(nb * bs, hkv, d).cpu(), want, rtol=0, atol=atol)


def test_rope_shift_rejects_positions_outside_the_table() -> None:
    from kernels.rope_shift import rope_shift_paged_ref

    cache = torch.zeros(1, 4, 1, 8)
    table = torch.zeros(16, 8)
    with pytest.raises(ValueError, match="outside"):
        rope_shift_paged_ref(cache, torch.tensor([0]), torch.tensor([0]), torch.tensor([16]), table)
    with pytest.raises(ValueError, match="head_dim"):
        rope_shift_paged_ref(
            cache, torch.tensor([0]), torch.tensor([0]), torch.tensor([1]), table[:, :4]
        )


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_portable_build_fast_decode_attention_matches_ref(
    scalar_cpu_kernels: CpuKernels, cache_dtype: torch.dtype
) -> None:
    """The fast decode body (head sizes a multiple of 64) built without AVX2 and
    F16C: the portable vector code and half conversions, blocks straddled."""
    b = make_batch([1, 1], [131, 20], num_heads=6, num_kv_heads=2, head_dim=64, block_size=12)
    if b.q.device.type != "cpu":
        pytest.skip("the batch helper built device tensors")
    q, kc, vc = b.q, b.k_cache.to(cache_dtype), b.v_cache.to(cache_dtype)
    m = b.meta
    got = scalar_cpu_kernels.paged_decode_attention(q, kc, vc, m.block_tables, m.seq_lens, b.scale)
    args = (q, kc.float(), vc.float(), m.block_tables, m.seq_lens, m.query_start_loc, 1, 131)
    want = paged_attention_ref(*args, b.scale, 2)
    _assert_close(got, want, torch.float32)
