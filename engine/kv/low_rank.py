"""Low-rank keys (``--kv-low-rank-keys RANK``): keys stored in a per-layer,
per-KV-head rank-``r`` basis found offline from the model's own keys.

The math. For one KV head, let ``U`` be ``[head_dim, r]`` with orthonormal
columns. The cache stores ``k_r = U^T k`` (``r`` numbers instead of
``head_dim``) and every query head of that KV head's group is projected the
same way, ``q_r = U^T q``, so ``q_r . k_r = q^T (U U^T) k``: attention reads
keys projected onto the span of ``U``, in the basis, at the model's own scale
(``head_dim ** -0.5``). Values are untouched. With ``r = head_dim``, ``U U^T``
is the identity and the answer is the full-rank one up to rounding (a test
holds it to that).

The basis. The principal directions of the keys: per layer and KV head, the
eigenvectors of ``K^T K`` over the post-RoPE keys of a calibration text,
sorted by eigenvalue (energy), so the first ``r`` columns keep the most of
the keys' energy for any ``r``. Uncentred on purpose: attention scores are
raw dot products, and the mean key direction is the one every score reads.
The keys are taken after RoPE (what the cache holds), so stored keys cannot
be re-rotated: RoPE does not commute with a general basis, which is why the
KV policies that shift positions are refused with low-rank keys.

Who owns what: :class:`KeyBasis` is immutable once built and is shared by
the model (which projects q and k, engine/models/llama.py) and the KV format
(whose key rows are ``r`` wide, engine/kv/format.py). Its :attr:`digest`
goes into the disk tier's fingerprint: a block stored under one basis is
never read back under another.

Where it comes from: ``--kv-low-rank-keys-file`` (a safetensors file this
module wrote, or any with the same tensors), else a cache file beside the
model (or under ``~/.cache/fuel-serve`` where the model's directory is not
writable), else a calibration run at load over the first
``CALIBRATION_TOKENS`` tokens of ``--kv-low-rank-calibration`` (default: the
Mozilla Public License 2.0 text shipped in engine/kv/data/, a different
document from the GPL-3 text the quality benchmark scores).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from engine.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_CALIBRATION_TEXT = Path(__file__).parent / "data" / "key_calibration.txt"
CALIBRATION_TOKENS = 2048
# Bumped when the way a basis is computed changes: cached files then miss.
_BASIS_VERSION = 1


@dataclass(frozen=True)
class KeyBasis:
    """Per-layer key bases.

    Attributes:
        vectors: float32 ``[num_layers, num_kv_heads, head_dim, head_dim]``;
            ``vectors[l, h, :, j]`` is the ``j``-th principal direction of
            layer ``l``'s KV head ``h``, orthonormal columns, by falling energy.
        energy: float32 ``[num_layers, num_kv_heads, head_dim]``: the
            eigenvalues (the keys' energy along each column), falling.
        rank: the columns in use (``1 <= rank <= head_dim``).
        digest: hex sha256 of the bytes in use (the fingerprint's key).
    """

    vectors: torch.Tensor
    energy: torch.Tensor
    rank: int

    def __post_init__(self) -> None:
        if self.vectors.dim() != 4 or self.vectors.shape[2] != self.vectors.shape[3]:
            raise ValueError(
                "a key basis is [num_layers, num_kv_heads, head_dim, head_dim], got "
                f"{tuple(self.vectors.shape)}"
            )
        if tuple(self.energy.shape) != tuple(self.vectors.shape[:3]):
            raise ValueError("a key basis' energy is [num_layers, num_kv_heads, head_dim]")
        if not 1 <= self.rank <= self.head_dim:
            raise ValueError(
                f"--kv-low-rank-keys {self.rank} must be between 1 and the head size "
                f"({self.head_dim})"
            )

    @property
    def num_layers(self) -> int:
        return int(self.vectors.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.vectors.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.vectors.shape[2])

    def projection(self, layer: int) -> torch.Tensor:
        """``[num_kv_heads, head_dim, rank]`` float32: layer ``layer``'s first ``rank`` columns."""
        return self.vectors[layer, :, :, : self.rank].contiguous()

    @property
    def digest(self) -> str:
        h = hashlib.sha256(f"fuel-key-basis-v{_BASIS_VERSION}\0r{self.rank}\0".encode())
        h.update(self.vectors[..., : self.rank].contiguous().numpy().tobytes())
        return h.hexdigest()

    def kept_energy(self) -> float:
        """Mean over layers and heads of the fraction of key energy the rank keeps."""
        e = self.energy.clamp_min(0)
        kept = e[..., : self.rank].sum(-1) / e.sum(-1).clamp_min(1e-30)
        return float(kept.mean())

    def with_rank(self, rank: int) -> KeyBasis:
        return KeyBasis(self.vectors, self.energy, rank)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raises ValueError unless the basis fits a model of this shape."""
        want = (num_layers, num_kv_heads, head_dim)
        got = (self.num_layers, self.num_kv_heads, self.head_dim)
        if got != want:
            raise ValueError(
                f"the key basis is for {got[0]} layers x {got[1]} KV heads x head size {got[2]}, "
                f"the model has {want[0]} x {want[1]} x {want[2]}"
            )

    def save(self, path: Path) -> None:
        """Write the full basis (every column: any rank reads it back)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(
            {"vectors": self.vectors.contiguous(), "energy": self.energy.contiguous()},
            str(tmp),
            metadata={"format": f"fuel-key-basis-v{_BASIS_VERSION}"},
        )
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: Path, rank: int) -> KeyBasis:
        """Read a basis file (``vectors`` and ``energy`` tensors, as :meth:`save` writes).

        Raises:
            ValueError: the file is missing, unreadable or of the wrong shape.
        """
        try:
            t = load_file(str(path))
        except (OSError, SafetensorError) as e:
            raise ValueError(f"cannot read the key basis file {path}: {e}") from e
        if "vectors" not in t or "energy" not in t:
            raise ValueError(f"{path} holds no key basis (tensors 'vectors' and 'energy')")
        return cls(t["vectors"].float(), t["energy"].float(), rank)


def basis_from_keys(keys: list[torch.Tensor], rank: int) -> KeyBasis:
    """The principal directions of each layer's keys.

    ``keys[l]`` is float ``[T, num_kv_heads, head_dim]`` (post-RoPE keys of
    layer ``l``). Accumulated in float64: ``K^T K`` over thousands of tokens.
    """
    vectors, energy = [], []
    for k in keys:
        kk = k.double().transpose(0, 1)  # [H, T, D]
        cov = kk.transpose(1, 2) @ kk  # [H, D, D]
        evals, evecs = torch.linalg.eigh(cov)  # ascending
        vectors.append(evecs.flip(-1).float())
        energy.append(evals.flip(-1).float())
    return KeyBasis(torch.stack(vectors), torch.stack(energy), rank)


class _KeyCapture(AttentionBackend):
    """A calibration forward's attention: records each layer's post-RoPE keys
    (layers run in order) and attends causally over one cache-less sequence."""

    name = "key-capture"

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.keys.append(k.detach().float().clone())
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1).contiguous()


