"""Prometheus metrics for ``GET /metrics``, named and labelled as vLLM v1 exports them.

Dashboards, alerts and routers written for vLLM read ``vllm:*`` series with the
labels ``model_name`` and ``engine``; pointed at Fuel Serve they must work
unchanged, so every metric vLLM also has keeps vLLM's name, type, labels and
bucket boundaries. The one deliberate difference: the inter-token latency
histograms get extra buckets below 10 ms (vLLM's lowest is 10 ms, which is
coarser than a small model's decode step), so quantiles stay meaningful there.

Metrics vLLM does not have are named ``fuel:*`` (never ``vllm:*``): a vLLM
dashboard must not read a series that only looks like vLLM's.

Each :class:`Metrics` owns its own ``CollectorRegistry`` (no global registry
state), so several instances (tests, several models) never collide.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from engine.client import EngineStats, MoeLayerStats
from engine.outputs import RequestMetrics

# vLLM v1's bucket boundaries (vllm/v1/metrics/loggers.py), kept as-is so that
# histogram_quantile over a mixed vLLM/Fuel fleet aggregates bucket by bucket.
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
# Our addition: finer boundaries below 10 ms (a superset of vLLM's, so any
# vLLM bucket boundary still exists here).
FINE_ITL_BUCKETS: tuple[float, ...] = (0.001, 0.002, 0.003, 0.005, 0.0075, *VLLM_ITL_BUCKETS)
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip

# vLLM pre-creates request_success for every FinishReason so the series exist
# (at 0) before the first request finishes; "error" is ours (engine.outputs).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")

DEFAULT_MAX_MODEL_LEN = 8192


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value`` (vLLM's token buckets)."""
    if max_value < 1:
        raise ValueError(f"max_value must be >= 1, got {max_value}")
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(float(value))
        scale *= 10


