"""Data parallelism end to end on loopback: ``--data-parallel-size 2`` behind vllm-router.

One supervisor (``python -m server.cli --data-parallel-size 2 --router-policy
round_robin``) starts two replicas of a tiny random Llama (the default model's
tokenizer, so chat templates and text are real) and the real ``vllm-router``
0.1.17 in front; round robin, so that the streams of the kill test land on both
replicas for certain. The cache-aware comparison starts its own two routers
(``router_command``, the supervisor's flags) over the same replicas.
Everything goes through a router:

* requests as a client sends them, re-serialised by the router with its
  SGLang-style fields, are answered; extension fields set to other values are
  honoured or refused by name; ``X-Request-Id`` reaches the replica and back;
* a multi-conversation workload with a shared system prompt (turn by turn
  across 7 conversations, so round robin's order is fixed): every request
  succeeds, and the replicas' summed prefix-cache hit rate (their own
  ``/metrics``) is higher behind the cache-aware router than behind a
  round-robin router over the same replicas (distinct conversations per run),
  and the cache-aware router's ``/tokenize`` calls were answered 200;
* one replica is SIGKILLed while streams run on both: its streams end with a
  transport error, the survivor's finish, the router takes the dead replica out,
  later requests all succeed, the supervisor keeps serving and exits 1 on SIGTERM.

Every wait is bounded; the test runs last in its module order because it kills.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.data_parallel import find_router, router_command
from tests.conftest import default_gguf_path
from tests.live_server import REPO, free_port
from tests.model_utils import make_tiny_checkpoint

pytestmark = pytest.mark.slow

TIMEOUT = httpx.Timeout(60.0, connect=5.0)
WORDS = (
    "amber basalt cedar delta ember fjord granite harbor island juniper kelp lagoon meadow "
    "nebula orchard prairie quartz river savanna tundra upland valley willow xenon yarrow zephyr"
).split()


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if check():
                return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def free_run(n: int) -> int:
    """A port p with p .. p+n-1 all free on 127.0.0.1 right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def last_port_flag(pid: int) -> int | None:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    ports = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--port"]
    return int(ports[-1]) if ports else None


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))

    return total("vllm:prefix_cache_queries_total"), total("vllm:prefix_cache_hits_total")


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    url: str  # the router
    replicas: list[str]
    log: Path
    flags: list[str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    find_router("vllm-router")  # SystemExit with the install hint if missing
    tmp = tmp_path_factory.mktemp("scaleout")
    ckpt = make_tiny_checkpoint(tmp, "llama", vocab_size=49152, max_position_embeddings=2048)
    flags = [
        str(ckpt),
        "--tokenizer",
        str(default_gguf_path()),
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "64MiB",
        "--shutdown-timeout",
        "10",
    ]
    port = free_run(3)
    log = tmp / "stack.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                *flags,
                "--data-parallel-size",
                "2",
                "--router-policy",
                "round_robin",
                "--port",
                str(port),
                "--router-metrics-port",
                str(free_port()),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ},
        )
    url = f"http://127.0.0.1:{port}"
    replicas = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]
    try:

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"supervisor exited:\n{log.read_text()[-3000:]}")
            r = httpx.get(url + "/readiness", timeout=2)
            return r.status_code == 200 and r.json()["healthy_workers"] == 2

        wait_until(ready, 180, "both replicas healthy behind the router")
        yield Stack(proc, url, replicas, log, flags)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def chat(
    client: httpx.Client, url: str, messages: list[dict[str, str]], **kw: Any
) -> httpx.Response:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **kw}
    return client.post(url + "/v1/chat/completions", json=body)


# ---------------------------------------------------------------- requests


