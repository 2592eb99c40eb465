"""``--speculative-config``: vLLM's JSON keys, parsed once into a typed, validated config.

Accepted keys (vLLM's names and meanings, plus ``adaptive``):

* ``method``: ``"ngram"`` (prompt lookup) or ``"draft_model"``. Given
  ``model`` and no method, the method is ``draft_model`` (as vLLM infers it).
* ``model``: the draft model, a GGUF file or HF directory with the target's
  vocabulary. ``draft_model`` without ``model`` drafts with the target's own
  weights, quantized (``quantization``): the self-draft.
* ``num_speculative_tokens``: most drafts per request and step (required).
* ``prompt_lookup_max`` / ``prompt_lookup_min``: n-gram sizes tried, longest
  first (vLLM's defaults: one given sets the other; neither gives 5 and 5).
* ``quantization``: the draft model's CPU linears: ``"q4_1"`` (the default
  for the self-draft), ``"int8"``, or ``null`` (as loaded).
* ``disable_by_batch_size``: no drafts in a step with at least this many
  running requests (vLLM's key); unset, the cost rule decides alone.
* ``adaptive`` (ours, default true): per-request draft counts follow measured
  acceptance and the step's cost (engine/spec_decode/controller.py); false
  always proposes ``num_speculative_tokens``.

Anything else, or a value of the wrong type or range, is a start-up error
naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

SpecMethod = Literal["ngram", "draft_model"]
DraftQuantization = Literal["q4_1", "int8"]

_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "quantization",
    "disable_by_batch_size",
    "adaptive",
)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpecMethod
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    quantization: DraftQuantization | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @property
    def is_self_draft(self) -> bool:
        return self.method == "draft_model" and self.model is None


def _error(message: str) -> ValueError:
    return ValueError(f"--speculative-config: {message}")


def _int(raw: dict[str, Any], key: str, minimum: int, maximum: int | None = None) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(f"{key} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise _error(f"{key} must be {bound}, got {value}")
    return value


def parse_speculative_config(raw: dict[str, Any] | None) -> SpeculativeConfig | None:
    """The typed config for ``raw`` (None: speculation off). Raises ValueError naming the key."""
    if raw is None:
        return None
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise _error(f"unknown key(s) {', '.join(unknown)}; known keys: {', '.join(_KEYS)}")
    model = raw.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise _error(f"model must be a path (string), got {model!r}")
    method = raw.get("method")
    if method is None:
        if model is None:
            raise _error('set "method" ("ngram" or "draft_model") or a draft "model"')
        method = "draft_model"
    if method not in ("ngram", "draft_model"):
        raise _error(f'method {method!r} is not supported; choose "ngram" or "draft_model"')
    chosen: SpecMethod = "ngram" if method == "ngram" else "draft_model"
    k = _int(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise _error("num_speculative_tokens is required")
    lmax = _int(raw, "prompt_lookup_max", 1)
    lmin = _int(raw, "prompt_lookup_min", 1)
    if method == "ngram":
        if model is not None:
            raise _error('"ngram" takes no draft model; use "method": "draft_model" with "model"')
        if lmax is None and lmin is None:
            lmax = lmin = 5
        elif lmax is None:
            lmax = lmin
        elif lmin is None:
            lmin = lmax
        assert lmax is not None and lmin is not None
        if lmin > lmax:
            raise _error(f"prompt_lookup_min ({lmin}) exceeds prompt_lookup_max ({lmax})")
    elif lmax is not None or lmin is not None:
        raise _error("prompt_lookup_max / prompt_lookup_min apply to the ngram method only")
    quant = raw.get("quantization")
    if quant is not None and quant not in ("q4_1", "int8"):
        raise _error(f'quantization {quant!r} is not supported; choose "q4_1", "int8" or null')
    if method == "ngram" and quant is not None:
        raise _error("quantization applies to draft models only")
    if method == "draft_model" and model is None and quant is None:
        quant = "q4_1"  # the self-draft: the target's weights in Q4_1 blocks
    adaptive = raw.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise _error(f"adaptive must be true or false, got {adaptive!r}")
    return SpeculativeConfig(
        method=chosen,
        num_speculative_tokens=k,
        model=model,
        prompt_lookup_max=lmax if lmax is not None else 5,
        prompt_lookup_min=lmin if lmin is not None else 5,
        quantization=quant,
        disable_by_batch_size=_int(raw, "disable_by_batch_size", 1),
        adaptive=adaptive,
    )
