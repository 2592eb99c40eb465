"""Low-rank keys (``--kv-low-rank-keys RANK``): keys stored in a per-layer,
per-KV-head rank-``r`` form found offline from the model's own queries and keys.

The math. For one KV head, the cache stores ``k_r = A^T (k - mu)`` (``r``
numbers instead of ``head_dim``) and every query head of that KV head's group
is projected by ``B``, ``q_r = B^T q`` (``A``, ``B``: ``[head_dim, r]``), so
``q_r . k_r = q^T B A^T k - q^T B A^T mu``: a rank-``r`` approximation of the
score, less a term that is the same for every key of the query, which softmax
ignores. Attention runs on ``q_r``, ``k_r`` at the model's own scale
(``head_dim ** -0.5``); values are untouched. At ``r = head_dim``, ``B A^T``
is the identity and the answer is the full-rank one up to rounding (a test
holds it to that).

The form. Per layer and KV head, from the post-RoPE queries and keys of a
calibration text: the ``A``, ``B`` that make the expected squared score error
smallest (``basis_from_samples``: an SVD of the whitened query-key product),
with columns by falling score variance, so the first ``r`` columns are the
best rank-``r`` form for any ``r``. Measured on the default model, this keeps
perplexity much closer than the keys' principal directions used for both
(docs/benchmarks/kv-compression.md; ``benchmarks/low_rank_keys.py`` compares
them). The keys are taken after RoPE (what the cache holds), so stored keys
cannot be re-rotated: RoPE does not commute with ``A``, which is why the KV
policies that shift positions are refused with low-rank keys.

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


def check_rank(rank: int, head_dim: int) -> None:
    """Raises ValueError unless ``1 <= rank <= head_dim``."""
    if not 1 <= rank <= head_dim:
        raise ValueError(
            f"--kv-low-rank-keys {rank} must be between 1 and the head size ({head_dim})"
        )


@dataclass(frozen=True)
class KeyBasis:
    """Per-layer query and key projections, columns by falling importance.

    Attributes:
        query_proj: float32 ``[num_layers, num_kv_heads, head_dim, head_dim]``
            (``B``); the first ``rank`` columns project a query head.
        key_proj: float32, same shape (``A``); the first ``rank`` columns
            project a key, after ``key_mean`` is taken off.
        key_mean: float32 ``[num_layers, num_kv_heads, head_dim]`` (``mu``).
        energy: float32 ``[num_layers, num_kv_heads, head_dim]``: the score
            variance each column pair carries, falling.
        rank: the columns in use (``1 <= rank <= head_dim``).

    ``B A^T`` is the identity at full rank, and taking off ``mu`` shifts every
    score of a query by the same ``q . B A^T mu``, which softmax ignores, so
    full rank is the plain answer up to rounding.
    """

    query_proj: torch.Tensor
    key_proj: torch.Tensor
    key_mean: torch.Tensor
    energy: torch.Tensor
    rank: int

    def __post_init__(self) -> None:
        shape = tuple(self.key_proj.shape)
        if len(shape) != 4 or shape[2] != shape[3] or tuple(self.query_proj.shape) != shape:
            raise ValueError(
                "a key basis' projections are [num_layers, num_kv_heads, head_dim, head_dim], "
                f"got {tuple(self.query_proj.shape)} and {shape}"
            )
        if tuple(self.energy.shape) != shape[:3] or tuple(self.key_mean.shape) != shape[:3]:
            raise ValueError(
                "a key basis' energy and mean are [num_layers, num_kv_heads, head_dim]"
            )
        check_rank(self.rank, self.head_dim)

    @property
    def num_layers(self) -> int:
        return int(self.key_proj.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key_proj.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.key_proj.shape[2])

    def projection(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s query projection and key projection (``[num_kv_heads,
        head_dim, rank]`` float32, the first ``rank`` columns) and key mean
        (``[num_kv_heads, head_dim]``)."""
        r = self.rank
        return (
            self.query_proj[layer, :, :, :r].contiguous(),
            self.key_proj[layer, :, :, :r].contiguous(),
            self.key_mean[layer].contiguous(),
        )

    @property
    def digest(self) -> str:
        """Hex sha256 of what the rank in use reads (the disk fingerprint's key)."""
        h = hashlib.sha256(f"fuel-key-basis-v{_BASIS_VERSION}\0r{self.rank}\0".encode())
        for t in (
            self.query_proj[..., : self.rank],
            self.key_proj[..., : self.rank],
            self.key_mean,
        ):
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()

    def kept_energy(self) -> float:
        """Mean over layers and heads of the fraction of score variance the rank keeps."""
        e = self.energy.clamp_min(0)
        kept = e[..., : self.rank].sum(-1) / e.sum(-1).clamp_min(1e-30)
        return float(kept.mean())

    def with_rank(self, rank: int) -> KeyBasis:
        return KeyBasis(self.query_proj, self.key_proj, self.key_mean, self.energy, rank)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """Raises ValueError unless the basis fits a model of this shape."""
        want = (num_layers, num_kv_heads, head_dim)
        got = (self.num_layers, self.num_kv_heads, self.head_dim)
        if got != want:
            raise ValueError(
                f"the key basis is for {got[0]} layers x {got[1]} KV heads x head size {got[2]}, "
                f"the model has {want[0]} x {want[1]} x {want[2]}"
            )

    _TENSORS = ("query_proj", "key_proj", "key_mean", "energy")

    def save(self, path: Path) -> None:
        """Write the full basis (every column: any rank reads it back)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file(
            # Cloned: a PCA basis uses one tensor for both projections (safetensors
            # refuses tensors that share memory).
            {name: getattr(self, name).clone() for name in self._TENSORS},
            str(tmp),
            metadata={"format": f"fuel-key-basis-v{_BASIS_VERSION}"},
        )
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file

    @classmethod
    def load(cls, path: Path, rank: int) -> KeyBasis:
        """Read a basis file (the tensors :meth:`save` writes).

        Raises:
            ValueError: the file is missing, unreadable or of the wrong shape.
        """
        try:
            t = load_file(str(path))
        except (OSError, SafetensorError) as e:
            raise ValueError(f"cannot read the key basis file {path}: {e}") from e
        missing = [name for name in cls._TENSORS if name not in t]
        if missing:
            raise ValueError(f"{path} holds no key basis (missing {', '.join(missing)})")
        qp, kp, mu, energy = (t[name].float() for name in cls._TENSORS)
        return cls(qp, kp, mu, energy, rank)


def _sym_power(c: torch.Tensor, power: float, floor: float) -> torch.Tensor:
    """``c ** power`` of symmetric PSD matrices ``[..., D, D]`` (float64), with
    eigenvalues floored at ``floor`` times the largest (inverse roots stay finite)."""
    evals, evecs = torch.linalg.eigh(c)
    evals = evals.clamp_min(floor * evals[..., -1:].clamp_min(1e-300))
    out: torch.Tensor = (evecs * evals.pow(power).unsqueeze(-2)) @ evecs.transpose(-1, -2)
    return out


def basis_from_samples(
    queries: list[torch.Tensor], keys: list[torch.Tensor], rank: int
) -> KeyBasis:
    """The best rank-``r`` bilinear form for each layer's scores, nested in ``r``.

    ``queries[l]`` is ``[T, num_heads, head_dim]`` and ``keys[l]`` ``[T,
    num_kv_heads, head_dim]``, post-RoPE, of layer ``l``. Per KV head, with
    ``Cq`` the second moment of its query heads' queries and ``Ck`` the
    covariance of its keys (centred: the mean's share of a score is the same
    for every key of a query, which softmax ignores), the score error
    ``E[(q^T (I - B A^T) (k - mu))^2]`` is smallest over rank-``r`` products
    ``B A^T`` for ``B = Cq^-1/2 U_r S_r^1/2`` and ``A = Ck^-1/2 V_r S_r^1/2``,
    from the SVD ``Cq^1/2 Ck^1/2 = U S V^T``; columns in ``S`` order, so any
    rank reads the first columns. Accumulated in float64.
    """
    qp, kp, means, energy = [], [], [], []
    for q, k in zip(queries, keys):
        hkv = k.shape[1]
        kk = k.double().transpose(0, 1)  # [H, T, D]
        mu = kk.mean(1)  # [H, D]
        kc = kk - mu[:, None]
        ck = kc.transpose(1, 2) @ kc / kk.shape[1]
        qq = q.double().reshape(q.shape[0], hkv, -1, q.shape[2]).transpose(0, 1)
        qq = qq.reshape(hkv, -1, q.shape[2])  # [H, T * group, D]
        cq = qq.transpose(1, 2) @ qq / qq.shape[1]
        floor = 1e-9
        u, sv, vh = torch.linalg.svd(_sym_power(cq, 0.5, floor) @ _sym_power(ck, 0.5, floor))
        root = sv.sqrt().unsqueeze(-2)
        qp.append((_sym_power(cq, -0.5, floor) @ u * root).float())
        kp.append((_sym_power(ck, -0.5, floor) @ vh.transpose(-1, -2) * root).float())
        means.append(mu.float())
        energy.append((sv**2).float())
    return KeyBasis(torch.stack(qp), torch.stack(kp), torch.stack(means), torch.stack(energy), rank)


class _KeyCapture(AttentionBackend):
    """A calibration forward's attention: records each layer's post-RoPE queries
    and keys (layers run in order) and attends causally over one cache-less
    sequence."""

    name = "key-capture"

    def __init__(self) -> None:
        self.queries: list[torch.Tensor] = []
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
        self.queries.append(q.detach().float().cpu())
        self.keys.append(k.detach().float().cpu())
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1).contiguous()


def capture_samples(
    model: Any, token_ids: list[int], device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Post-RoPE queries and keys of every layer over ``token_ids`` (one
    sequence, one forward).

    ``model`` is a Llama-family model (engine/models/llama.py) whose layers
    must not project keys yet (the basis is what this finds). Its attention
    backend is swapped for a recorder for this one forward and put back.
    """
    layers = model.model.layers
    if any(layer.self_attn.key_basis is not None for layer in layers):
        raise ValueError("capture_samples needs full-rank keys (the model already projects them)")
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
    return capture.queries, capture.keys


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
    # Before any file is read or any calibration runs (a basis would refuse it too).
    check_rank(rank, cfg.head_dim)
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
    basis = basis_from_samples(*capture_samples(model, ids, device), rank)
    for place in places:
        try:
            basis.save(place)
        except OSError as e:
            logger.info("cannot cache the key basis at %s: %s", place, e)
            continue
        logger.info("key basis calibrated on %d tokens, cached at %s", len(ids), place)
        break
    return basis
