"""A real ``AsyncEngine`` over a tiny random checkpoint, for the fast server tests.

The checkpoint is a 2-layer Llama whose vocabulary is the default model's
tokenizer (SmolLM2, 49,152 tokens), so chat templates, stop tokens, logit
bias and grammars all work on real token ids; it runs in exact mode (float32
weights and KV), so greedy tokens and logprobs can be compared with
transformers on the same weights. One engine serves a whole test module:
``SharedEngine`` hands it to several apps in turn (an app's lifespan starts
and shuts down its engine; here only the module's finalizer really stops it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.async_engine import AsyncEngine
from engine.client import (
    ClientTokenizer,
    EngineClient,
    EngineStats,
    ForcedToolChoice,
    JsonValue,
    RequestTrace,
    ToolCallFormat,
)
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.request import RequestOptions
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from tests.conftest import default_gguf_path
from tests.model_utils import make_tiny_checkpoint

VOCAB = 49152  # SmolLM2's tokenizer
MAX_LEN = 512


def tiny_server_checkpoint(tmp: Path) -> Path:
    return make_tiny_checkpoint(
        tmp, "llama", seed=3, vocab_size=VOCAB, max_position_embeddings=MAX_LEN
    )


def exact_engine(model_dir: Path, **kw: Any) -> AsyncEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        tokenizer=str(default_gguf_path()),
        block_size=4,
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
        cpu_linear="onednn",
        kv_cache_dtype="float32",
        debug_invariants=True,
        **kw,
    )
    return AsyncEngine(cfg)


class SharedEngine:
    """An ``EngineClient`` that lends one started engine to several apps (tests only)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.inner = engine
        self._started = False
        # What the server asked of the engine, so tests can check the mapping.
        self.calls: list[tuple[list[int], SamplingParams, str, RequestOptions | None]] = []

    @property
    def tokenizer(self) -> ClientTokenizer:
        return self.inner.tokenizer

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def log_prompts(self) -> bool:
        return self.inner.log_prompts

    @property
    def traces_enabled(self) -> bool:
        return self.inner.traces_enabled

    @property
    def execution_info(self) -> Mapping[str, str]:
        return self.inner.execution_info

    @property
    def segment_policies(self) -> frozenset[str]:
        return self.inner.segment_policies

    @property
    def cache_config(self) -> Mapping[str, str]:
        return self.inner.cache_config

    def describe(self) -> str:
        return self.inner.describe()

    @property
    def fatal_error(self) -> str | None:
        return self.inner.fatal_error

    async def start(self) -> None:
        if not self._started:
            self._started = True
            await self.inner.start()

    async def shutdown(self) -> None:
        pass  # the module's finalizer stops the engine

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append((list(prompt_token_ids), params, request_id, options))
        return self.inner.generate(prompt_token_ids, params, request_id, options)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def get_stats(self) -> EngineStats:
        return self.inner.get_stats()

    def num_unfinished_requests(self) -> int:
        return self.inner.num_unfinished_requests()

    def tool_call_spec(
        self,
        tools: Sequence[Mapping[str, JsonValue]],
        tool_choice: ForcedToolChoice,
        tool_format: ToolCallFormat,
        parallel_tool_calls: bool,
    ) -> StructuredOutputSpec:
        return self.inner.tool_call_spec(tools, tool_choice, tool_format, parallel_tool_calls)

    async def get_trace(self, request_ids: Sequence[str]) -> RequestTrace | None:
        return await self.inner.get_trace(request_ids)


def _conforms(engine: SharedEngine) -> EngineClient:
    return engine


class Reference:
    """transformers on the same weights: greedy continuations and exact logprobs."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.eval()

    def log_softmax(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), vocab]``: row i is the distribution of the token after ``ids[:i+1]``."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(self.log_softmax(ids)[-1].argmax()))
        return ids[len(prompt) :]
