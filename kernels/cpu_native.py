"""Native CPU kernels (C + OpenMP), built on first use and loaded with ctypes.

Why C and not Triton here: Triton has no CPU backend outside its interpreter,
and on CPU the torch path for paged decode attention spends most of its time
gathering every sequence's whole context out of the paged cache (one copy per
layer per step) and then re-reading it in a masked SDPA. The kernel in
``csrc/cpu_attention.c`` reads K and V once, in place, through the block
table. No PyPI package offers CPU paged attention for this cache layout on
this torch version, so it is ours; its reference is
``kernels.paged_attention.paged_attention_ref``, and tests compare the two.

Building: ``cc -O3 -march=native -fopenmp`` into a cache directory keyed by
the source, the flags, the compiler's version and the CPU's feature flags
(``-march=native`` code must not run on another CPU). The build takes well
under a second and is written atomically, so concurrent servers are safe. The
library links ``libgomp.so.1``; torch has already loaded its own copy under
that soname, so both share one OpenMP runtime and one thread pool.

No module-level state: :meth:`CpuKernels.load` returns an object that the
caller (an attention backend) keeps.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.kivi import KiviLayout
from kernels.quant_linear import Q4_1, QuantWeight

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / "cpu_attention.c",
    Path(__file__).parent / "csrc" / "cpu_ops.c",
    Path(__file__).parent / "csrc" / "cpu_quant.c",
    Path(__file__).parent / "csrc" / "cpu_step.c",
    Path(__file__).parent / "csrc" / "cpu_kivi.c",
]
# Included by the sources: part of the build key.
_HEADERS = [
    Path(__file__).parent / "csrc" / "fuel_half.h",
    Path(__file__).parent / "csrc" / "fuel_internal.h",
    Path(__file__).parent / "csrc" / "fuel_vec.h",
]
# KV cache element types the attention kernels read (float16: converted as read).
_CACHE_DTYPES = (torch.float32, torch.float16)
# fuel_quant_caps() bits: which integer-dot code path this build has.
QUANT_CAPS_AVX2 = 1
QUANT_CAPS_VNNI512 = 2
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


class _QWeight(ctypes.Structure):
    """fuel_qweight (csrc/fuel_internal.h)."""

    _fields_ = [
        ("qs", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("qtype", ctypes.c_int32),
        ("layout", ctypes.c_int32),
    ]


class _Layer(ctypes.Structure):
    """fuel_layer (csrc/cpu_step.c)."""

    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        ("qkv", _QWeight),
        ("o", _QWeight),
        ("gate_up", _QWeight),
        ("down", _QWeight),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _Kivi(ctypes.Structure):
    """fuel_kivi (csrc/fuel_internal.h): a KIVI layout's numbers."""

    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "bits",
            "group",
            "vgroup",
            "ring",
            "sink",
            "kside",
            "vside",
            "scale_off",
            "kzero_off",
            "vzero_off",
            "kresid_off",
            "vresid_off",
        )
    ]

    @classmethod
    def of(cls, lay: KiviLayout) -> _Kivi:
        return cls(
            lay.bits,
            lay.group_size,
            lay.value_group,
            lay.ring_groups,
            int(lay.sink),
            *lay.kernel_offsets(),
        )


