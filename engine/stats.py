"""Engine-wide counters and gauges, read by the server's /metrics endpoint.

Counters only ever grow; the metrics layer turns them into Prometheus
counters by exporting deltas. Gauges are the state at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    # Gauges (state after the last step).
    num_running: int = 0
    num_waiting: int = 0
    num_preempted_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_total_blocks: int = 0
    num_free_blocks: int = 0
    # Counters (monotonic since start).
    num_steps: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (prefix hits excluded)
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    rejections: dict[str, int] = field(default_factory=dict)  # admission rejections by reason
    latency_budget_misses: int = 0  # finished (stop/length) after their latency_budget_ms
    # Latency predictor accuracy: requests that finished (stop/length) scored
    # against the completion time predicted at admission (see
    # engine.policies.PredictionErrorStats); the means are over all of them.
    predictor_samples: int = 0
    predictor_mean_abs_rel_error: float = 0.0
    predictor_mean_rel_error: float = 0.0  # signed: > 0 means predictions too long
    # Speculative decoding (vLLM's spec_decode_* counters): verifications that had
    # drafts, draft tokens verified, drafts accepted, and accepted per draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_draft_tokens: int = 0
    spec_decode_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
