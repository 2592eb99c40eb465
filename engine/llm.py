"""Offline batch API: ``LLM(config).generate(prompts, params)`` (benchmarks, tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import PositionLogprobs
from engine.sampling.params import SamplingParams


@dataclass
class GenerationResult:
    """One choice of one prompt, complete."""

    prompt_index: int
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)


class LLM:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        self.engine = engine if engine is not None else LLMEngine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Sequence[list[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion, batched continuously; results in prompt order
        (for n > 1, the choices of a prompt in index order)."""
        if params is None:
            params = SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        results: dict[tuple[int, int], GenerationResult] = {}
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            toks = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            gid = f"offline-{id(self)}-{i}"
            ids.append(gid)
            self.engine.add_request(gid, toks, p, sink=i)
            for j in range(p.n):
                results[(i, j)] = GenerationResult(i, j)
        while self.engine.has_unfinished():
            for group, out in self.engine.step():
                i = int(group.sink)  # type: ignore[call-overload]
                for d in out.outputs:
                    r = results[(i, d.index)]
                    r.token_ids.extend(d.delta_token_ids)
                    r.text += d.delta_text
                    if d.delta_logprobs:
                        r.logprobs.extend(d.delta_logprobs)
                    if d.finish_reason is not None:
                        r.finish_reason = d.finish_reason
        return [results[k] for k in sorted(results)]
