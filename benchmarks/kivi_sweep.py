"""KIVI read-rule sweep (issue 16): perplexity of each quantization setting, offline.

Runs the default model in transformers (float32 weights dequantized from the
GGUF) over the first ``--tokens`` tokens of benchmarks/data/GPL-3.txt in one
forward, with an attention function that applies a KIVI read rule to the
post-RoPE keys and the values: each query reads, at float16, its window (its
own group and the ``m - 1`` before it) and the first ``S`` tokens (sinks), and
every other earlier key and value quantized-dequantized (keys per channel over
groups of ``G`` tokens, values per token over groups of ``Gv`` channels,
min/max, float16 scales: the store of kernels/kivi.py, or with ``clip`` a
range search that minimises the squared error). It computes what the engine's
read rule computes, without pages, so many settings can be compared quickly;
docs/benchmarks/kv-compression.md has the sweep and the engine's own
measurement of the chosen defaults (benchmarks/kv_compression.py).

Usage (each setting is a JSON object; missing keys: G 32, Gv 32, m 1, S 0, 16
bits, so ``{}`` is the float16 reference)::

    python -m benchmarks.kivi_sweep --tokens 2560 \\
        '{}' '{"kbits": 2, "vbits": 2}' '{"kbits": 2, "vbits": 2, "G": 8, "m": 4, "S": 8}'
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.cpu_quality import TEXT


@dataclass(frozen=True)
class Rule:
    G: int = 32  # tokens per key group (and per window group)
    Gv: int = 32  # channels per value group
    m: int = 1  # window groups
    S: int = 0  # sink tokens
    kbits: int = 16  # 16: keys not quantized
    vbits: int = 16
    clip: bool = False


def _quantize(x: torch.Tensor, dim: int, bits: int, clip: bool) -> torch.Tensor:
    """Asymmetric quantize-dequantize of ``x`` along ``dim`` (float16 scale and zero)."""
    levels = (1 << bits) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    best: torch.Tensor | None = None
    out = x
    for a in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5) if clip else (1.0,):
        # a = 1: the min/max range exactly (the engine's store); below 1 the
        # range shrinks about its middle.
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * a
        l2, h2 = (lo, hi) if a == 1.0 else (mid - half, mid + half)
        s = ((h2 - l2) / levels).half().float()
        z = l2.half().float()
        q = torch.where(s > 0, torch.round((x - z) / torch.where(s > 0, s, 1.0)), 0.0)
        y = q.clamp(0, levels) * s + z
        err = ((y - x) ** 2).sum(dim, keepdim=True)
        if best is None:
            best, out = err, y
        else:
            take = err < best
            best, out = torch.where(take, err, best), torch.where(take, y, out)
    return out


def _attention(rule: Rule) -> Any:
    def attend(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        scaling: float,
        dropout: float = 0.0,
        **kw: Any,
    ) -> tuple[torch.Tensor, None]:
        b, hq, n, d = query.shape
        h = key.shape[1]
        k16, v16 = key.half().float(), value.half().float()
        kd, vd = k16, v16
        full = (n // rule.G) * rule.G
        if rule.kbits < 16 and full:
            kd = k16.clone()
            groups = k16[:, :, :full].reshape(b, h, full // rule.G, rule.G, d)
            kd[:, :, :full] = _quantize(groups, 3, rule.kbits, rule.clip).reshape(b, h, full, d)
        if rule.vbits < 16:
            groups = v16.reshape(b, h, n, d // rule.Gv, rule.Gv)
            vd = _quantize(groups, -1, rule.vbits, rule.clip).reshape(b, h, n, d)
        rep = hq // h
        p = torch.arange(n)[:, None]
        t = torch.arange(n)[None, :]
        wstart = ((p // rule.G - rule.m + 1) * rule.G).clamp(min=0)
        fp = (t >= wstart) | (t < rule.S)
        s_fp = query @ k16.repeat_interleave(rep, 1).transpose(-1, -2)
        s_q = query @ kd.repeat_interleave(rep, 1).transpose(-1, -2)
        scores = (torch.where(fp, s_fp, s_q) * scaling).masked_fill(t > p, float("-inf"))
        prob = scores.softmax(-1)
        mask = fp.to(prob.dtype)
        out = (prob * mask) @ v16.repeat_interleave(rep, 1)
        out += (prob * (1 - mask)) @ vd.repeat_interleave(rep, 1)
        return out.transpose(1, 2).contiguous(), None

    return attend


def main(argv: list[str] | None = None) -> int:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    from engine.models.loader import resolve_model_path

    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2560)
    ap.add_argument("rules", nargs="+", help="JSON objects of Rule fields")
    args = ap.parse_args(argv)
    path = resolve_model_path(None)  # the default model's GGUF
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = torch.tensor([tok(TEXT.read_text())["input_ids"][: args.tokens]])
    base = None
    for spec in args.rules:
        rule = Rule(**json.loads(spec))
        name = f"kivi_sweep_{abs(hash(rule))}"
        AttentionInterface.register(name, _attention(rule))
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation=name
        )
        with torch.no_grad():
            logits = model(ids).logits[0, :-1].float()
        ppl = math.exp(F.cross_entropy(logits, ids[0, 1:]).item())
        base = base or ppl
        print(
            json.dumps(
                {
                    "rule": spec,
                    "perplexity": round(ppl, 3),
                    "vs_first": f"{100 * (ppl / base - 1):+.2f}%",
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
