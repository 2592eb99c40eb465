"""Engine-wide counters and gauges, read by the server's /metrics endpoint.

Counters only ever grow; the metrics layer turns them into Prometheus
counters by exporting deltas. Gauges are the state at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoeLayerStats:
    """Routing totals of one Mixture-of-Experts layer since start (counters).

    ``expert_tokens[e]``: token slots expert ``e`` computed (each token counts
    once per expert it was routed to); ``rerouted_tokens``: slots a capacity
    limit moved to an expert outside the token's top-k; ``dropped_tokens``:
    slots that found no expert with room and passed through on the residual.
    """

    layer: int
    expert_tokens: tuple[int, ...]
    rerouted_tokens: int = 0
    dropped_tokens: int = 0


@dataclass(frozen=True)
class TierStats:
    """One KV tier (device, host, disk): gauges, then counters (blocks unless named tokens)."""

    tier: str
    used_blocks: int
    capacity_blocks: int
    hit_tokens: int = 0  # prompt tokens found in this tier at first admission
    query_tokens: int = 0  # prompt tokens looked up in it (those the tiers above missed)
    stored_blocks: int = 0  # written into it (demotions, swap-outs, disk staging / write-through)
    read_blocks: int = 0  # read out of it towards the device (promotions, swap-ins)
    evicted_blocks: int = 0
    dropped_blocks: int = 0  # could not be stored (no room, writer queue full, writes off)
    corrupt_blocks: int = 0  # truncated, corrupted or foreign blocks found (each a miss)
    write_errors: int = 0


@dataclass(frozen=True)
class KVTierSnapshot:
    """The KV memory hierarchy at the last step. A fresh object each step (never
    mutated), so a copy of ``EngineStats`` may share it across threads."""

    tiers: tuple[TierStats, ...] = ()
    # Bytes and seconds moved per direction (GPU_to_CPU, CPU_to_GPU, DISK_to_CPU,
    # CPU_to_DISK: vLLM's transfer_type labels; "GPU" is the device pool).
    bytes_moved: tuple[tuple[str, int], ...] = ()
    seconds: tuple[tuple[str, float], ...] = ()
    swap_outs: int = 0  # preemptions that swapped (the others recomputed)
    swap_ins: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    num_swapped_waiting: int = 0  # gauge: requests waiting with their blocks in the host tier
    external_queries: int = 0  # tokens looked up below the device (vLLM's external prefix cache)
    external_hits: int = 0

    def tier(self, name: str) -> TierStats | None:
        return next((t for t in self.tiers if t.tier == name), None)


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
    # Mixture-of-Experts routing per MoE layer (empty for dense models); immutable
    # snapshots, replaced after each step.
    moe_layers: tuple[MoeLayerStats, ...] = ()
    kv_tiers: KVTierSnapshot = field(default_factory=KVTierSnapshot)
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)
