"""Low-rank keys on a live server: the flag reaches the engine, answers come
back through the OpenAI SDK with logprobs, /v1/models names the key rank, and
nothing stays running after the answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import default_gguf_path
from tests.live_server import live_server
from tests.model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.slow  # starts a server process


def test_low_rank_keys_served(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "llama", vocab_size=49152)
    flags = [
        str(ckpt),
        "--tokenizer",
        str(default_gguf_path()),
        "--kv-low-rank-keys",
        "8",
        "--kv-cache-memory",
        "8MiB",
        "--served-model-name",
        "tiny",
    ]
    with live_server(flags, tmp_path / "server.log") as (_, base):
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert models["data"][0]["fuel"]["kv_key_rank"] == "8"
        sdk = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        out = sdk.completions.create(
            model="tiny", prompt="Hello there, how are", max_tokens=6, temperature=0, logprobs=2
        )
        choice = out.choices[0]
        assert out.usage is not None and out.usage.completion_tokens == 6
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 6
        again = sdk.completions.create(
            model="tiny", prompt="Hello there, how are", max_tokens=6, temperature=0
        )
        assert again.choices[0].text == choice.text  # greedy, and served from the prefix cache
        load = httpx.get(f"{base}/get_load", timeout=30).json()
        assert load["load"] == 0 and load["num_requests_running"] == 0
    assert "low-rank keys: rank 8 of 16" in (tmp_path / "server.log").read_text()
