"""KV tiers in a live server: a prefix that fell out of a small device pool is
served again from the host tier, and from the disk tier after a restart.

One real ``fuel-serve`` process (tiny random checkpoint, 4-token blocks, a
16-block device pool), stopped with SIGINT (the graceful drain, which flushes
the tiers) and started again on the same disk directory. The evidence is
what a client sees: ``usage.prompt_tokens_details.cached_tokens`` and the
server's own ``/metrics``; the completions must be the same text each time.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import default_gguf_path
from tests.live_server import live_server
from tests.model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.slow


def _metric(base: str, name: str, tier: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    pat = rf'^{re.escape(name)}{{[^}}]*tier="{tier}"[^}}]*}} ([0-9.e+-]+)$'
    return sum(float(v) for v in re.findall(pat, text, re.M))


def _complete(client: httpx.Client, model: str, prompt: list[int]) -> dict[str, Any]:
    r = client.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_prefix_served_from_host_then_from_disk_after_restart(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "llama")
    flags = [
        str(ckpt),
        "--tokenizer",
        str(default_gguf_path()),
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "16",
        "--num-host-blocks-override",
        "256",
        "--kv-offloading-disk-path",
        str(tmp_path / "kv"),
        "--shutdown-timeout",
        "30",
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(41)] for _ in range(4)]
    cacheable = (41 - 1) // 4 * 4  # whole blocks, one token left to compute
    with live_server(flags, tmp_path / "first.log") as (_, base):
        with httpx.Client(base_url=base, timeout=60) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            first = _complete(client, model, prompts[0])
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            for p in prompts[1:]:  # 3 x 11 blocks through a 16-block pool: prompt 0 falls out
                _complete(client, model, p)
            again = _complete(client, model, prompts[0])
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cacheable
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            assert _metric(base, "fuel:kv_tier_hit_tokens_total", "host") == cacheable
            assert _metric(base, "fuel:kv_tier_blocks_used", "host") > 0
    with live_server(flags, tmp_path / "second.log") as (_, base):
        with httpx.Client(base_url=base, timeout=60) as client:
            after = _complete(client, model, prompts[0])
            assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == cacheable
            assert after["choices"][0]["text"] == first["choices"][0]["text"]
            assert _metric(base, "fuel:kv_tier_hit_tokens_total", "disk") == cacheable
            assert _metric(base, "fuel:kv_tier_corrupt_blocks_total", "disk") == 0
    assert "flushed" in (tmp_path / "first.log").read_text()
