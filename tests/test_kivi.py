"""KIVI 2-/4-bit KV blocks: quantization bounds, the paged store, and every
attention path over quantized blocks against the from-scratch reference."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the Triton test runs under the interpreter (see test_kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.attention.torch_backend import TorchAttentionBackend
from kernels.kivi import (
    KiviLayout,
    dequantize_blocks,
    kivi_attention_dense_ref,
    pack_codes,
    quantize_key_groups,
    quantize_value_groups,
    side_views,
    unpack_codes,
)
from tests.kivi_sim import KiviSim

SCALE = 0.25


def layout(
    bits: int,
    group: int = 4,
    block: int = 8,
    heads: int = 2,
    dim: int = 16,
    ring: int = 1,
    sink: bool = False,
) -> KiviLayout:
    return KiviLayout(bits, group, min(group, dim), block, heads, dim, ring, sink)


# Float16 windows: the query's own group only; three groups (reaching back into
# the previous block); one group plus sinks; two groups plus sinks (every
# slot of a 16-token block of groups of 4 but one).
WINDOWS = [(1, False), (3, False), (1, True), (2, True)]


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trip(bits: int) -> None:
    codes = torch.randint(0, 1 << bits, (3, 5, 16), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)
    # Channel c sits at bits (c % per) * bits of byte c // per.
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 1] = 1
    assert pack_codes(one, bits)[0, 0].item() == 1 << bits


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_round_trip_within_bound(bits: int) -> None:
    lay = layout(bits)
    x = (torch.randn(6, 4, 2, 16) * 3).half()
    x[0, :, 0, 0] = 1.5  # a constant channel: scale 0, exact
    codes, s, z = quantize_key_groups(x, lay)
    deq = unpack_codes(codes, bits).float() * s.float()[:, None] + z.float()[:, None]
    # |x - deq| <= scale / 2 plus the float16 rounding of the zero point and scale.
    xf = x.float()
    lo = xf.amin(1, keepdim=True)
    bound = s.float()[:, None] / 2 + (lo.abs() + xf.abs()) * 2e-3 + 1e-6
    assert bool(((xf - deq).abs() <= bound).all())
    assert torch.equal(deq[0, :, 0, 0], torch.full((4,), 1.5))
    vc, vs, vz = quantize_value_groups(x, lay)
    vdeq = (
        unpack_codes(vc, bits).float().unflatten(-1, (-1, lay.value_group)) * vs.float()[..., None]
        + vz.float()[..., None]
    ).flatten(-2)
    vbound = vs.float().repeat_interleave(lay.value_group, -1) / 2 + xf.abs() * 4e-3 + 1e-6
    assert bool(((xf - vdeq).abs() <= vbound).all())
    # 4-bit is tighter than 2-bit on the same data.
    if bits == 4:
        c2, s2, z2 = quantize_key_groups(x, layout(2))
        d2 = unpack_codes(c2, 2).float() * s2.float()[:, None] + z2.float()[:, None]
        assert (xf - deq).abs().mean() < (xf - d2).abs().mean() / 3


def test_layout_refuses_bad_shapes() -> None:
    with pytest.raises(ValueError, match="divide the block size"):
        KiviLayout(4, 32, 32, 16, 2, 64)
    with pytest.raises(ValueError, match="bits"):
        KiviLayout(3, 4, 4, 8, 2, 16)
    # Four window groups of 8 and the sink group take 40 rows: not in 32.
    with pytest.raises(ValueError, match="must fit in a block"):
        KiviLayout(2, 8, 32, 32, 1, 64, ring_groups=4, sink=True)


def test_window_and_sinks_read_float16_where_the_rule_says() -> None:
    """The read rule itself: a wider window or sinks change exactly the keys read
    at float16 (a query's output moves towards the float16 answer), and the
    slot of each group is where the module doc says."""
    gen = torch.Generator().manual_seed(5)
    n, g = 24, 4
    k = (torch.randn(n, 2, 16, generator=gen) * 3).half()
    v = torch.randn(n, 2, 16, generator=gen).half()
    q = torch.randn(1, 4, 16, generator=gen)
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(1, 4, 1, 16),  # [batch, q heads, one query, head size]
        k.float().transpose(0, 1).unsqueeze(0),
        v.float().transpose(0, 1).unsqueeze(0),
        scale=SCALE,
        enable_gqa=True,
    ).reshape(1, 4, 16)
    errs = {}
    for ring, sink in [(1, False), (3, False), (1, True), (6, False)]:
        lay = KiviLayout(2, g, g, 32, 2, 16, ring_groups=ring, sink=sink)
        out = kivi_attention_dense_ref(q, k, v, lay, SCALE, n - 1)
        errs[(ring, sink)] = float((out - exact).abs().max())
    # The whole sequence in the window: nothing is quantized.
    assert errs[(6, False)] < 1e-5
    assert errs[(3, False)] < errs[(1, False)] and errs[(1, True)] < errs[(1, False)]
    lay = KiviLayout(2, g, g, 32, 2, 16, ring_groups=3, sink=True)
    assert lay.slot_of_group(torch.arange(8)).tolist() == [0, 1, 2, 3, 1, 2, 3, 1]
    assert lay.window_start(23) == 12 and lay.window_start(7) == 0


# Float paths stay within float rounding of the reference. The native
# kernel's integer body (CpuKernels.kivi_integer_body) rounds q s and p s to
# 16 bits, which moves outputs of these shapes by up to ~2e-3 (measured: 1.6e-3
# at most, 2-bit, head size 64); a wrong row or group read moves them by ~0.1.
FLOAT_TOL = (2e-5, 1e-4)
INT_TOL = (4e-3, 1e-3)


def _tol(kernels: object, lay: KiviLayout) -> tuple[float, float]:
    return INT_TOL if kernels.kivi_integer_body(lay) else FLOAT_TOL  # type: ignore[attr-defined]


def _run(
    backend: TorchAttentionBackend,
    sim: KiviSim,
    plan: list[list[tuple[int, int]]],
    tol: tuple[float, float] = FLOAT_TOL,
) -> None:
    """Run the steps through ``backend`` and check each against the dense reference."""
    for chunks in plan:
        starts = [sim.seqs[i].done for i, _ in chunks]
        q, k, v, meta = sim.step(chunks)
        out = backend.forward(q, k, v, sim.k_cache, sim.v_cache, meta, SCALE)
        for row, (i, n) in enumerate(chunks):
            s = sim.seqs[i]
            end = starts[row] + n
            want = kivi_attention_dense_ref(
                s.q[starts[row] : end],
                s.k[:end].half(),
                s.v[:end].half(),
                sim.lay,
                SCALE,
                starts[row],
            )
            a, b = meta.query_start_loc_cpu[row], meta.query_start_loc_cpu[row + 1]
            torch.testing.assert_close(out[a:b], want, atol=tol[0], rtol=tol[1])


# Mixed steps: decodes first, then prefill/extend chunks that start and end
# inside groups, cross block boundaries and complete several groups of one block.
PLAN = [
    [(0, 5), (1, 11), (2, 3)],
    [(2, 1), (0, 6), (1, 9)],
    [(0, 1), (1, 1), (2, 1), (3, 17)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(3, 1), (0, 7), (2, 12)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize(("ring", "sink"), WINDOWS)
def test_torch_reference_paged_matches_dense(bits: int, ring: int, sink: bool) -> None:
    block = 8 if ring + sink <= 2 else 16
    sim = KiviSim.make(layout(bits, block=block, ring=ring, sink=sink), 4, [40, 40, 40, 40])
    _run(TorchAttentionBackend(), sim, PLAN)


@pytest.mark.parametrize(("ring", "sink"), WINDOWS)
def test_full_block_bytes_do_not_depend_on_chunking(ring: int, sink: bool) -> None:
    """A full block's bytes are the same whether its tokens came one by one or
    in chunks (what makes hashed blocks shareable and immutable)."""
    lay = layout(4, block=8 if ring + sink <= 2 else 16, ring=ring, sink=sink)
    a = KiviSim.make(lay, 2, [16], seed=3)
    b = KiviSim.make(lay, 2, [16], seed=3)
    for _ in range(16):
        a.store(*_kv(a, [(0, 1)]))
    for n in (3, 10, 3):
        b.store(*_kv(b, [(0, n)]))
    for blk in a.seqs[0].blocks:
        assert torch.equal(a.k_cache[blk], b.k_cache[blk])
        assert torch.equal(a.v_cache[blk], b.v_cache[blk])
    # And the codes are the quantization of the tokens.
    ks = side_views(a.k_cache, lay, True)
    blocks = torch.tensor(a.seqs[0].blocks)
    deq = dequantize_blocks(ks, blocks, lay, True)
    assert (deq - a.seqs[0].k.half().float()).abs().max() < 1.0


def _kv(sim: KiviSim, chunks: list[tuple[int, int]]) -> tuple:
    _, k, v, meta = sim.step(chunks)
    return k, v, meta


@pytest.fixture(scope="module")
def kernels() -> object:
    from kernels.cpu_native import CpuKernels

    return CpuKernels.load()


@pytest.fixture(scope="module")
def portable_kernels(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The -mno-avx2 build: the portable unpack and half conversion paths."""
    from kernels.cpu_native import CpuKernels

    return CpuKernels.load(tmp_path_factory.mktemp("noavx2"), ("-mno-avx2", "-mno-f16c"))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("which", ["kernels", "portable_kernels"])
@pytest.mark.parametrize("dim", [16, 64])
@pytest.mark.parametrize(("ring", "sink"), WINDOWS)
def test_native_decode_matches_dense(
    bits: int, which: str, dim: int, ring: int, sink: bool, request: pytest.FixtureRequest
) -> None:
    """The native backend (C decodes, torch extends) on mixed steps, GQA 4:2,
    against the from-scratch reference; head size 64 also runs the vector
    unpack loops, 16 the tails."""
    from engine.attention.cpu_backend import CpuNativeAttentionBackend

    kern = request.getfixturevalue(which)
    backend = CpuNativeAttentionBackend(kern)
    block = 8 if ring + sink <= 2 else 16
    lay = layout(bits, block=block, dim=dim, ring=ring, sink=sink)
    sim = KiviSim.make(lay, num_heads=4, lengths=[40, 40, 40, 40], seed=bits)
    _run(backend, sim, PLAN, _tol(kern, lay))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize(("dim", "vgroup"), [(64, 32), (64, 64), (128, 32), (128, 128)])
@pytest.mark.parametrize(("ring", "sink"), WINDOWS)
def test_native_integer_body_matches_dense(
    kernels: object, bits: int, dim: int, vgroup: int, ring: int, sink: bool
) -> None:
    """The integer body (cpu_kivi.c) on every layout it takes: 32-channel value
    groups (two per 64-channel chunk) and whole-chunk ones, one and two chunks
    per row, groups of 4 (a 64-row segment spans 17 of them: the gathered
    scales), blocks of 8 and 16 (segments cross blocks), GQA 4:2, mixed steps
    and a long sequence past several segments, split across threads."""
    from engine.attention.cpu_backend import CpuNativeAttentionBackend

    lay = KiviLayout(bits, 4, vgroup, 8 if ring + sink <= 2 else 16, 2, dim, ring, sink)
    if not kernels.kivi_integer_body(lay):  # type: ignore[attr-defined]
        pytest.skip("this build has no integer body (AVX-512 VNNI)")
    backend = CpuNativeAttentionBackend(kernels)  # type: ignore[arg-type]
    sim = KiviSim.make(lay, num_heads=4, lengths=[40, 40, 40, 40], seed=bits + dim)
    _run(backend, sim, PLAN, INT_TOL)
    sim = KiviSim.make(lay, num_heads=4, lengths=[260, 30], seed=dim - bits)
    plan = [[(0, 200), (1, 27)]] + [[(0, 1), (1, 1)] for _ in range(3)] + [[(0, 57)]]
    torch.set_num_threads(2)
    _run(backend, sim, plan, INT_TOL)


def test_native_decode_split_k_long_context(kernels: object) -> None:
    """One long sequence (split across threads) and a short one, 2-bit, groups
    of 32 in 64-token blocks (the engine's shapes), decoding past a group end."""

    lay = KiviLayout(2, 32, 32, 64, 1, 64)
    _split_k(kernels, lay)


def test_native_decode_split_k_window_and_sinks(kernels: object) -> None:
    """The same with the engine's kivi2 window: groups of 8, a window of four
    groups and the sink group in 64-token blocks."""
    _split_k(kernels, KiviLayout(2, 8, 32, 64, 1, 64, ring_groups=4, sink=True))


def test_native_decode_groups_longer_than_a_segment(kernels: object) -> None:
    """Groups of 128 tokens: the fast body scores a group in several scratch
    segments (KIVI_SEG, cpu_kivi.c) with one set of scales; 4-bit, a window of
    two groups, head size 64."""
    _split_k(kernels, KiviLayout(4, 128, 32, 256, 1, 64, ring_groups=2))


def _split_k(kernels: object, lay: KiviLayout) -> None:
    from engine.attention.cpu_backend import CpuNativeAttentionBackend

    sim = KiviSim.make(lay, num_heads=3, lengths=[400, 40], seed=7)
    plan = [[(0, 300), (1, 30)]] + [[(0, 1), (1, 1)] for _ in range(4)]
    plan += [[(0, 60)]] + [[(0, 1), (1, 1)] for _ in range(3)]
    torch.set_num_threads(2)
    _run(CpuNativeAttentionBackend(kernels), sim, plan, _tol(kernels, lay))  # type: ignore[arg-type]


@pytest.mark.parametrize(("bits", "group", "ring", "sink"), [(4, 32, 1, False), (2, 8, 4, True)])
def test_integer_body_rounding_is_small_next_to_the_format(
    kernels: object, portable_kernels: object, bits: int, group: int, ring: int, sink: bool
) -> None:
    """The integer body's 16-bit rounding (cpu_kivi.c) against the format's own
    error, at the engine's shapes (head size 64, GQA 3:1, each format's default
    groups and window), over a 300-token prefill and decodes: its distance from
    the float body, on average and at worst, is under a hundredth of the
    distance between KIVI attention and attention over the float16 tokens
    themselves."""
    from engine.attention.cpu_backend import CpuNativeAttentionBackend

    lay = KiviLayout(bits, group, 32, 256, 1, 64, ring_groups=ring, sink=sink)
    if not kernels.kivi_integer_body(lay):  # type: ignore[attr-defined]
        pytest.skip("this build has no integer body (AVX-512 VNNI)")
    assert not portable_kernels.kivi_integer_body(lay)  # type: ignore[attr-defined]
    plan = [[(0, 300)]] + [[(0, 1)] for _ in range(6)]
    outs = []
    for kern in (kernels, portable_kernels):
        sim = KiviSim.make(lay, num_heads=3, lengths=[306], seed=21)
        backend = CpuNativeAttentionBackend(kern)  # type: ignore[arg-type]
        rows = []
        for chunks in plan:
            q, k, v, meta = sim.step(chunks)
            rows.append(backend.forward(q, k, v, sim.k_cache, sim.v_cache, meta, SCALE))
        outs.append(torch.cat(rows))
    seq = KiviSim.make(lay, num_heads=3, lengths=[306], seed=21).seqs[0]
    exact = torch.nn.functional.scaled_dot_product_attention(
        seq.q.transpose(0, 1).unsqueeze(0),  # [1, q heads, L, D]
        seq.k.half().float().transpose(0, 1).unsqueeze(0),
        seq.v.half().float().transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=SCALE,
        enable_gqa=True,
    )[0].transpose(0, 1)
    rounding = (outs[0] - outs[1]).abs()
    fmt = (outs[1] - exact).abs()
    # Measured: rounding 6e-5-7e-5 mean, 2e-3 at most; the format 0.04-0.14 mean, 0.7-1.5 at most.
    assert float(rounding.mean()) < float(fmt.mean()) / 100
    assert float(rounding.max()) < float(fmt.max()) / 100


class _TritonAsBackend(TorchAttentionBackend):
    """The Triton backend's KIVI path (store + kernel) behind the test driver."""

    def __init__(self) -> None:
        super().__init__()
        from engine.attention.triton_backend import TritonAttentionBackend

        self.triton = TritonAttentionBackend()

    def forward(self, q, k, v, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        return self.triton.forward(q, k, v, k_cache, v_cache, meta, scale)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize(("ring", "sink"), WINDOWS)
def test_triton_kivi_matches_dense(bits: int, ring: int, sink: bool) -> None:
    """The Triton kernel (under TRITON_INTERPRET=1 on the CPU) on mixed steps, GQA."""
    pytest.importorskip("triton")
    block = 8 if ring + sink <= 2 else 16
    lay = layout(bits, block=block, ring=ring, sink=sink)
    sim = KiviSim.make(lay, num_heads=4, lengths=[40, 40, 40, 40], seed=11 + bits)
    _run(_TritonAsBackend(), sim, PLAN[:4])