class _Model(ctypes.Structure):
    """fuel_model (csrc/cpu_step.c)."""

    _fields_ = [
        ("n_layers", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("n_heads", ctypes.c_int64),
        ("n_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("block_size", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("kv_half", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("cos_sin", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("layers", ctypes.POINTER(_Layer)),
        ("kivi", ctypes.POINTER(_Kivi)),
    ]


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's tensors for :meth:`CpuKernels.decode_step_plan`.

    Norm weights float32 ``[H]``; ``qkv`` ``[(hq + 2 hkv) d, H]`` (q rows, then
    k, then v), ``o`` ``[H, hq d]``, ``gate_up`` ``[2 I, H]`` (gate rows, then
    up), ``down`` ``[H, I]``, all in one block format; biases float32 or None;
    the layer's KV cache ``[num_blocks, bs, hkv, d]`` (float32 or float16), or
    KIVI caches ``uint8 [num_blocks, layout.k.nbytes]`` / ``[.., layout.v.nbytes]``.
    """

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: QuantWeight
    qkv_bias: torch.Tensor | None
    o: QuantWeight
    o_bias: torch.Tensor | None
    gate_up: QuantWeight
    down: QuantWeight
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class DecodeStepPlan:
    """The native view of a model for :meth:`CpuKernels.decode_step`: raw
    pointers into the tensors handed to ``decode_step_plan``, which this
    object keeps alive. Valid while those tensors are neither moved nor
    resized (the engine never does either after start-up)."""

    def __init__(
        self,
        model: _Model,
        layers: ctypes.Array[_Layer],
        keep: list[object],
        shapes: dict[str, int],
    ) -> None:
        self.model = model
        self._layers = layers
        self._keep = keep
        self.hidden = shapes["hidden"]
        self.max_positions = shapes["max_positions"]
        self.num_slots = shapes["num_slots"]


class NativeBuildError(RuntimeError):
    """The native kernels could not be built or loaded here (no compiler, say)."""


def default_cache_dir() -> Path:
    """Where built libraries go, computed when called (never at import)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fuel-serve" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    flags = [*_FLAGS, *extra_flags]
    if cc is None:
        raise NativeBuildError("no C compiler (cc/gcc) on PATH")
    source = b"\0".join(src.read_bytes() for src in [*_SOURCES, *_HEADERS])
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(f"{cc} --version failed: {e}") from e
    key = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_flags().encode()])
    ).hexdigest()[:24]
    lib = cache_dir / f"fuel_cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, *(str(src) for src in _SOURCES), "-o", tmp, "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise NativeBuildError(f"compiling the native kernels failed:\n{proc.stderr.strip()}")
        os.replace(tmp, lib)  # atomic: a concurrent loader sees the old state or the whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _decode_plan_checks(
    layers: list[DecodeLayer],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos_sin: torch.Tensor,
    final_norm: torch.Tensor,
    kv_layout: KiviLayout | None = None,
) -> list[tuple[bool, str]]:
    """(holds, what it needs) for every layout fact ``fuel_decode_step_f32`` reads."""
    hidden = int(final_norm.shape[0])
    qtype, layout = layers[0].qkv.qtype, layers[0].qkv.layout
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    inter = layers[0].down.in_features
    kc0 = layers[0].k_cache
    checks: list[tuple[bool, str]] = [
        (num_kv_heads > 0 and num_heads % num_kv_heads == 0, "q heads a multiple of kv heads"),
        (head_dim % 2 == 0, "an even head_dim"),
        (
            cos_sin.dtype == torch.float32
            and cos_sin.is_contiguous()
            and cos_sin.dim() == 2
            and cos_sin.shape[1] == head_dim,
            "a contiguous float32 [max_pos, head_dim] cos|sin table",
        ),
    ]
    if kv_layout is None:
        checks.append(
            (
                kc0.dtype in _CACHE_DTYPES and kc0.dim() == 4,
                "float32/float16 [nb, bs, hkv, d] caches",
            )
        )
    else:
        kl = kv_layout
        checks.append(
            (
                (kl.num_kv_heads, kl.head_dim) == (num_kv_heads, head_dim)
                and all(
                    c.dtype == torch.uint8 and c.dim() == 2 and c.shape[1] == n
                    for x in layers
                    for c, n in ((x.k_cache, kl.k.nbytes), (x.v_cache, kl.v.nbytes))
                ),
                f"uint8 [nb, {kl.k.nbytes}] / [nb, {kl.v.nbytes}] KIVI caches of the layout",
            )
        )
    for i, lay in enumerate(layers):
        shapes = [
            (lay.qkv, q_size + 2 * kv_size, hidden),
            (lay.o, hidden, q_size),
            (lay.gate_up, 2 * inter, hidden),
            (lay.down, hidden, inter),
        ]
        checks.append(
            (
                all(
                    w.qtype == qtype
                    and w.layout == layout
                    and (w.out_features, w.in_features) == (n, k)
                    for w, n, k in shapes
                ),
                f"layer {i}: one block format and layout, Llama-shaped projections",
            )
        )
        vectors = [lay.attn_norm, lay.ffn_norm, final_norm]
        for b, n in ((lay.qkv_bias, q_size + 2 * kv_size), (lay.o_bias, hidden)):
            if b is not None:
                vectors.append(b)
                checks.append((tuple(b.shape) == (n,), f"layer {i}: bias shapes"))
        checks.append(
            (
                all(
                    v.dtype == torch.float32 and v.is_contiguous() and v.device.type == "cpu"
                    for v in vectors
                )
                and all(tuple(v.shape) == (hidden,) for v in (lay.attn_norm, lay.ffn_norm)),
                f"layer {i}: contiguous float32 norm weights and biases",
            )
        )
        checks.append(
            (
                lay.k_cache.shape[0] == lay.v_cache.shape[0] == kc0.shape[0]
                and (kv_layout is not None or lay.k_cache.shape == lay.v_cache.shape == kc0.shape)
                and lay.k_cache.dtype == lay.v_cache.dtype == kc0.dtype
                and lay.k_cache.is_contiguous()
                and lay.v_cache.is_contiguous()
                and (kv_layout is not None or tuple(kc0.shape[2:]) == (num_kv_heads, head_dim)),
                f"layer {i}: contiguous caches like layer 0's",
            )
        )
    return checks


