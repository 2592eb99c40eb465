"""The ``kv_policy`` request extension over HTTP (issue 17), on the real tiny engine.

The shared server runs ``--kv-policy full`` (MAX_LEN 512 tokens of context):
a request may narrow it to a windowed policy and then send a prompt and ask
for output past the context; without the extension the same request keeps
today's ``context_length_exceeded`` 400; what widens or is unknown is a 400
naming ``kv_policy``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from engine.request import KVPolicyRequest
from server.app import build_app
from server.config import ServerConfig
from tests.real_engine import MAX_LEN, SharedEngine

COMP = "/v1/completions"


@pytest.fixture(scope="module")
def client(tiny_server_engine: SharedEngine) -> Iterator[TestClient]:
    with TestClient(build_app(tiny_server_engine, ServerConfig())) as c:
        yield c


def long_prompt() -> list[int]:
    return [1000 + (37 * i) % 5000 for i in range(MAX_LEN + 100)]


def test_windowed_request_runs_past_the_context(
    client: TestClient, tiny_server_engine: SharedEngine
) -> None:
    body = {
        "prompt": long_prompt(),
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
        "kv_policy": {"type": "streaming", "budget_tokens": 48, "sink_tokens": 4},
    }
    r = client.post(COMP, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 40
    assert tiny_server_engine.calls[-1][3] is not None
    assert tiny_server_engine.calls[-1][3].kv_policy == KVPolicyRequest("streaming", 48, 4)
    # Without the extension: today's 400, unchanged.
    del body["kv_policy"]
    r = client.post(COMP, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "policy",
    [
        {"type": "full", "budget_tokens": 64},  # full takes no budget
        {"type": "h2o"},  # no budget: the server has none to inherit
        {"type": "streaming", "budget_tokens": 16, "sink_tokens": 16},
        {"type": "streaming", "budget_tokens": MAX_LEN},  # budget + interval > context
    ],
)
def test_bad_kv_policy_is_a_400_naming_it(client: TestClient, policy: dict[str, object]) -> None:
    r = client.post(COMP, json={"prompt": [1000, 1001], "max_tokens": 2, "kv_policy": policy})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_policy"


@pytest.mark.parametrize(
    "policy", [{"type": "lru", "budget_tokens": 64}, {"budget_tokens": 1}, {"window": 3}]
)
def test_unknown_kv_policy_fields_are_refused(
    client: TestClient, policy: dict[str, object]
) -> None:
    r = client.post(COMP, json={"prompt": [1000, 1001], "max_tokens": 2, "kv_policy": policy})
    assert r.status_code == 400, r.text
    assert "kv_policy" in r.text


def test_models_say_whether_the_context_is_windowed(client: TestClient) -> None:
    m = client.get("/v1/models").json()["data"][0]
    assert m["kv_policy"] == {
        "default": "full",
        "windowed_context": False,
        "request_extension": True,
    }
    assert m["fuel"]["kv_policy"] == "full"
