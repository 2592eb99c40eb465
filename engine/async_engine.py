"""AsyncEngine: the asyncio face of the engine.

The step loop runs on its own thread so that the event loop (HTTP) stays
responsive while the model computes (torch releases the GIL in its kernels).
That thread also builds the LLMEngine: torch's OpenMP runtime keeps one
worker pool per thread that runs parallel regions, and with a second pool
alive (say, the executor thread that loaded the model) libgomp sees more
threads than cores and stops spin-waiting, so every parallel op pays a
futex wake-up: about 25% more time per decode step on a 2-core machine.
All engine state is touched only by that thread: ``generate`` and ``abort``
send commands that the thread applies at the next step boundary, and outputs
come back through ``loop.call_soon_threadsafe`` into per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, get_args

from engine.client import EngineClient, ForcedToolChoice, JsonValue, ToolCallFormat
from engine.config import EngineConfig, KVPolicyName
from engine.errors import EngineUnavailableError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import RequestOptions
from engine.sampling.params import SamplingParams, StructuredOutputSpec
from engine.stats import EngineStats
from engine.trace import RequestTrace

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# How long shutdown waits for the KV tiers' flush (one batched read of the
# cached blocks and a file each; seconds even for a large host tier). A hung
# disk must not hang the exit forever: past this the flush is abandoned.
_CLOSE_TIMEOUT_S = 300.0


@dataclass
class _Stream:
    """Where one request's outputs go: a queue on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    admitted: asyncio.Future[None]
    options: RequestOptions


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    """The engine's ``EngineClient`` (engine/client.py): an ``LLMEngine`` on its own thread."""

    def __init__(self, config: EngineConfig, engine: LLMEngine | None = None) -> None:
        """Build the engine (on the engine thread, see the module doc) and wait for it.

        Blocking: call it off the event loop. The step loop itself starts with
        :meth:`start`. Errors raised while building the engine are re-raised here.
        """
        self.config = config
        self._go = threading.Event()  # set by start() (or shutdown()) to enter the loop
        built: list[LLMEngine] = [] if engine is None else [engine]
        failed: list[BaseException] = []
        ready = threading.Event()

        def thread_main() -> None:
            try:
                if not built:
                    built.append(LLMEngine(config))
            except BaseException as e:
                failed.append(e)
                return
            finally:
                ready.set()
            self._go.wait()
            self._run()

        self._thread: threading.Thread | None = threading.Thread(
            target=thread_main, name="fuel-engine", daemon=True
        )
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            self._thread = None
            raise failed[0]
        self.engine = built[0]
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.info.model_name
        self.max_model_len = self.engine.info.max_model_len
        # The execution path chosen at start-up (served in /v1/models as "fuel").
        self.execution_info = self.engine.info.execution()
        self.cache_config = self.engine.info.cache_config()
        self.segment_policies = frozenset(
            name for name in get_args(KVPolicyName) if self.engine.kv_policies.reads_segments(name)
        )
        self.log_prompts = config.log_prompts
        self.traces_enabled = config.enable_request_traces
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats = EngineStats()
        self._unfinished = 0

    def describe(self) -> str:
        return self.engine.describe()

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    # ---- lifecycle ------------------------------------------------------
    async def start(self) -> None:
        self._go.set()

    async def shutdown(self) -> None:
        """Flush the KV tiers to disk (a graceful restart then finds every cached
        prefix: ``LLMEngine.close``), then stop the engine thread."""
        if self.is_running:
            try:
                await asyncio.wait_for(self.call(lambda eng: eng.close()), _CLOSE_TIMEOUT_S)
            except Exception:  # shutting down regardless: log, never hang or raise
                logger.exception("flushing the KV tiers at shutdown failed")
        self._stopping = True
        self._commands.put(None)
        self._go.set()  # a loop never started still has to see _stopping and exit
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            self._thread = None
        if self.engine.tp is not None:  # also when the loop died: stop the other ranks
            await asyncio.to_thread(self.engine.tp.close)

    @property
    def is_running(self) -> bool:
        return (
            self._go.is_set()
            and self._thread is not None
            and self._thread.is_alive()
            and self._dead is None
        )

    @property
    def fatal_error(self) -> str | None:
        """Why the engine loop died (None while it runs): it will not serve again."""
        return None if self._dead is None else f"{type(self._dead).__name__}: {self._dead}"

    # ---- requests -------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        options: RequestOptions | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs. Errors at admission raise before the first item.

        If the consumer stops iterating early (client gone, task cancelled),
        the request is aborted and its blocks are freed at the next step.
        """
        if not self.is_running:
            raise EngineUnavailableError("the engine is not running")
        self.engine.validate_request(prompt_token_ids, params, options or RequestOptions())
        if params.structured is not None:
            # Compiling can take a while: do it here, off the engine thread (cached there).
            await asyncio.to_thread(self.engine.compile_structured, params.structured)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        admitted: asyncio.Future[None] = loop.create_future()
        self._commands.put(
            _Add(
                request_id,
                list(prompt_token_ids),
                params,
                stream,
                admitted,
                options or RequestOptions(),
            )
        )
        finished = False
        try:
            await admitted
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], _T]) -> _T:
        """Run ``fn(engine)`` on the engine thread at a step boundary (tests, debug)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        self._commands.put(_Call(fn, done, loop))
        result: _T = await done
        return result

    def tool_call_spec(
        self,
        tools: Sequence[Mapping[str, JsonValue]],
        tool_choice: ForcedToolChoice,
        tool_format: ToolCallFormat,
        parallel_tool_calls: bool,
    ) -> StructuredOutputSpec:
        # The compiler is thread safe (built once under a lock), so no engine-thread hop.
        return self.engine.grammar.build_tool_call_spec(
            tools, tool_choice, tool_format, parallel_tool_calls=parallel_tool_calls
        )

    async def get_trace(self, request_ids: Sequence[str]) -> RequestTrace | None:
        if not self.traces_enabled:
            return None
        ids = list(request_ids)
        return await self.call(lambda eng: eng.get_trace(ids))

    def get_stats(self) -> EngineStats:
        return self._stats

    def num_unfinished_requests(self) -> int:
        return self._unfinished

    # ---- the engine thread -------------------------------------------------
    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            try:
                eng.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.stream, cmd.options
                )
            except Exception as e:  # admission said no: tell the caller
                _resolve(cmd.stream.loop, cmd.admitted, exc=e)
            else:
                _resolve(cmd.stream.loop, cmd.admitted)
        elif isinstance(cmd, _Abort):
            group = eng.groups.get(cmd.request_id)
            out = eng.abort(cmd.request_id)
            if group is not None and out is not None and isinstance(group.sink, _Stream):
                group.sink.put(out)
        else:
            try:
                _resolve(cmd.loop, cmd.done, value=cmd.fn(eng))
            except Exception as e:
                _resolve(cmd.loop, cmd.done, exc=e)

    def _next_command(self) -> _Add | _Abort | _Call | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stopping:
                eng.check_health()  # a dead tensor-parallel worker ends the loop here
                # Idle: block for the next command. Busy: take whatever is queued, then step.
                cmd: _Add | _Abort | _Call | None
                if eng.has_unfinished():
                    cmd = self._next_command()
                else:
                    try:
                        cmd = self._commands.get(timeout=0.5)
                    except queue.Empty:
                        continue
                while cmd is not None:
                    self._apply(cmd)
                    cmd = self._next_command()
                if self._stopping:
                    break
                if eng.has_unfinished():
                    for group, out in eng.step():
                        if isinstance(group.sink, _Stream):
                            group.sink.put(out)
                self._stats = _copy_stats(eng.stats)
                self._unfinished = len(eng.groups)
        except BaseException as e:  # the loop died: fail everyone, then refuse new work
            logger.exception("engine loop died")
            self._dead = e
            for gid, group in list(eng.groups.items()):
                if isinstance(group.sink, _Stream):
                    group.sink.put(EngineUnavailableError(f"the engine failed: {e}"))
                eng.groups.pop(gid, None)


def _resolve(
    loop: asyncio.AbstractEventLoop,
    fut: asyncio.Future[Any],
    value: Any = None,
    exc: BaseException | None = None,
) -> None:
    def done() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    loop.call_soon_threadsafe(done)


def _copy_stats(s: EngineStats) -> EngineStats:
    c = EngineStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})
    c.rejections = dict(s.rejections)
    return c


if TYPE_CHECKING:
    # AsyncEngine is the engine's EngineClient: mypy checks the conformance here.
    def _conforms(engine: AsyncEngine) -> EngineClient:
        return engine
