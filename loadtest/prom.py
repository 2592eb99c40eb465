"""A server's Prometheus ``/metrics``, read with prometheus-client's own parser.

The benchmarks read counters (summed over label values, or filtered by some
labels) and info gauges' labels from the exposition text; this is the one
place that fetches and parses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str  # the sample's own name (``..._total`` for a counter)
    labels: dict[str, str]
    value: float


def scrape(url: str) -> list[Sample]:
    """Every sample of ``url``'s ``/metrics`` (loopback: no proxy)."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10, trust_env=False).text
    return [
        Sample(s.name, dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def by_label(samples: list[Sample], name: str, label: str) -> dict[str, float]:
    """``name``'s values keyed by one label's value (summed over the other labels)."""
    out: dict[str, float] = {}
    for s in samples:
        if s.name == name and label in s.labels:
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def info_labels(samples: list[Sample], name: str) -> dict[str, str]:
    """The labels of an info-style gauge (its first sample), e.g. ``vllm:cache_config_info``."""
    for s in samples:
        if s.name == name:
            return s.labels
    raise LookupError(f"/metrics has no {name}")
