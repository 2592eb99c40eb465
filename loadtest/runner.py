"""Drives sessions against a server: closed loop or open (Poisson/gamma) loop.

Both loops are bounded twice: by a request budget and by a wall-clock
deadline. At the deadline no new request starts and the requests in flight are
cancelled; they are counted in ``LoadResult.cancelled`` (not as server
failures, and not in the metrics) so a truncated run is visible.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from loadtest.client import ClientConfig, send_request
from loadtest.metrics import RequestResult
from loadtest.workloads import Session


@dataclass
class LoadSpec:
    """How to drive the load.

    ``request_rate`` None means closed loop with ``concurrency`` workers. With a
    rate, sessions arrive with gamma-distributed gaps of mean ``1/request_rate``
    and shape ``burstiness`` (1.0 is a Poisson process; smaller is burstier),
    and ``concurrency``, if set, caps the sessions in flight.
    """

    num_requests: int
    max_duration_s: float
    concurrency: int | None = 1
    request_rate: float | None = None
    burstiness: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if not self.max_duration_s > 0 or math.isinf(self.max_duration_s):
            raise ValueError("--max-duration must be a positive, finite number of seconds")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.request_rate is None and self.concurrency is None:
            raise ValueError("a closed loop needs --concurrency")
        if self.request_rate is not None and not (
            self.request_rate > 0 and math.isfinite(self.request_rate)
        ):
            raise ValueError("--request-rate must be a positive, finite number")
        if not self.burstiness > 0:
            raise ValueError("--burstiness must be positive")


@dataclass
class LoadResult:
    """Per-request results in completion order and the run's wall-clock duration."""

    results: list[RequestResult]
    duration_s: float
    cancelled: int = 0
    hit_deadline: bool = False
    arrivals_s: list[float] = field(default_factory=list)


def gamma_intervals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """``n`` inter-arrival gaps: Gamma(shape=burstiness, scale=1/(rate*burstiness)).

    The mean gap is ``1/rate`` whatever the burstiness, as in vLLM's benchmark.
    """
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


class _Driver:
    """Shared state of one run: the budget, the results and the progress bar."""

    def __init__(
        self, client: httpx.AsyncClient, cfg: ClientConfig, budget: int, pbar: tqdm | None
    ) -> None:
        self.client = client
        self.cfg = cfg
        self.budget = budget
        self.issued = 0
        self.in_flight = 0
        self.cancelled = 0
        self.results: list[RequestResult] = []
        self.pbar = pbar
        self.t0 = time.perf_counter()

    async def run_session(self, s: Session) -> None:
        """Send the session's turns in order until the budget is spent.

        A failed turn ends its conversation: the next turn would need its answer.
        """
        for turn in range(len(s.turns)):
            if self.issued >= self.budget:
                return
            self.issued += 1
            spec = s.request(turn, self.cfg.endpoint)
            self.in_flight += 1
            try:
                r = await send_request(
                    self.client, self.cfg, spec, start_offset_s=time.perf_counter() - self.t0
                )
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.in_flight -= 1
            self.results.append(r)
            if self.pbar is not None:
                self.pbar.update(1)
            if not r.success:
                return
            s.record_answer(turn, r.generated_text)


async def run_load(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    sessions: list[Session],
    spec: LoadSpec,
    show_progress: bool = True,
    desc: str = "requests",
) -> LoadResult:
    """Run ``sessions`` under ``spec`` and return the results.

    Sessions are consumed in order; the run ends when the request budget is
    spent, the sessions run out, or ``max_duration_s`` passes.
    """
    spec.validate()
    pbar = tqdm(total=spec.num_requests, desc=desc, disable=not show_progress, leave=False)
    d = _Driver(client, cfg, spec.num_requests, pbar)
    arrivals: list[float] = []

    async def closed_worker(queue: list[Session]) -> None:
        while queue and d.issued < d.budget:
            await d.run_session(queue.pop(0))

    async def open_loop() -> None:
        assert spec.request_rate is not None
        sem = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
        gaps = gamma_intervals(len(sessions), spec.request_rate, spec.burstiness, spec.seed)
        tasks: list[asyncio.Task[None]] = []

        async def gated(s: Session) -> None:
            if sem is None:
                await d.run_session(s)
                return
            async with sem:
                await d.run_session(s)

        next_t = time.perf_counter()
        try:
            for s, gap in zip(sessions, gaps):
                next_t += gap
                delay = next_t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                arrivals.append(time.perf_counter() - d.t0)
                tasks.append(asyncio.create_task(gated(s)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    queue = list(sessions)
    if spec.request_rate is None:
        assert spec.concurrency is not None
        main: asyncio.Future[Any] = asyncio.gather(
            *(closed_worker(queue) for _ in range(spec.concurrency))
        )
    else:
        main = asyncio.ensure_future(open_loop())
    hit_deadline = False
    try:
        await asyncio.wait_for(main, timeout=spec.max_duration_s)
    except asyncio.TimeoutError:
        hit_deadline = True
    finally:
        pbar.close()
    duration = time.perf_counter() - d.t0
    return LoadResult(
        results=d.results,
        duration_s=duration,
        cancelled=d.cancelled,
        hit_deadline=hit_deadline,
        arrivals_s=arrivals,
    )