def test_requests_through_the_router(stack: Stack) -> None:
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        r = chat(c, stack.url, [{"role": "user", "content": "hello"}], user="u")
        assert r.status_code == 200, r.text
        assert r.json()["object"] == "chat.completion"
        r = c.post(
            stack.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6},
            headers={"X-Request-Id": "scaleout-probe-17"},
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "scaleout-probe-17"
        assert r.json()["id"].startswith("chatcmpl-scaleout-probe-17-")
        r = c.post(
            stack.url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0},
        )
        assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
        with c.stream(
            "POST",
            stack.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True},
        ) as s:
            lines = [ln for ln in s.iter_lines() if ln]
        assert s.status_code == 200 and lines[-1] == "data: [DONE]"
        models = c.get(stack.url + "/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["max_model_len"] == 2048
    # The replica logged the client's id (the router forwarded the header).
    wait_until(lambda: "request_id=scaleout-probe-17" in stack.log.read_text(), 10, "the log")


def first_stop_window(text: str) -> int:
    """An index i >= 3 where text[i:i+3] is a stop string first found there."""
    for i in range(3, len(text) - 3):
        window = text[i : i + 3]
        if window.strip() and text.find(window) == i:
            return i
    raise AssertionError(f"no usable stop string in {text!r}")


def test_extension_fields_through_the_router(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        text = chat(c, stack.url, messages, max_tokens=12).json()["choices"][0]["message"]
        text = text["content"]
        i = first_stop_window(text)
        stop = text[i : i + 3]
        trimmed = chat(c, stack.url, messages, max_tokens=12, stop=[stop]).json()
        kept = chat(c, stack.url, messages, max_tokens=12, stop=[stop], no_stop_trim=True).json()
        assert trimmed["choices"][0]["message"]["content"] == text[:i]
        assert kept["choices"][0]["message"]["content"] == text[: i + 3]
        r = chat(c, stack.url, messages, return_hidden_states=True)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "return_hidden_states"
        r = chat(c, stack.url, messages, include_reasoning=False)
        assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"
        # continue_final_message: the chat continuation is the completion of the
        # continued prompt (as /tokenize renders it), and echo puts the message first.
        partial = [*messages, {"role": "assistant", "content": text[: i + 3]}]
        cont = {"continue_final_message": True, "add_generation_prompt": False}
        ids = c.post(stack.url + "/tokenize", json={"messages": partial, **cont}).json()["tokens"]
        want = c.post(
            stack.url + "/v1/completions",
            json={"prompt": ids, "max_tokens": 8, "temperature": 0},
        ).json()["choices"][0]["text"]
        got = chat(c, stack.url, partial, **cont).json()["choices"][0]["message"]["content"]
        assert got == want
        echoed = chat(c, stack.url, partial, echo=True, **cont).json()
        assert echoed["choices"][0]["message"]["content"] == text[: i + 3] + want
        r = chat(c, stack.url, partial, continue_final_message=True)
        assert r.status_code == 400 and "add_generation_prompt" in r.json()["error"]["message"]


# ---------------------------------------------------------------- cache-aware routing


def conversations(tag: str, n: int, turns: int) -> list[list[str]]:
    """``n`` conversations of ``turns`` user messages; each opens with its own long text."""
    rng = random.Random(tag)
    out = []
    for i in range(n):
        opening = " ".join(rng.choice(WORDS) for _ in range(120))
        follow = [
            f"{tag} question {i}.{t}: {' '.join(rng.sample(WORDS, 6))}?" for t in range(turns)
        ]
        out.append([f"Notes {tag}-{i}: {opening}", *follow[1:]])
    return out


SYSTEM = "You are a field guide. Answer in a few words. " * 3


def run_workload(url: str, convs: list[list[str]]) -> list[int]:
    """Turn by turn across the conversations, one request at a time; statuses.

    One at a time keeps a round-robin router's order fixed: with an odd number
    of conversations, every follow-up turn lands on the other replica than the
    turn before it, so the comparison below does not depend on thread timing.
    """
    statuses: list[int] = []
    histories = [[{"role": "system", "content": SYSTEM}] for _ in convs]
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        for turn in range(len(convs[0])):
            for history, turns in zip(histories, convs):
                history.append({"role": "user", "content": turns[turn]})
                r = chat(c, url, history)
                statuses.append(r.status_code)
                if r.status_code != 200:
                    return statuses
                answer = r.json()["choices"][0]["message"]["content"]
                history.append({"role": "assistant", "content": answer})
    return statuses


def hit_rate_of_run(replicas: list[str], run: Callable[[], list[int]]) -> tuple[float, list[int]]:
    before = [prefix_counters(u) for u in replicas]
    statuses = run()
    after = [prefix_counters(u) for u in replicas]
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    assert queries > 0
    return hits / queries, statuses


@contextlib.contextmanager
def router(replicas: list[str], policy: Any, log: Path) -> Iterator[str]:
    """Our own vllm-router over ``replicas`` with the supervisor's flags; its URL."""
    port = free_port()
    cmd = router_command(
        find_router("vllm-router"),
        host="127.0.0.1",
        port=port,
        worker_urls=replicas,
        policy=policy,
        metrics_port=free_port(),
    )
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: httpx.get(url + "/readiness", timeout=2).json()["healthy_workers"] == 2,
            60,
            f"the {policy} router",
        )
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_cache_aware_beats_round_robin(stack: Stack, tmp_path: Path) -> None:
    n, turns = 7, 4  # an odd number of conversations (run_workload)
    rates: dict[str, float] = {}
    for policy in ("round_robin", "cache_aware"):
        with router(stack.replicas, policy, tmp_path / f"{policy}.log") as url:
            run = functools.partial(run_workload, url, conversations(policy, n, turns))
            rate, statuses = hit_rate_of_run(stack.replicas, run)
        assert statuses == [200] * (n * turns), (policy, statuses)
        rates[policy] = rate
    print(f"prefix-cache hit rate: {rates}")
    # Round robin moves each conversation's next turn to the other replica, which
    # has at best the turns before the last one cached (for turn 2, only the
    # shared system prompt); cache-aware routing keeps it where its history is.
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates
    # The cache-aware router asked the replicas for the prompts' token ids
    # (after the render probe, which is 404 as on a default vLLM) and got them.
    log = stack.log.read_text()
    assert re.search(r'"POST /tokenize HTTP/1.1" 200', log)
    assert not re.search(r'"POST /tokenize HTTP/1.1" 4', log)


# ---------------------------------------------------------------- a replica dies


def stream_until_done(url: str, prompt: str, results: dict[str, str], key: str) -> None:
    """One long streamed chat; records ``done``, ``cut: <error>`` or ``status <n>``."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(30.0, connect=5.0), trust_env=False) as c,
            c.stream("POST", url + "/v1/chat/completions", json=body) as s,
        ):
            if s.status_code != 200:
                results[key] = f"status {s.status_code}"
                return
            last = ""
            for line in s.iter_lines():
                if line:
                    last = line
            results[key] = "done" if last == "data: [DONE]" else f"cut: ended at {last[:60]!r}"
    except httpx.HTTPError as exc:
        results[key] = f"cut: {type(exc).__name__}"


def test_replica_killed_mid_run(stack: Stack) -> None:
    rng = random.Random(7)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(150)) for _ in range(4)]
    results: dict[str, str] = {}
    threads = [
        threading.Thread(target=stream_until_done, args=(stack.url, p, results, str(i)))
        for i, p in enumerate(prompts)
    ]
    for t in threads:
        t.start()

    def running(url: str) -> int:
        return int(httpx.get(url + "/get_load", timeout=2).json()["num_requests_running"])

    try:
        wait_until(lambda: all(running(u) > 0 for u in stack.replicas), 90, "streams on both")
    except AssertionError as exc:
        loads = [httpx.get(u + "/get_load", timeout=5).json() for u in stack.replicas]
        raise AssertionError(f"{exc}: loads {loads}, streams {results}") from None
    victim_port = int(stack.replicas[1].rsplit(":", 1)[1])
    (victim,) = [p for p in children(stack.proc.pid) if last_port_flag(p) == victim_port]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)  # 1500 tokens at up to ~0.2 s a step on a loaded machine
        assert not t.is_alive(), f"a stream hung: {results}"
    outcomes = sorted(results.values())
    assert any(o == "done" for o in outcomes), outcomes  # the survivor's streams
    assert any(o.startswith("cut") or o.startswith("status 5") for o in outcomes), outcomes

    def dead_is_out() -> bool:
        r = httpx.get(stack.url + "/readiness", timeout=2)
        return r.status_code == 200 and r.json()["healthy_workers"] == 1

    wait_until(dead_is_out, 30, "the router to take the dead replica out")
    with httpx.Client(timeout=TIMEOUT, trust_env=False) as c:
        later = [
            chat(c, stack.url, [{"role": "user", "content": f"after {i}: {prompts[i % 4]}"}])
            for i in range(6)
        ]
    assert [r.status_code for r in later] == [200] * 6, [r.text for r in later]
    assert stack.proc.poll() is None, "the supervisor must keep serving with one replica"
    assert re.search(
        r"replica 1 \(pid \d+, port \d+\) exited with status -9", stack.log.read_text()
    )
    # SIGTERM: the survivor drains, the router stops; status 1 because a replica died.
    kids = children(stack.proc.pid)
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=60) == 1
    for pid in kids:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"child {pid} left running"
    assert "Traceback" not in stack.log.read_text(), stack.log.read_text()[-3000:]


def _is_zombie(pid: int) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    return True
