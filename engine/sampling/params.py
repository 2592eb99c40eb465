"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_TOP_LOGPROBS = 20


@dataclass
class StructuredOutputSpec:
    """A constraint on the generated text, enforced by a token mask.

    Exactly one of the fields is set. ``json_schema`` is a JSON Schema (dict);
    ``json_object`` asks for any JSON object; ``grammar`` is an EBNF grammar in
    the grammar engine's dialect; ``regex`` a regular expression.
    """

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    grammar: str | None = None
    regex: str | None = None


@dataclass
class SamplingParams:
    """How to sample one request. ``validate()`` raises ``ValueError`` on bad values.

    ``logprobs``: None = no logprobs; k >= 0 = the sampled token's logprob plus
    the top-k alternatives. ``prompt_logprobs`` likewise for prompt tokens.
    ``top_k`` <= 0 disables top-k. ``seed`` makes the request's samples
    reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured: StructuredOutputSpec | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        def finite(name: str, value: float) -> None:
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")

        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            finite(name, float(getattr(self, name)))
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                finite("logit_bias value", float(bias))
                if not -100.0 <= bias <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
                if vocab_size is not None and not 0 <= tok < vocab_size:
                    raise ValueError(
                        f"logit_bias token id {tok} is out of range for vocabulary size {vocab_size}"
                    )
        if vocab_size is not None:
            for tok in self.stop_token_ids:
                if not 0 <= tok < vocab_size:
                    raise ValueError(
                        f"stop_token_ids entry {tok} is out of range for vocabulary size {vocab_size}"
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