def capture_keys(model: Any, token_ids: list[int], device: torch.device) -> list[torch.Tensor]:
    """Post-RoPE keys of every layer over ``token_ids`` (one sequence, one forward).

    ``model`` is a Llama-family model (engine/models/llama.py) whose layers
    must not project keys yet (the basis is what this finds). Its attention
    backend is swapped for a recorder for this one forward and put back.
    """
    layers = model.model.layers
    if any(layer.self_attn.key_basis is not None for layer in layers):
        raise ValueError("capture_keys needs full-rank keys (the model already projects them)")
    capture = _KeyCapture()
    saved = [layer.self_attn.attn_backend for layer in layers]
    n = len(token_ids)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.zeros((1, 1), dtype=torch.int32, device=device),
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        max_query_len=n,
        max_seq_len=n,
        num_decodes=0,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        query_start_loc_cpu=[0, n],
    )
    empty = torch.empty(0, device=device)
    try:
        for layer in layers:
            layer.self_attn.attn_backend = capture
        with torch.inference_mode():
            model(
                torch.tensor(token_ids, dtype=torch.int64, device=device),
                torch.arange(n, dtype=torch.int64, device=device),
                [(empty, empty)] * len(layers),
                meta,
            )
    finally:
        for layer, backend in zip(layers, saved):
            layer.self_attn.attn_backend = backend
    return [k.cpu() for k in capture.keys]


def cache_file_for(model_path: Path, key: str) -> list[Path]:
    """Where a calibrated basis is cached, in the order tried: beside the model
    (inside a model directory, next to a model file), then the user's cache."""
    # Not ``.safetensors``: a model directory's weight files are found by that
    # suffix (the loader, the fingerprint), and a cached basis must be neither.
    name = f"fuel-key-basis-{key[:16]}.keybasis"
    beside = (model_path if model_path.is_dir() else model_path.parent) / name
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fuel-serve"
    return [beside, home / name]


def resolve_key_basis(
    rank: int,
    *,
    model: Any,
    model_path: Path,
    fingerprint: bytes,
    encode: Any,
    device: torch.device,
    basis_file: str | None,
    calibration_file: str | None,
    max_tokens: int,
) -> KeyBasis:
    """The basis for ``--kv-low-rank-keys rank``: from ``basis_file`` if given,
    else cached, else calibrated now (and cached where a directory is writable).

    ``fingerprint`` identifies the weights and the numerics that produce the
    keys (engine/kv/fingerprint.py); ``encode(text) -> token ids``.

    Raises:
        ValueError: an unreadable or ill-shaped basis or calibration file, a
            calibration text of fewer than 64 tokens, a rank above the head size.
    """
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    if not 1 <= rank <= cfg.head_dim:
        raise ValueError(
            f"--kv-low-rank-keys {rank} must be between 1 and the head size ({cfg.head_dim})"
        )
    if basis_file is not None:
        basis = KeyBasis.load(Path(basis_file), rank)
        basis.check_model(*shape)
        return basis
    text_path = Path(calibration_file) if calibration_file else DEFAULT_CALIBRATION_TEXT
    try:
        text = text_path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read --kv-low-rank-calibration {text_path}: {e}") from e
    ids = encode(text)[: max(1, min(CALIBRATION_TOKENS, max_tokens))]
    if len(ids) < 64:
        raise ValueError(
            f"the key calibration text {text_path} has {len(ids)} tokens; at least 64 are needed"
        )
    h = hashlib.sha256(fingerprint)
    h.update(f"\0basis-v{_BASIS_VERSION}\0".encode())
    h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    places = cache_file_for(model_path, h.hexdigest())
    for place in places:
        if place.is_file():
            try:
                basis = KeyBasis.load(place, rank)
                basis.check_model(*shape)
            except ValueError as e:
                logger.warning("ignoring the cached key basis %s: %s", place, e)
                continue
            logger.info("key basis from %s", place)
            return basis
    basis = basis_from_keys(capture_keys(model, ids, device), rank)
    for place in places:
        try:
            basis.save(place)
        except OSError as e:
            logger.info("cannot cache the key basis at %s: %s", place, e)
            continue
        logger.info("key basis calibrated on %d tokens, cached at %s", len(ids), place)
        break
    return basis
