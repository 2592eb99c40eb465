"""The server's KV policy setting narrowed by a request's ``kv_policy`` extension.

Narrowing only: a request may pick a policy and a budget no larger than the
server's (any budget when the server keeps every token: that uses less
memory, never more), and other sink counts below its budget. It may not ask
for ``full`` under a server that bounds memory, nor for a budget above the
server's: both widen, and are refused (400 naming ``kv_policy``).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig, KVPolicyName
from engine.errors import InvalidRequestError
from engine.request import KVPolicyRequest


@dataclass(frozen=True)
class KVPolicySpec:
    """A resolved, non-``full`` policy for one request."""

    name: KVPolicyName
    budget: int
    sinks: int
    interval: int


def policy_unavailable(config: EngineConfig, has_rope: bool) -> str | None:
    """Why no request may run a KV policy other than ``full`` on this engine (None:
    it may). The same conditions refuse ``--kv-policy`` at start-up (EngineConfig,
    LLMEngine); this is the request-side twin, for a ``full`` server whose
    requests narrow it with ``kv_policy``."""
    if config.speculative_config is not None:
        return "speculative decoding (--speculative-config)"
    if config.tensor_parallel_size > 1:
        return "tensor parallelism (compaction moves rank 0's cache only)"
    if config.kv_cache_dtype.startswith("kivi"):
        return f"--kv-cache-dtype {config.kv_cache_dtype} (KIVI blocks are not compacted)"
    if not has_rope:
        return "this model (compaction re-rotates keys, and it has no RoPE)"
    return None


def resolve_policy(
    config: EngineConfig,
    asked: KVPolicyRequest | None,
    max_model_len: int,
    unavailable: str | None = None,
) -> KVPolicySpec | None:
    """The policy a request runs under; None is ``full``. ``unavailable``: what
    :func:`policy_unavailable` says of this engine. Raises InvalidRequestError."""
    server = config.kv_policy
    if asked is None or asked == KVPolicyRequest():
        if server == "full":
            return None
        assert config.kv_budget_tokens is not None  # EngineConfig checks it
        return KVPolicySpec(
            server, config.kv_budget_tokens, config.num_sink_tokens, config.kv_evict_interval
        )
    name = asked.type or server
    if name != "full" and unavailable is not None:
        raise InvalidRequestError(
            f"kv_policy is not supported with {unavailable}", param="kv_policy"
        )
    if name == "full":
        if server != "full":
            raise InvalidRequestError(
                f"kv_policy.type 'full' would widen the server's KV policy ({server}, "
                f"{config.kv_budget_tokens} tokens per sequence)",
                param="kv_policy",
            )
        raise InvalidRequestError(
            "kv_policy.budget_tokens and sink_tokens need a type other than 'full'",
            param="kv_policy",
        )
    budget = asked.budget_tokens if asked.budget_tokens is not None else config.kv_budget_tokens
    if budget is None:
        raise InvalidRequestError(
            "kv_policy.budget_tokens is required (the server keeps every token: --kv-policy full)",
            param="kv_policy",
        )
    if config.kv_budget_tokens is not None and budget > config.kv_budget_tokens:
        raise InvalidRequestError(
            f"kv_policy.budget_tokens {budget} would widen the server's budget "
            f"({config.kv_budget_tokens} tokens)",
            param="kv_policy",
        )
    sinks = asked.sink_tokens if asked.sink_tokens is not None else config.num_sink_tokens
    if sinks >= budget:
        raise InvalidRequestError(
            f"kv_policy.sink_tokens ({sinks}) must be below budget_tokens ({budget})",
            param="kv_policy",
        )
    interval = config.kv_evict_interval
    if budget + interval > max_model_len:
        raise InvalidRequestError(
            f"kv_policy.budget_tokens {budget} plus the eviction interval ({interval}) exceeds "
            f"the model's context ({max_model_len} tokens)",
            param="kv_policy",
        )
    return KVPolicySpec(name, budget, sinks, interval)