class Metrics:
    """All Prometheus series of one served model.

    Contracts:

    * ``update_from_stats`` is called by the engine loop after each step (or at
      any cadence): gauges are set to the snapshot; counters advance by the
      delta since the previous call, because :class:`EngineStats` counters are
      monotonic totals. A total that goes *down* (engine restarted) counts from
      zero again: the new total is added.
    * ``observe_finished`` is called once per finished request (any reason,
      including ``abort`` and ``error``).
    * ``observe_rejection`` counts a rejection the server saw (e.g. it caught
      ``RequestRejectedError``). Engine-side rejections also arrive through
      ``EngineStats.rejections``; since both usually report the *same* events,
      ``fuel:admission_rejections_total{reason}`` exports, per reason, the larger
      of the two totals rather than their sum (exact when one source sees a
      superset of the other's rejections for that reason).
    * ``render`` returns the text exposition and its content type.
    """

    def __init__(
        self, model_name: str, max_model_len: int = DEFAULT_MAX_MODEL_LEN, engine: str = "0"
    ) -> None:
        # Over 80 lines on purpose: one declaration per exported series, in one
        # place, so the list reads against vLLM's (names, types, buckets).
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name", "engine"]
        values = (model_name, engine)
        reg = self.registry
        token_buckets = build_1_2_5_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, registry=reg, buckets=buckets).labels(*values)

        # --- vLLM v1 names -------------------------------------------------
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # Older name still read by many dashboards and routers.
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. DEPRECATED: use vllm:kv_cache_usage_perc.",
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.gpu_prefix_cache_queries = counter(
            "vllm:gpu_prefix_cache_queries",
            "Prefix cache queries (tokens). DEPRECATED: use vllm:prefix_cache_queries.",
        )
        self.gpu_prefix_cache_hits = counter(
            "vllm:gpu_prefix_cache_hits",
            "Prefix cache hits (tokens). DEPRECATED: use vllm:prefix_cache_hits.",
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.spec_decode_num_drafts = counter(
            "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
        )
        self.spec_decode_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_decode_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        # One child per draft position, created (at 0) when the engine first
        # reports its number of speculative tokens.
        self._spec_per_pos_family = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*labels, "position"],
            registry=reg,
        )
        self._spec_per_pos: list[Counter] = []
        self._label_values = values
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self._request_success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self._request_success_family = success
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            token_buckets,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            token_buckets,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            FINE_ITL_BUCKETS,
        )
        # vLLM keeps this older name as an alias observing the same samples as ITL.
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: use vllm:inter_token_latency_seconds.",
            FINE_ITL_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            FINE_ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # --- Fuel extras (no vLLM equivalent) ------------------------------
        self._rejections_family = Counter(
            "fuel:admission_rejections",
            "Requests refused by admission control (HTTP 429), by reason.",
            [*labels, "reason"],
            registry=reg,
        )
        self._label_values = values
        self.latency_budget_misses = counter(
            "fuel:latency_budget_misses", "Requests that finished past their latency budget."
        )
        self.engine_steps = counter("fuel:engine_steps", "Engine steps (scheduler iterations).")
        self.num_preempted_waiting = gauge(
            "fuel:num_requests_preempted_waiting",
            "Preempted requests waiting to be rescheduled (included in num_requests_waiting).",
        )
        self.kv_cache_total_blocks = gauge(
            "fuel:kv_cache_total_blocks", "KV-cache blocks in total."
        )
        self.kv_cache_free_blocks = gauge("fuel:kv_cache_free_blocks", "KV-cache blocks free.")
        self.predictor_mean_abs_rel_error = gauge(
            "fuel:latency_predictor_mean_abs_rel_error",
            "Mean |predicted - actual| / actual completion time of finished requests, "
            "predicted at admission.",
        )
        self.predictor_samples = gauge(
            "fuel:latency_predictor_samples",
            "Finished requests scored against their admission-time latency prediction.",
        )

        # Mixture-of-Experts routing, per MoE layer (bounded by the model's depth:
        # per-expert series would be layers x experts, so load is one gauge per layer).
        moe_labels = [*labels, "layer"]
        self._moe_routed = Counter(
            "fuel:moe_routed_tokens",
            "Token slots computed by routed experts (a token counts once per expert), by layer.",
            moe_labels,
            registry=reg,
        )
        self._moe_rerouted = Counter(
            "fuel:moe_rerouted_tokens",
            "Token slots the expert capacity moved outside the token's top-k, by layer.",
            moe_labels,
            registry=reg,
        )
        self._moe_dropped = Counter(
            "fuel:moe_dropped_tokens",
            "Token slots the expert capacity dropped (residual only), by layer.",
            moe_labels,
            registry=reg,
        )
        self._moe_imbalance = Gauge(
            "fuel:moe_expert_load_imbalance",
            "Max over mean token slots per expert since the previous scrape, by layer "
            "(1: balanced; the number of experts: one expert took everything).",
            moe_labels,
            registry=reg,
        )
        self._last_moe: dict[int, MoeLayerStats] = {}
        self.kv_tiers = KVTierMetrics(reg, labels, values)

        # Rejections by reason: engine-side (from EngineStats), server-side
        # (observe_rejection) and what fuel:admission_rejections_total shows.
        self._engine_rejections: dict[str, int] = {}
        self._server_rejections: dict[str, int] = {}
        self._exported_rejections: dict[str, int] = {}
        # Totals seen at the previous update_from_stats call (delta baseline).
        self._last = EngineStats()

    # ------------------------------------------------------------------
    def update_from_stats(self, stats: EngineStats) -> None:
        """Set gauges from ``stats`` and advance counters by the delta since the last call.

        ``vllm:iteration_tokens_total`` gets one observation per engine step:
        when several steps passed since the last call, their per-step token
        counts are unknown here, so each of the ``k`` steps is observed at the
        mean ``delta_tokens / k`` (sum and count stay exact; the spread is lost).
        """
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        self.num_preempted_waiting.set(stats.num_preempted_waiting)
        self.kv_cache_total_blocks.set(stats.num_total_blocks)
        self.kv_cache_free_blocks.set(stats.num_free_blocks)
        self.predictor_mean_abs_rel_error.set(stats.predictor_mean_abs_rel_error)
        self.predictor_samples.set(stats.predictor_samples)

        last = self._last
        d_queries = _delta(stats.prefix_cache_queries, last.prefix_cache_queries)
        d_hits = _delta(stats.prefix_cache_hits, last.prefix_cache_hits)
        d_prompt = _delta(stats.prompt_tokens, last.prompt_tokens)
        d_gen = _delta(stats.generation_tokens, last.generation_tokens)
        d_steps = _delta(stats.num_steps, last.num_steps)
        self.prefix_cache_queries.inc(d_queries)
        self.gpu_prefix_cache_queries.inc(d_queries)
        self.prefix_cache_hits.inc(d_hits)
        self.gpu_prefix_cache_hits.inc(d_hits)
        self.num_preemptions.inc(_delta(stats.num_preemptions, last.num_preemptions))
        self.prompt_tokens.inc(d_prompt)
        self.generation_tokens.inc(d_gen)
        self.engine_steps.inc(d_steps)
        self.latency_budget_misses.inc(
            _delta(stats.latency_budget_misses, last.latency_budget_misses)
        )
        self.spec_decode_num_drafts.inc(
            _delta(stats.spec_decode_num_drafts, last.spec_decode_num_drafts)
        )
        self.spec_decode_draft_tokens.inc(
            _delta(stats.spec_decode_draft_tokens, last.spec_decode_draft_tokens)
        )
        per_pos = stats.spec_decode_accepted_per_pos
        while len(self._spec_per_pos) < len(per_pos):
            position = str(len(self._spec_per_pos))
            self._spec_per_pos.append(
                self._spec_per_pos_family.labels(*self._label_values, position)
            )
        last_pos = last.spec_decode_accepted_per_pos
        for i, total in enumerate(per_pos):
            self._spec_per_pos[i].inc(_delta(total, last_pos[i] if i < len(last_pos) else 0))
        self.spec_decode_accepted_tokens.inc(
            _delta(stats.spec_decode_accepted_tokens, last.spec_decode_accepted_tokens)
        )
        for reason, total in stats.rejections.items():
            d = _delta(total, last.rejections.get(reason, 0))
            if d:
                self._engine_rejections[reason] = self._engine_rejections.get(reason, 0) + d
                self._sync_rejections(reason)
        if d_steps > 0:
            per_step = (d_prompt + d_gen) / d_steps
            for _ in range(d_steps):
                self.iteration_tokens.observe(per_step)
        self._update_moe(stats.moe_layers)

        self.kv_tiers.update(stats)

        # Copy: the engine may keep mutating the object it handed us.
        self._last = EngineStats(
            num_steps=stats.num_steps,
            num_preemptions=stats.num_preemptions,
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generation_tokens,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            rejections=dict(stats.rejections),
            latency_budget_misses=stats.latency_budget_misses,
            spec_decode_num_drafts=stats.spec_decode_num_drafts,
            spec_decode_draft_tokens=stats.spec_decode_draft_tokens,
            spec_decode_accepted_tokens=stats.spec_decode_accepted_tokens,
            spec_decode_accepted_per_pos=list(stats.spec_decode_accepted_per_pos),
        )

    def _update_moe(self, layers: Sequence[MoeLayerStats]) -> None:
        """Advance the MoE counters by the delta per layer; the imbalance gauge covers
        the slots routed since the previous call (unchanged when none were)."""
        for layer in layers:
            last = self._last_moe.get(layer.layer)
            prev = last.expert_tokens if last is not None else (0,) * len(layer.expert_tokens)
            if len(prev) != len(layer.expert_tokens) or any(
                a < b for a, b in zip(layer.expert_tokens, prev)
            ):
                prev = (0,) * len(layer.expert_tokens)  # engine restarted: count from zero
            delta = [a - b for a, b in zip(layer.expert_tokens, prev)]
            values = (*self._label_values, str(layer.layer))
            self._moe_routed.labels(*values).inc(sum(delta))
            self._moe_rerouted.labels(*values).inc(
                _delta(layer.rerouted_tokens, last.rerouted_tokens if last else 0)
            )
            self._moe_dropped.labels(*values).inc(
                _delta(layer.dropped_tokens, last.dropped_tokens if last else 0)
            )
            total = sum(delta)
            if total > 0:
                self._moe_imbalance.labels(*values).set(max(delta) * len(delta) / total)
            self._last_moe[layer.layer] = layer

    def observe_finished(
        self,
        metrics: RequestMetrics,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        finish_reason: str,
        n: int,
        max_tokens: int | None,
        token_times: list[float] | None,
    ) -> None:
        """Record one finished request (vLLM v1 semantics).

        Spans (seconds, from the ``time.monotonic`` stamps in ``metrics``):
        TTFT = first_token - arrival; e2e = finished - arrival; queue =
        first_scheduled - arrival; prefill = first_token - first_scheduled;
        decode = last_token - first_token; inference = last_token -
        first_scheduled; per-request TPOT = decode / (generated - 1).
        A span whose stamps are missing (e.g. aborted while waiting) is not
        observed; the request is still counted in ``request_success``.

        ``token_times`` holds the monotonic times at which the request emitted
        output, in order (first element = first token). Each successive
        difference is one inter-token latency sample (also observed on the
        deprecated ``time_per_output_token_seconds``). ``None``: no ITL samples.

        ``max_tokens`` ``None`` (no limit asked) is not observed, as in vLLM.
        Raises ``ValueError`` on an unknown ``finish_reason`` or negative counts.
        """
        if finish_reason not in self._request_success:
            raise ValueError(
                f"unknown finish_reason {finish_reason!r}; expected one of {FINISH_REASONS}"
            )
        if num_prompt_tokens < 0 or num_generation_tokens < 0 or n < 1:
            raise ValueError("token counts must be >= 0 and n >= 1")
        self._request_success[finish_reason].inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.request_params_n.observe(n)
        if max_tokens is not None:
            self.request_params_max_tokens.observe(max_tokens)

        arrival = metrics.arrival_time
        scheduled = metrics.first_scheduled_time
        first = metrics.first_token_time
        last = metrics.last_token_time
        finished = metrics.finished_time
        if finished is not None:
            self.e2e_request_latency.observe(_span(arrival, finished))
        if scheduled is not None:
            self.request_queue_time.observe(_span(arrival, scheduled))
        if first is not None:
            self.time_to_first_token.observe(_span(arrival, first))
            if scheduled is not None:
                self.request_prefill_time.observe(_span(scheduled, first))
            if last is not None:
                decode = _span(first, last)
                self.request_decode_time.observe(decode)
                if num_generation_tokens > 1:
                    self.request_time_per_output_token.observe(decode / (num_generation_tokens - 1))
        if scheduled is not None and last is not None:
            self.request_inference_time.observe(_span(scheduled, last))
        if token_times:
            for prev, cur in pairwise(token_times):
                itl = _span(prev, cur)
                self.inter_token_latency.observe(itl)
                self.time_per_output_token.observe(itl)

    def observe_rejection(self, reason: str) -> None:
        """Count one rejection seen by the server (see the class contract on double counting)."""
        self._server_rejections[reason] = self._server_rejections.get(reason, 0) + 1
        self._sync_rejections(reason)

    def _sync_rejections(self, reason: str) -> None:
        # The exported count is max(engine total, server total) per reason: the
        # server typically observes the very rejections the engine also counts
        # (RequestRejectedError raised by the scheduler), and summing would count
        # each twice. Either source alone is exported exactly.
        target = max(self._engine_rejections.get(reason, 0), self._server_rejections.get(reason, 0))
        done = self._exported_rejections.get(reason, 0)
        if target > done:
            self._rejections_family.labels(*self._label_values, reason).inc(target - done)
            self._exported_rejections[reason] = target

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# TierStats field -> (series, help), one series per field with a ``tier`` label.
_TIER_GAUGES: dict[str, tuple[str, str]] = {
    "used_blocks": ("fuel:kv_tier_blocks_used", "KV blocks held, by tier."),
    "capacity_blocks": ("fuel:kv_tier_blocks_capacity", "KV blocks a tier can hold."),
}
_TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "hit_tokens": (
        "fuel:kv_tier_hit_tokens",
        "Prompt tokens served from each KV tier at first admission.",
    ),
    "query_tokens": (
        "fuel:kv_tier_query_tokens",
        "Prompt tokens looked up in each KV tier (those the tiers above missed).",
    ),
    "stored_blocks": (
        "fuel:kv_tier_stored_blocks",
        "Blocks written into a tier (demotions, swap-outs, disk staging and write-through).",
    ),
    "read_blocks": (
        "fuel:kv_tier_promoted_blocks",
        "Blocks read out of a tier towards the device (promotions, swap-ins).",
    ),
    "evicted_blocks": ("fuel:kv_tier_evicted_blocks", "Blocks evicted from a tier."),
    "dropped_blocks": (
        "fuel:kv_tier_dropped_blocks",
        "Blocks a tier could not store (no room, writer queue full, writes off).",
    ),
    "corrupt_blocks": (
        "fuel:kv_tier_corrupt_blocks",
        "Truncated, corrupted or foreign blocks found (each one a miss, never served).",
    ),
    "write_errors": (
        "fuel:kv_tier_write_errors",
        "Failed tier writes (disk full, read-only); writes stop after the first.",
    ),
}


