"""The model fingerprint that keys persistent KV blocks (the disk tier).

Two engines may share a disk block only if the block's bytes mean the same
thing to both: same weights, same numerics that produced the keys and values
(weight dtype, CPU linear strategy, attention backend, device type), and the
same KV layout (format, KV dtype, block size, layout version; see
``KVFormat.describe``). All of that goes into one sha256.

Weights are identified by content, sampled: every weight file's name, size
and the sha256 of its first and last 4 MiB (plus the config files in full).
A fine-tuned or re-quantized model differs in those bytes; hashing whole
multi-gigabyte files at every start-up would not be worth it. Paths and
modification times are left out on purpose: a copied model keeps its cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

_SAMPLE = 4 << 20
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")
_CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json")


def _hash_file_sampled(h: hashlib._Hash, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        h.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            h.update(f.read(_SAMPLE))
        elif size > _SAMPLE:
            h.update(f.read())


def model_fingerprint(model_path: Path, settings: Mapping[str, str]) -> bytes:
    """32 bytes identifying the model at ``model_path`` (a file or a directory)
    together with ``settings`` (dtype, KV layout, ...), order-independent."""
    h = hashlib.sha256(b"fuel-kv-fingerprint-v1\0")
    path = Path(model_path)
    if path.is_dir():
        for name in _CONFIG_FILES:
            f = path / name
            if f.is_file():
                h.update(f"{name}\0".encode())
                h.update(f.read_bytes())
        for f in sorted(path.iterdir()):
            if f.is_file() and f.suffix in _WEIGHT_SUFFIXES:
                _hash_file_sampled(h, f)
    else:
        _hash_file_sampled(h, path)
    for key in sorted(settings):
        h.update(f"{key}={settings[key]}\0".encode())
    return h.digest()
