"""Low-rank keys (issue 16): the engine's rank-r score form against the keys'
principal directions, by perplexity on the default model.

Both are computed from the same post-RoPE queries and keys of the calibration
text (engine/kv/data/key_calibration.txt, the engine's default), saved as
basis files and served through ``--kv-low-rank-keys-file``, so only the form
differs:

- ``svd``: the engine's (``engine.kv.low_rank.basis_from_samples``), the
  rank-r ``B A^T`` with the smallest expected squared score error;
- ``pca``: the eigenvectors of each KV head's centred key covariance, used
  for queries and keys alike (``A = B``, orthonormal): query-blind.

Perplexity of the first ``--text-tokens`` tokens of benchmarks/data/GPL-3.txt
in one window, prefill chunks of ``--chunk`` (so most attention reads stored
keys), exact linears and a float32 cache (only the key form differs).

Usage::

    python -m benchmarks.low_rank_keys --ranks 64,56,48,32 --text-tokens 2560
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cpu_quality import TEXT, perplexity
from engine.config import EngineConfig
from engine.kv.low_rank import (
    CALIBRATION_TOKENS,
    DEFAULT_CALIBRATION_TEXT,
    KeyBasis,
    basis_from_samples,
    capture_samples,
)
from engine.llm_engine import LLMEngine


def pca_basis_from_samples(keys: list[torch.Tensor], rank: int) -> KeyBasis:
    """The principal directions of each layer's centred keys, for queries and
    keys alike (the comparison: what ignoring the queries costs)."""
    qp, means, energy = [], [], []
    for k in keys:
        kk = k.double().transpose(0, 1)
        mu = kk.mean(1)
        kc = kk - mu[:, None]
        evals, evecs = torch.linalg.eigh(kc.transpose(1, 2) @ kc)
        qp.append(evecs.flip(-1).float())
        means.append(mu.float())
        energy.append(evals.flip(-1).float())
    u = torch.stack(qp)
    return KeyBasis(u, u, torch.stack(means), torch.stack(energy), rank)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--ranks", default="64,56,48,32")
    ap.add_argument("--text-tokens", type=int, default=2560)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    base: dict[str, Any] = dict(
        cpu_linear="onednn",
        kv_cache_dtype="float32",
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
    )
    print(f"threads={torch.get_num_threads()} load={os.getloadavg()}", flush=True)
    eng = LLMEngine(EngineConfig(**base))
    calib = eng.tokenizer.encode(DEFAULT_CALIBRATION_TEXT.read_text())[:CALIBRATION_TOKENS]
    qs, ks = capture_samples(eng.model, calib, torch.device("cpu"))
    text_ids = eng.tokenizer.encode(TEXT.read_text())[: args.text_tokens]
    ref = perplexity(eng, text_ids, args.text_tokens)
    del eng
    rows: list[dict[str, Any]] = [{"form": "full", "rank": None, "perplexity": ref}]
    print(json.dumps(rows[-1]), flush=True)
    forms = {"svd": basis_from_samples(qs, ks, 1), "pca": pca_basis_from_samples(ks, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, basis in forms.items():
            basis.save(Path(tmp) / f"{name}.keybasis")
        for rank in (int(r) for r in args.ranks.split(",")):
            for name in forms:
                t0 = time.perf_counter()
                e = LLMEngine(
                    EngineConfig(
                        **base,
                        kv_low_rank_keys=rank,
                        kv_low_rank_keys_file=str(Path(tmp) / f"{name}.keybasis"),
                    )
                )
                assert e.key_basis is not None
                ppl = perplexity(e, text_ids, args.text_tokens)
                rows.append(
                    {
                        "form": name,
                        "rank": rank,
                        "kept_energy": e.key_basis.kept_energy(),
                        "perplexity": ppl,
                        "vs_full": ppl / ref - 1,
                        "kv_bytes_per_token": e.info.kv_bytes_per_token,
                        "seconds": time.perf_counter() - t0,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                del e
    print(f"load={os.getloadavg()}")
    print("| form | rank | score variance kept | perplexity | vs full | KV bytes/token |")
    print("|---|---|---|---|---|---|")
    for r in rows[1:]:
        print(
            f"| {r['form']} | {r['rank']} | {100 * r['kept_energy']:.1f}% | {r['perplexity']:.3f} "
            f"| {100 * r['vs_full']:+.1f}% | {r['kv_bytes_per_token']:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
