"""A request as the scheduler sees it: its tokens and how many are computed.

One scheduling model: a step computes "the next N tokens" of a request,
``all_token_ids[num_computed_tokens : num_computed_tokens + N]``. Prefill,
chunked prefill, prefix-cache hits (which advance ``num_computed_tokens``
without compute) and decode (N = 1) are all that one operation.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.config import KVPolicyName
from engine.outputs import RequestMetrics
from engine.sampling.params import SamplingParams
from engine.segments import Segment as Segment
from engine.segments import SegmentKind as SegmentKind

if TYPE_CHECKING:
    from engine.kv.host_tier import HostEntry
    from engine.kv.policies.state import KVPolicyState


@dataclass(frozen=True)
class KVPolicyRequest:
    """The ``kv_policy`` request extension: a per-request KV policy that may only
    narrow the server's (engine/kv/policies/resolve.py checks that). ``None``
    fields inherit the server's setting."""

    type: KVPolicyName | None = None
    budget_tokens: int | None = None
    sink_tokens: int | None = None


@dataclass(frozen=True)
class RequestOptions:
    """Per-request options beyond sampling, as the server passes them to the engine.

    One typed bundle instead of a keyword list repeated at every layer: a new
    request extension is one field here (and its use where the engine reads it).
    """

    priority: int = 0  # lower runs sooner (vLLM's convention)
    cache_salt: str | None = None  # isolates this request's prefix-cache entries
    latency_budget_ms: float | None = None  # finish-by budget (admission and EDF)
    ttft_budget_ms: float | None = None  # first-token budget (admission)
    # The prompt's per-message token spans, in order and disjoint (the chat
    # template renderer fills it); empty when the prompt was not a rendered chat.
    segments: tuple[Segment, ...] = ()
    kv_policy: KVPolicyRequest | None = None  # narrows --kv-policy for this request


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Request:
    """One sequence being generated (a choice of an n > 1 request is its own Request).

    Invariants (checked in debug mode after every step):
    * ``block_ids`` covers exactly ``ceil(num_kv_tokens / block_size)``
      blocks between steps (``num_kv_tokens == num_computed_tokens`` unless a
      KV policy evicted tokens); during a step it covers the scheduled tokens too.
    * ``num_computed_tokens <= len(all_token_ids)``.
    The request owns one reference to every block in ``block_ids`` (and one
    pin on every entry of ``swapped_blocks``) and gives them all back
    (KVCacheManager.free) when it finishes or is preempted.
    """

    request_id: str
    group_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic seconds: finish-by (latency budget)
    ttft_deadline: float | None = None
    cache_salt: str | None = None
    max_model_len: int = 1 << 30

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    # ... and how many of them each KV tier served ("device", "host", "disk").
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Prompt positions 0..num_prompt_logprobs-1 have their logprobs computed and
    # handed to the output (position 0 has none: nothing predicts it). Only the
    # request that reports them (choice 0 of a group that asked) tracks this.
    num_prompt_logprobs: int = 1
    block_ids: list[int] = field(default_factory=list)
    # Speculative drafts the next schedule may reserve slots for (set before each
    # step by the speculation planner; 0 without speculation).
    num_lookahead_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # keys of the request's full blocks
    # Swap preemption: the host-tier entries (pinned for this request) holding
    # its blocks while it waits, and how many computed tokens they hold. Empty
    # unless it was swapped out (KVCacheManager.swap_out); a swapped-out
    # request holds no device block and has num_computed_tokens == 0.
    swapped_blocks: list[HostEntry] = field(default_factory=list)
    swapped_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Set for choices 1..n-1: admitted only after the first choice computed the
    # prompt, so that they share its blocks instead of recomputing it.
    prefix_source: Request | None = None
    # Structured output: a grammar matcher (engine.sampling.grammar.GrammarState) whose
    # mask constrains sampling; advanced with every sampled token.
    grammar: Any = None
    # KV policies (engine/kv/policies/): tokens dropped from the front part of
    # the cache so far. The cache holds ``num_computed_tokens -
    # num_evicted_tokens`` tokens at cache positions 0..kv_len-1 (the kept
    # keys are re-rotated to them), so every KV block count below uses
    # ``num_kv_tokens``; token indices (``all_token_ids``) are unchanged.
    num_evicted_tokens: int = 0
    # The most tokens the cache may hold after a step (None: no cap, the
    # ``full`` policy). The scheduler caps chunks and prefix hits by it.
    kv_cap: int | None = None
    kv_state: KVPolicyState | None = None  # the policy's per-request scores and map

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.metrics.arrival_time = self.arrival_time
        if self.params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed + self.index)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens the KV cache holds for this request (computed minus evicted)."""
        return self.num_computed_tokens - self.num_evicted_tokens

    def kv_room(self) -> int:
        """New tokens one step may add under ``kv_cap`` (large without a cap)."""
        if self.kv_cap is None:
            return 1 << 62
        return self.kv_cap - self.num_kv_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are asked for, reported by choice 0, and some are still missing."""
        return (
            self.params.prompt_logprobs is not None
            and self.index == 0
            and self.num_prompt_logprobs < self.num_prompt_tokens
        )

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most output this request may produce."""
        max_out = self.params.max_tokens
        total = self.num_prompt_tokens + (max_out if max_out is not None else self.max_model_len)
        return min(total, self.max_model_len)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def cache_extra_key(self) -> bytes:
        return self.cache_salt.encode() if self.cache_salt else b""
