"""Real clients against a live default server started with no flags (issue 22's "Done when").

* LangChain: ``ChatOpenAI(...).bind_tools([...])`` with the default tool_choice
  (auto), ``"required"`` and a named tool, and an agent round trip (assistant
  tool_calls message, tool message, final answer).
* lm-evaluation-harness: ``local-completions`` on a small multiple-choice
  loglikelihood task (tests/data/lm_eval, no download; the tokenizer is the
  default GGUF's, saved as a local Hugging Face directory), once with prefix
  caching on (the default: the choices of a question share their context, so
  they hit the cache) and once with ``--no-enable-prefix-caching``: the scores
  and every loglikelihood must agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.conftest import default_gguf_path
from tests.differential import ROUNDED_LOGPROB_ATOL
from tests.live_server import live_server

pytestmark = pytest.mark.slow  # a live default server (twice for lm-eval)

DATA = Path(__file__).parent / "data" / "lm_eval" / "tiny_mc.jsonl"
MODEL = "SmolLM2-135M-Instruct"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("default-server") / "server.log"
    with live_server([], log) as (_, url):  # no flags: what ./scripts/serve.sh runs
        yield url


# ----------------------------------------------------------------- LangChain


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return json.dumps({"city": city, "temperature": 21, "condition": "sunny"})


def _llm(base: str) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=f"{base}/v1",
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        timeout=600,
    )


def _valid_calls(calls: list[dict[str, Any]]) -> None:
    assert calls, "expected at least one tool call"
    for call in calls:
        assert call["name"] == "get_weather" and call["id"], call
        jsonschema.validate(call["args"], WEATHER_SCHEMA)


def test_langchain_bind_tools_default_required_named_and_round_trip(base: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = _llm(base)
    question = [HumanMessage("What is the weather in Paris?")]
    # Default tool_choice (auto): accepted by a server started with no flags.
    auto = llm.bind_tools([get_weather]).invoke(question)
    if auto.tool_calls:
        _valid_calls(auto.tool_calls)
    else:
        assert isinstance(auto.content, str) and auto.content
    forced = llm.bind_tools([get_weather], tool_choice="required").invoke(question)
    _valid_calls(forced.tool_calls)
    assert forced.response_metadata["finish_reason"] == "tool_calls"
    named = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(question)
    _valid_calls(named.tool_calls)
    assert len(named.tool_calls) == 1
    # Agent round trip: the call, its result, then a final answer in words.
    history = [*question, forced]
    history += [
        ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
        for call in forced.tool_calls
    ]
    final = llm.invoke(history)
    assert isinstance(final.content, str) and final.content.strip()
    assert not final.tool_calls and final.response_metadata["finish_reason"] == "stop"
    with_tools = llm.bind_tools([get_weather]).invoke(history)
    assert with_tools.content or with_tools.tool_calls


# ------------------------------------------------------ lm-evaluation-harness


def _task_dir(tmp: Path) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "fuel_tiny_mc.yaml").write_text(
        "\n".join(
            [
                "task: fuel_tiny_mc",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {DATA}",
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{question}}"',
                'doc_to_choice: "{{choices}}"',
                'doc_to_target: "{{answer}}"',
                "metric_list:",
                "  - metric: acc",
                "",
            ]
        )
    )
    return tmp


def _tokenizer_dir(tmp: Path) -> Path:
    from engine.text.tokenizer import Tokenizer

    out = tmp / "tokenizer"
    Tokenizer.load(default_gguf_path()).hf_tokenizer.save_pretrained(str(out))
    return out


def _evaluate(url: str, tasks: Path, tokenizer: Path) -> tuple[float, list[float]]:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"model={MODEL},base_url={url}/v1/completions,tokenizer={tokenizer},"
            "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,"
            "max_retries=1"
        ),
        tasks=["fuel_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=1,
    )
    assert results is not None
    acc = float(results["results"]["fuel_tiny_mc"]["acc,none"])
    lls = [
        float(resp[0][0])
        for sample in sorted(results["samples"]["fuel_tiny_mc"], key=lambda s: s["doc_id"])
        for resp in sample["resps"]
    ]
    return acc, lls


@pytest.mark.timeout(1800)  # two evaluations and a second server start on a loaded CI box
def test_lm_eval_loglikelihood_equal_with_and_without_prefix_cache(
    base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tasks = _task_dir(tmp_path / "tasks")
    tokenizer = _tokenizer_dir(tmp_path)
    cached_acc, cached = _evaluate(base, tasks, tokenizer)
    log = tmp_path / "no-cache.log"
    with live_server(["--no-enable-prefix-caching"], log) as (_, url):
        plain_acc, plain = _evaluate(url, tasks, tokenizer)
    n_choices = sum(len(json.loads(line)["choices"]) for line in DATA.read_text().splitlines())
    assert len(cached) == len(plain) == n_choices
    assert cached_acc == plain_acc
    # Both servers run the default numerics (Q4_1 linears with per-row activation
    # codes, float16 KV): a prefix hit, whole-block or partial, changes how a
    # prompt is chunked and batched, which moves a rounding step now and then.
    # The differential suite's bound for these modes (tests/differential.py says
    # why; measured here up to 3.6e-3). Exact mode is held to 1e-4 there.
    for a, b in zip(cached, plain):
        assert abs(a - b) < ROUNDED_LOGPROB_ATOL, (cached, plain)