def _require(kernel: str, checks: list[tuple[bool, str]]) -> None:
    """Raise ValueError naming the first unmet precondition: a native kernel must
    never be handed memory it would read wrongly."""
    for ok, what in checks:
        if not ok:
            raise ValueError(f"{kernel} needs {what}")


def _check_seq_lens(seq_lens: torch.Tensor, max_tokens: int) -> None:
    """Every sequence length in ``[1, max_tokens]`` (its block table's capacity)."""
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 1 or hi > max_tokens:
        raise ValueError("seq_lens must be in [1, max_blocks * block_size]")


class CpuKernels:
    """Handle on the loaded native library. Thread-safe: the kernels keep no state."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            # CDLL (not PyDLL): calls release the GIL while the kernel runs.
            self._lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeBuildError(f"loading {path} failed: {e}") from e
        fn = self._lib.fuel_paged_decode_attention_f32
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
        fn.argtypes += [ctypes.c_int]  # kv_half
        fn.restype = ctypes.c_int
        self._decode = fn
        fused = self._lib.fuel_paged_decode_store_attention_f32
        fused.argtypes = [p, i64, i64, i64, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64]
        fused.argtypes += [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        fused.restype = ctypes.c_int
        self._decode_store = fused
        kivi = self._lib.fuel_kivi_decode_attention_f32
        kivi.argtypes = [p, p, p, p, i64, p, p, *([i64] * 17), ctypes.c_float, ctypes.c_int]
        kivi.restype = ctypes.c_int
        self._kivi_decode = kivi
        self._kivi_integer = self._lib.fuel_kivi_integer_body
        self._kivi_integer.argtypes = [i64, i64]
        self._kivi_integer.restype = ctypes.c_int
        f32 = ctypes.c_float
        norm = self._lib.fuel_add_rms_norm_f32
        norm.argtypes = [p, p, p, p, i64, i64, f32, ctypes.c_int]
        norm.restype = None
        self._norm = norm
        rope = self._lib.fuel_rope_neox_f32
        rope.argtypes = [p, i64, i64, i64, i64, p, p, ctypes.c_int]
        rope.restype = None
        self._rope = rope
        silu = self._lib.fuel_silu_mul_f32
        silu.argtypes = [p, p, i64, i64, ctypes.c_int]
        silu.restype = None
        self._silu = silu
        ql = self._lib.fuel_quant_linear_f32
        ql.argtypes = [p, i64, i64, p, p, p, ctypes.c_int, i64, p, p, ctypes.c_int, ctypes.c_int]
        ql.restype = ctypes.c_int
        self._quant_linear = ql
        step = self._lib.fuel_decode_step_f32
        step.argtypes = [ctypes.POINTER(_Model), p, i64, p, p, p, i64, p, p, ctypes.c_int]
        step.restype = ctypes.c_int
        self._decode_step = step
        caps = self._lib.fuel_quant_caps
        caps.argtypes = []
        caps.restype = ctypes.c_int
        self.quant_caps = int(caps())

    @property
    def has_avx512_vnni(self) -> bool:
        """The block-quantized kernels use AVX-512 VNNI (else AVX2 or portable C)."""
        return bool(self.quant_caps & QUANT_CAPS_VNNI512)

    @classmethod
    def load(cls, cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> CpuKernels:
        """Build (once per machine and source) and load the library.

        ``extra_flags`` go to the compiler after the defaults (tests build a
        ``-mno-avx2`` variant to exercise the portable code paths).

        Raises:
            NativeBuildError: no compiler, a failed build, or a failed load.
        """
        return cls(_build(cache_dir if cache_dir is not None else default_cache_dir(), extra_flags))

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        num_threads: int | None = None,
        *,
        check_lengths: bool = True,
    ) -> torch.Tensor:
        """Attention of one new token per sequence over its cached context.

        Same contract as :func:`kernels.paged_attention.paged_attention_ref` with
        every query length 1 (its keys/values already stored): ``q`` ``[nd, Hq, D]``
        float32; caches ``[num_blocks, block_size, Hkv, D]`` float32 or float16
        (read as float32); ``block_tables``
        int32 ``[nd, >= ceil(max(seq_lens) / block_size)]``; ``seq_lens`` int32 ``[nd]``,
        each at least 1. Tensors must be contiguous CPU tensors (the kernel reads
        raw pointers); anything else raises ValueError rather than reading wrong memory.
        ``check_lengths=False`` skips the ``seq_lens`` bounds check (a host
        reduction) for a caller that has already checked the same lengths.
        """
        nd, hq, d = q.shape
        nb, bs, hkv, dk = k_cache.shape
        checks = [
            (
                q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in _CACHE_DTYPES,
                "float32 q and float32/float16 caches",
            ),
            (block_tables.dtype == seq_lens.dtype == torch.int32, "int32 tables and lengths"),
            (all(t.device.type == "cpu" for t in (q, k_cache, v_cache)), "CPU tensors"),
            (tuple(v_cache.shape) == (nb, bs, hkv, dk) and dk == d, "matching cache shapes"),
            (hkv > 0 and hq % hkv == 0, "q heads a multiple of kv heads"),
            (block_tables.dim() == 2 and block_tables.shape[0] == nd, "[nd, max_blocks] tables"),
            (tuple(seq_lens.shape) == (nd,), "[nd] seq_lens"),
            (
                all(t.is_contiguous() for t in (q, k_cache, v_cache, block_tables, seq_lens)),
                "contiguous tensors",
            ),
        ]
        _require("paged_decode_attention", checks)
        if check_lengths and nd:
            _check_seq_lens(seq_lens, block_tables.shape[1] * bs)
        res = torch.empty_like(q) if out is None else out
        if not (res.is_contiguous() and res.shape == q.shape and res.dtype == torch.float32):
            raise ValueError("out must be a contiguous float32 tensor shaped like q")
        if nd == 0:
            return res
        rc = self._decode(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            res.data_ptr(),
            nd,
            hq,
            hkv,
            d,
            bs,
            scale,
            num_threads if num_threads is not None else torch.get_num_threads(),
            int(k_cache.dtype == torch.float16),
        )
        if rc != 0:
            raise MemoryError("paged_decode_attention: scratch allocation failed")
        return res

    def kivi_integer_body(self, layout: KiviLayout) -> bool:
        """Whether :meth:`kivi_decode_attention` reads ``layout``'s quantized rows
        with its integer body (csrc/cpu_kivi.c: AVX-512 VNNI builds, head sizes
        that are multiples of 64, value groups of 32 or a multiple of 64). That
        body rounds q s (keys) and p s (values) to 16 bits, so it departs from
        :func:`kernels.kivi.kivi_attention_ref` by more than float rounding
        (about 1e-3 of the outputs at the tests' shapes); elsewhere the float
        body stays within float rounding of it."""
        return bool(self._kivi_integer(layout.head_dim, layout.value_group))

    def kivi_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        layout: KiviLayout,
        scale: float,
        *,
        check_lengths: bool = True,
    ) -> torch.Tensor:
        """Decode attention (one query per sequence, its key/value stored) over KIVI
        blocks read in place (csrc/cpu_kivi.c). Same result as
        :func:`kernels.kivi.kivi_attention_ref` on each sequence, within float
        rounding or, with the integer body (:meth:`kivi_integer_body`), within its
        16-bit rounding of q s and p s; ``q`` float32
        ``[nd, Hq, D]`` contiguous; caches ``uint8 [num_blocks, lay.k.nbytes]`` and
        ``[num_blocks, lay.v.nbytes]``;
        ``block_tables``/``seq_lens`` int32 as for :meth:`paged_decode_attention`.
        Anything else raises ValueError rather than reading wrong memory."""
        nd, hq, d = q.shape
        lay = layout
        checks = [
            (q.dtype == torch.float32 and q.is_contiguous(), "contiguous float32 q"),
            (
                all(
                    c.dtype == torch.uint8
                    and c.is_contiguous()
                    and c.dim() == 2
                    and c.shape[1] == n
                    for c, n in ((k_cache, lay.k.nbytes), (v_cache, lay.v.nbytes))
                ),
                f"contiguous uint8 [num_blocks, {lay.k.nbytes} / {lay.v.nbytes}] caches",
            ),
            (k_cache.shape[0] == v_cache.shape[0], "matching caches"),
            (d == lay.head_dim and hq % lay.num_kv_heads == 0, "q heads matching the layout"),
            (block_tables.dtype == seq_lens.dtype == torch.int32, "int32 tables and lengths"),
            (block_tables.dim() == 2 and block_tables.shape[0] == nd, "[nd, max_blocks] tables"),
            (tuple(seq_lens.shape) == (nd,), "[nd] seq_lens"),
            (block_tables.is_contiguous() and seq_lens.is_contiguous(), "contiguous tables"),
            (all(t.device.type == "cpu" for t in (q, k_cache, v_cache)), "CPU tensors"),
        ]
        _require("kivi_decode_attention", checks)
        if check_lengths and nd:
            _check_seq_lens(seq_lens, block_tables.shape[1] * lay.block_size)
            bmax = int(block_tables.max()) if block_tables.numel() else 0
            if int(block_tables.min()) < 0 or bmax >= k_cache.shape[0]:
                raise ValueError("block ids out of range")
        res = torch.empty_like(q)
        if nd == 0:
            return res
        rc = self._kivi_decode(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            res.data_ptr(),
            nd,
            hq,
            lay.num_kv_heads,
            d,
            lay.block_size,
            lay.group_size,
            lay.value_group,
            lay.bits,
            lay.ring_groups,
            int(lay.sink),
            *lay.kernel_offsets(),
            scale,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise ValueError("kivi_decode_attention: the kernel refused the layout")
        if rc != 0:
            raise MemoryError("kivi_decode_attention: scratch allocation failed")
        return res

    def paged_decode_store_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        validate: bool = True,
    ) -> torch.Tensor:
        """Store each decode token's key/value in its slot, then attend: a whole
        decode-only step's attention for one layer in one call.

        ``q`` ``[nd, Hq, D]``, ``k``/``v`` ``[nd, Hkv, D]``: float32 views into one
        buffer whose rows share a stride (a fused qkv projection's output), each
        head contiguous. ``slot_mapping`` int64 ``[nd]`` (``-1``: not stored, a
        padding row), each below ``num_blocks * block_size``; a float16 cache
        stores them rounded to float16. The rest as in
        :meth:`paged_decode_attention`. ``validate`` checks layouts and the
        bounds of slots and lengths (host reductions): a caller may check once
        per step and pass ``False`` for the step's other layers. Returns
        ``[nd, Hq, D]`` contiguous.
        """
        nd, hq, d = q.shape
        nb, bs, hkv, dk = k_cache.shape
        base, item = q.data_ptr(), q.element_size()
        k_off, v_off = (k.data_ptr() - base) // item, (v.data_ptr() - base) // item
        row_stride = q.stride(0) if nd > 1 else 0
        if validate:
            ok = (
                q.dtype == k.dtype == v.dtype == torch.float32
                and k_cache.dtype == v_cache.dtype in _CACHE_DTYPES
                and all(t.device.type == "cpu" for t in (q, k, v, k_cache, v_cache))
                and tuple(k.shape) == tuple(v.shape) == (nd, hkv, d)
                and dk == d
                and tuple(v_cache.shape) == (nb, bs, hkv, dk)
                and hkv > 0
                and hq % hkv == 0
                and q.stride()[1:] == (d, 1)
                and k.stride()[1:] == v.stride()[1:] == (d, 1)
                and (nd <= 1 or k.stride(0) == v.stride(0) == q.stride(0))
                and k_cache.is_contiguous()
                and v_cache.is_contiguous()
                and slot_mapping.dtype == torch.int64
                and tuple(slot_mapping.shape) == (nd,)
                and slot_mapping.is_contiguous()
                and block_tables.dtype == seq_lens.dtype == torch.int32
                and block_tables.dim() == 2
                and block_tables.shape[0] >= nd
                and block_tables.is_contiguous()
                and seq_lens.is_contiguous()
                and seq_lens.shape[0] >= nd
            )
            if not ok:
                raise ValueError("paged_decode_store_attention: bad layout, dtype or shape")
            if nd and (
                int(slot_mapping.max()) >= nb * bs
                or int(seq_lens[:nd].min()) < 1
                or int(seq_lens[:nd].max()) > block_tables.shape[1] * bs
            ):
                raise ValueError("paged_decode_store_attention: slot or length out of range")
        out = torch.empty(nd, hq, d, dtype=torch.float32)
        if nd == 0:
            return out
        rc = self._decode_store(
            base,
            row_stride,
            k_off,
            v_off,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            out.data_ptr(),
            nd,
            hq,
            hkv,
            d,
            bs,
            scale,
            torch.get_num_threads(),
            int(k_cache.dtype == torch.float16),
        )
        if rc != 0:
            raise MemoryError("paged_decode_store_attention: scratch allocation failed")
        return out

    # ---- fused small ops (kernels/csrc/cpu_ops.c) ------------------------------
    # Contracts: float32, C-contiguous CPU tensors (checked); the torch
    # references are engine.models.ops.TorchModelOps.

    @staticmethod
    def _check_f32(*ts: torch.Tensor) -> None:
        for t in ts:
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("native CPU ops need contiguous float32 CPU tensors")

    def add_rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> torch.Tensor:
        """``weight * rmsnorm(x + residual)``; with ``residual`` the sum is written
        back into it (in place). ``x`` and ``residual``: ``[rows, dim]``.
        ``validate=False`` is for a caller that has checked this contract itself."""
        rows, dim = x.shape
        if validate:
            self._check_f32(x, weight, *(() if residual is None else (residual,)))
            if weight.shape != (dim,) or (residual is not None and residual.shape != x.shape):
                raise ValueError("add_rms_norm: shape mismatch")
        out = torch.empty_like(x)
        self._norm(
            x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope_neox_(
        self,
        qk: torch.Tensor,
        heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        *,
        check_positions: bool = True,
        validate: bool = True,
    ) -> None:
        """Rotate the first ``heads`` heads of every row of ``qk`` in place.

        ``qk``: ``[rows, >= heads * head_dim]`` float32 whose rows may be strided
        (a fused qkv output) but whose columns are contiguous; ``positions``:
        int64 ``[rows]``, each < ``cos_sin.shape[0]`` (checked);
        ``cos_sin``: ``[max_pos, head_dim]`` (cos | sin). ``check_positions=False``
        skips the bounds check (a host reduction) for positions already checked;
        ``validate=False`` skips the layout checks, for a caller that made them.
        """
        rows = qk.shape[0]
        if validate:
            if (
                qk.dtype != torch.float32
                or qk.device.type != "cpu"
                or qk.dim() != 2
                or qk.stride(1) != 1
                or qk.shape[1] < heads * head_dim
            ):
                raise ValueError(
                    "rope_neox_ needs a float32 CPU [rows, cols] tensor, unit column stride"
                )
            self._check_f32(cos_sin)
            if positions.dtype != torch.int64 or not positions.is_contiguous():
                raise ValueError("rope_neox_ needs contiguous int64 positions")
            if cos_sin.shape[1] != head_dim or positions.shape != (rows,):
                raise ValueError("rope_neox_: shape mismatch")
        if (
            check_positions
            and rows
            and (int(positions.min()) < 0 or int(positions.max()) >= cos_sin.shape[0])
        ):
            raise ValueError("rope_neox_: position outside the cos/sin cache")
        self._rope(
            qk.data_ptr(),
            qk.stride(0),
            rows,
            heads,
            head_dim,
            positions.data_ptr(),
            cos_sin.data_ptr(),
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` ``[rows, 2 * inter]`` (gate first)."""
        if validate:
            self._check_f32(gate_up)
        rows, two = gate_up.shape
        out = torch.empty(rows, two // 2, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), out.data_ptr(), rows, two // 2, torch.get_num_threads())
        return out

    # ---- block-quantized linear (kernels/csrc/cpu_quant.c) ---------------------

    def quant_linear(
        self,
        x: torch.Tensor,
        weight: QuantWeight,
        bias: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` ``[M, K]`` float32 (contiguous CPU) and a
        block-quantized ``W``; reference :func:`kernels.quant_linear.quant_linear_ref`.
        ``validate=False`` is for a caller that has checked the contract itself."""
        rows, k = x.shape
        n = weight.out_features
        if validate:
            self._check_f32(x, *(() if bias is None else (bias,)))
            if k != weight.in_features or (bias is not None and bias.shape != (n,)):
                raise ValueError("quant_linear: shape mismatch")
        out = torch.empty(rows, n, dtype=torch.float32)
        if rows == 0:
            return out
        rc = self._quant_linear(
            x.data_ptr(),
            rows,
            k,
            weight.qs.data_ptr(),
            weight.d.data_ptr(),
            None if weight.m is None else weight.m.data_ptr(),
            Q4_1 if weight.qtype == Q4_1 else 0,
            n,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
            weight.layout,
        )
        if rc == -2:
            raise ValueError("quant_linear: this build reads no x16 layout (no AVX-512 VNNI)")
        if rc != 0:
            raise MemoryError("quant_linear: scratch allocation failed")
        return out

    # ---- the fused decode step (kernels/csrc/cpu_step.c) --------------------------

    @staticmethod
    def _qweight(w: QuantWeight, bias: torch.Tensor | None) -> _QWeight:
        return _QWeight(
            w.qs.data_ptr(),
            w.d.data_ptr(),
            None if w.m is None else w.m.data_ptr(),
            None if bias is None else bias.data_ptr(),
            w.out_features,
            w.in_features,
            Q4_1 if w.qtype == Q4_1 else 0,
            w.layout,
        )

    def decode_step_plan(
        self,
        layers: list[DecodeLayer],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        cos_sin: torch.Tensor,
        final_norm: torch.Tensor,
        kv_layout: KiviLayout | None = None,
    ) -> DecodeStepPlan:
        """Check every layer's shapes, dtypes and layouts once and build the plan.
        ``kv_layout``: the caches are KIVI blocks of this layout (stored and read
        as ``kernels.kivi`` describes) instead of plain float caches.

        Raises:
            ValueError: anything :meth:`decode_step` could not read as documented.
        """
        if not layers:
            raise ValueError("decode_step_plan needs at least one layer")
        hidden = int(final_norm.shape[0])
        inter = layers[0].down.in_features
        kc0 = layers[0].k_cache
        for ok, what in _decode_plan_checks(
            layers, num_heads, num_kv_heads, head_dim, cos_sin, final_norm, kv_layout
        ):
            if not ok:
                raise ValueError(f"decode_step_plan needs {what}")
        kivi = _Kivi.of(kv_layout) if kv_layout is not None else None
        block_size = kv_layout.block_size if kv_layout is not None else int(kc0.shape[1])
        keep: list[object] = [cos_sin, final_norm, *layers, kivi]
        arr = (_Layer * len(layers))()
        for i, lay in enumerate(layers):
            arr[i] = _Layer(
                lay.attn_norm.data_ptr(),
                lay.ffn_norm.data_ptr(),
                self._qweight(lay.qkv, lay.qkv_bias),
                self._qweight(lay.o, lay.o_bias),
                self._qweight(lay.gate_up, None),
                self._qweight(lay.down, None),
                lay.k_cache.data_ptr(),
                lay.v_cache.data_ptr(),
            )
        model = _Model(
            len(layers),
            hidden,
            num_heads,
            num_kv_heads,
            head_dim,
            inter,
            block_size,
            eps,
            scale,
            int(kc0.dtype == torch.float16),
            0,
            cos_sin.data_ptr(),
            final_norm.data_ptr(),
            arr,
            ctypes.pointer(kivi) if kivi is not None else None,
        )
        sizes = {
            "hidden": hidden,
            "max_positions": int(cos_sin.shape[0]),
            "num_slots": int(kc0.shape[0]) * block_size,
        }
        return DecodeStepPlan(model, arr, keep, sizes)

    def decode_step(
        self,
        plan: DecodeStepPlan,
        x: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        max_position: int,
        max_slot: int,
        max_seq_len: int,
    ) -> torch.Tensor:
        """Run every decoder layer of a decode-only step (one new token per
        sequence) and the final norm in one call; returns the final-normed hidden
        states ``[M, H]``. ``x`` (``[M, H]`` float32 embeddings) is overwritten
        (it is the residual stream). ``positions``/``slot_mapping`` int64 ``[M]``
        (slot -1: not stored), ``block_tables`` int32 ``[>= M, width]``,
        ``seq_lens`` int32 ``[>= M]``, all contiguous; the caller passes their
        maxima (from host-side lists: no tensor reductions), checked here against
        the plan's bounds.

        Raises:
            ValueError: a layout or bound the kernel cannot read safely.
            MemoryError: scratch allocation failed.
        """
        m = x.shape[0]
        ok = (
            x.dtype == torch.float32
            and x.is_contiguous()
            and tuple(x.shape) == (m, plan.hidden)
            and positions.dtype == slot_mapping.dtype == torch.int64
            and tuple(positions.shape) == tuple(slot_mapping.shape) == (m,)
            and positions.is_contiguous()
            and slot_mapping.is_contiguous()
            and block_tables.dtype == seq_lens.dtype == torch.int32
            and block_tables.dim() == 2
            and block_tables.shape[0] >= m
            and block_tables.is_contiguous()
            and seq_lens.is_contiguous()
            and seq_lens.shape[0] >= m
        )
        if not ok:
            raise ValueError("decode_step: bad layout, dtype or shape")
        bs = plan.model.block_size
        if (
            max_position >= plan.max_positions
            or max_slot >= plan.num_slots
            or max_seq_len > block_tables.shape[1] * bs
        ):
            raise ValueError("decode_step: position, slot or length out of range")
        out = torch.empty_like(x)
        if m == 0:
            return out
        rc = self._decode_step(
            ctypes.byref(plan.model),
            x.data_ptr(),
            m,
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError("decode_step: scratch allocation failed")
        return out