class KVTierMetrics:
    """The KV tier series (device pool, host, disk) of one ``Metrics``.

    vLLM's names where vLLM has one: the external (KV connector / offloading)
    prefix cache counters, the offloading connector's bytes and seconds by
    ``transfer_type``, V0's swapped-requests gauge and the CPU offloading
    tier's usage; everything per tier is ``fuel:kv_tier_*`` with a ``tier``
    label. ``update`` follows ``Metrics.update_from_stats``'s contract
    (gauges set, counters advanced by the delta of monotonic totals).
    """

    def __init__(self, reg: CollectorRegistry, labels: list[str], values: tuple[str, str]) -> None:
        self._values = values

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        self.external_prefix_cache_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries (tokens looked up below the device pool: host, disk).",
        )
        self.external_prefix_cache_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits (tokens served from the host or disk KV tier).",
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached",
            "Prompt tokens served from any prefix cache tier instead of being computed.",
        )
        self.num_requests_swapped = gauge(
            "vllm:num_requests_swapped",
            "Requests waiting with their KV blocks swapped out to the host tier.",
        )
        self.cpu_cache_usage = gauge(
            "vllm:kv_offload_cpu_cache_usage_perc",
            "Host (CPU) KV tier usage. 1 means 100 percent usage.",
        )
        tier_labels = [*labels, "tier"]
        transfer_labels = [*labels, "transfer_type"]

        self._tier_gauges = {
            field: Gauge(name, doc, tier_labels, registry=reg)
            for field, (name, doc) in _TIER_GAUGES.items()
        }
        self._tier_counters = {
            field: Counter(name, doc, tier_labels, registry=reg)
            for field, (name, doc) in _TIER_COUNTERS.items()
        }
        self._offload_bytes = Counter(
            "vllm:kv_offload_total_bytes",
            "Bytes moved between KV tiers, by transfer_type (GPU is the device pool).",
            transfer_labels,
            registry=reg,
        )
        self._offload_time = Counter(
            "vllm:kv_offload_total_time",
            "Seconds spent moving KV blocks between tiers, by transfer_type.",
            transfer_labels,
            registry=reg,
        )
        self.swap_outs = counter("fuel:kv_swap_outs", "Preemptions that swapped a request out.")
        self.swap_ins = counter("fuel:kv_swap_ins", "Swapped-out requests swapped back in.")
        self.swapped_out_blocks = counter(
            "fuel:kv_swapped_out_blocks", "KV blocks parked in the host tier by swap-outs."
        )
        self.swapped_in_blocks = counter(
            "fuel:kv_swapped_in_blocks", "KV blocks brought back by swap-ins."
        )
        self._last: dict[tuple[str, str], float] = {}

    def update(self, stats: EngineStats) -> None:
        """KV tier gauges, and counter deltas against the totals seen last time."""
        snap = stats.kv_tiers
        last = self._last
        values = self._values

        def advance(key: tuple[str, str], total: float, metric: Counter) -> None:
            prev = last.get(key, 0.0)
            d = total - prev if total >= prev else total
            if d:
                metric.inc(d)
            last[key] = total

        self.num_requests_swapped.set(snap.num_swapped_waiting)
        host = snap.tier("host")
        self.cpu_cache_usage.set(
            host.used_blocks / host.capacity_blocks if host and host.capacity_blocks else 0.0
        )
        for t in snap.tiers:
            for name, g in self._tier_gauges.items():
                g.labels(*values, t.tier).set(getattr(t, name))
            for name, c in self._tier_counters.items():
                advance((name, t.tier), getattr(t, name), c.labels(*values, t.tier))
        for direction, n in snap.bytes_moved:
            advance(("bytes", direction), n, self._offload_bytes.labels(*values, direction))
        for direction, sec in snap.seconds:
            advance(("seconds", direction), sec, self._offload_time.labels(*values, direction))
        advance(("external", "queries"), snap.external_queries, self.external_prefix_cache_queries)
        advance(("external", "hits"), snap.external_hits, self.external_prefix_cache_hits)
        cached = stats.prefix_cache_hits + snap.external_hits
        advance(("prompt", "cached"), cached, self.prompt_tokens_cached)
        advance(("swap", "outs"), snap.swap_outs, self.swap_outs)
        advance(("swap", "ins"), snap.swap_ins, self.swap_ins)
        advance(("swap", "out_blocks"), snap.swapped_out_blocks, self.swapped_out_blocks)
        advance(("swap", "in_blocks"), snap.swapped_in_blocks, self.swapped_in_blocks)


def _delta(total: int, previous: int) -> int:
    # A total below the previous one means the engine restarted and counts from 0
    # again: everything it counted since then is new.
    return total - previous if total >= previous else total


def _span(start: float, end: float) -> float:
    # Clocks are monotonic, so a negative span is a caller bug; clamp rather than
    # poison a histogram's _sum (Prometheus histograms reject nothing).
    return max(0.0, end - start)
