"""The engine on one background thread, and the per-request streams the event loop reads.

The engine is not thread-safe, so exactly one thread (`kvpilot-engine`) loads it and then owns
it: it drains a command queue (add / abort / stop) before every step, runs `step()`, and hands each
step's outputs to the event loop that owns each request with `call_soon_threadsafe`, one callback
per loop per step. The event loop therefore never blocks on the engine, and an abort reaches the
engine before its next step (so a disconnected client's KV blocks are freed within one step).

A RequestStream keeps only the *latest* cumulative output: outputs are cumulative, so a slow reader
loses nothing by skipping intermediate ones, and memory per request stays constant.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from kvpilot.engine.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.metrics import EngineCounters, ServerMetrics, finished_reason

logger = logging.getLogger("kvpilot.server")


class RequestFailed(RuntimeError):
    """A request ended without finishing; the HTTP side turns it into an error."""


class EngineDeadError(RequestFailed):
    """The engine thread stopped (crash or shutdown); no request can make progress."""


class RequestCut(RequestFailed):
    """The server cut the request short (the drain's --shutdown-timeout ran out)."""


class RequestStream:
    """The event-loop side of one engine request. All methods run on the owning event loop."""

    def __init__(
        self, request_id: str, loop: asyncio.AbstractEventLoop, engine: AsyncEngine
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self._engine = engine
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False
        self.last_output: RequestOutput | None = None

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def next_output(self) -> RequestOutput:
        """The newest cumulative output; raises EngineDeadError if the engine stopped."""
        while self._latest is None:
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()
        output, self._latest = self._latest, None
        self.last_output = output
        self.finished = output.finished
        return output

    async def final_output(self) -> RequestOutput:
        output = await self.next_output()
        while not output.finished:
            output = await self.next_output()
        return output

    def abort(self) -> None:
        """Stop the request and free its KV blocks (idempotent; a no-op once finished)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def cut(self, reason: RequestFailed) -> None:
        """Abort, and make the reader see `reason` instead of waiting for more output."""
        if not self.finished:
            self.abort()
            self._fail(reason)


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float | None
    stream: RequestStream
    added: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Stop:
    pass


@dataclass
class _Live:
    """Engine-thread bookkeeping of one running request."""

    stream: RequestStream
    num_tokens: int = 0
    last_token_time: float | None = None


@dataclass(frozen=True)
class StateSnapshot:
    """Scheduler state published by the engine thread after every step or command batch."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class ModelInfo:
    """What the HTTP side needs to know about the loaded model (immutable once loaded)."""

    model_name: str
    max_model_len: int
    tokenizer: Any  # None for a dummy model without tokenizer files: token-id prompts only
    vocab_size: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool


def snapshot_output(output: RequestOutput) -> RequestOutput:
    """A copy the event loop may read while the engine keeps appending to its own lists."""
    return RequestOutput(
        request_id=output.request_id,
        prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids,
        outputs=[
            CompletionOutput(
                index=o.index,
                text=o.text,
                token_ids=list(o.token_ids),
                cumulative_logprob=o.cumulative_logprob,
                logprobs=None if o.logprobs is None else list(o.logprobs),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in output.outputs
        ],
        finished=output.finished,
        num_cached_tokens=output.num_cached_tokens,
        metrics=None if output.metrics is None else dataclasses.replace(output.metrics),
    )


def _resolve(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():  # the awaiting handler was cancelled meanwhile
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._put(output)


class AsyncEngine:
    """Loads an LLMEngine on its own thread and runs its step loop there."""

    def __init__(
        self,
        build_engine: Callable[[], Any],
        *,
        registry: CollectorRegistry | None = None,
        vllm_metrics: bool = True,
    ) -> None:
        self._build_engine = build_engine
        self.registry = registry
        self._vllm_metrics = vllm_metrics
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._loaded = threading.Event()
        self._lock = threading.Lock()
        self._num_pending_adds = 0
        self._state = StateSnapshot()
        self.info: ModelInfo | None = None
        self.metrics: ServerMetrics | None = None
        self.error: BaseException | None = None
        self.stopped = False

    # ---- lifecycle (any thread) ----

    def start(self) -> None:
        self._thread.start()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded or failed to load; True when it is servable."""
        self._loaded.wait(timeout)
        return self.is_alive

    @property
    def is_loaded(self) -> bool:
        return self._loaded.is_set() and self.info is not None

    @property
    def is_alive(self) -> bool:
        """Loaded, and the engine thread still runs (it exits on a crash or on shutdown)."""
        return self.is_loaded and self.error is None and not self.stopped

    def shutdown(self, timeout: float = 30.0) -> None:
        self._commands.put(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- scheduler state (any thread: reads one immutable snapshot) ----

    @property
    def num_waiting(self) -> int:
        # Requests already handed over but not yet seen by the engine count as waiting too.
        return self._state.num_waiting + self._num_pending_adds

    @property
    def num_running(self) -> int:
        return self._state.num_running

    @property
    def kv_cache_usage(self) -> float:
        return self._state.kv_cache_usage

    # ---- requests (event loop) ----

    async def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> RequestStream:
        """Hand a request to the engine; raises the engine's ValueError if it rejects it."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self)
        added: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._num_pending_adds += 1
        self._commands.put(
            _Add(request_id, prompt_ids, params, cache_salt, arrival_time, stream, added)
        )
        try:
            await added
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may still land: make sure it does not run
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            engine = self._build_engine()
            self._on_loaded(engine)
        except BaseException as exc:
            logger.exception("loading the model failed")
            self.error = exc
            self._loaded.set()
            return
        self._loaded.set()
        live: dict[str, _Live] = {}
        try:
            while self._handle_commands(engine, live, block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    self._step(engine, live)
                    self._publish(engine)
        except BaseException as exc:
            logger.exception("the engine loop crashed; failing all requests")
            self.error = exc
            self._fail_all(live, EngineDeadError(f"the engine crashed: {exc!r}"))
            return
        self.stopped = True
        for request_id in list(live):
            engine.abort_request(request_id)
        self._fail_all(live, EngineDeadError("the engine was shut down"))

    def _on_loaded(self, engine: Any) -> None:
        tokenizer = engine.tokenizer
        try:
            # The HTTP side tokenizes on the event loop while this thread detokenizes: separate
            # copies keep the Rust tokenizer's interior borrows out of each other's way.
            tokenizer = copy.deepcopy(tokenizer)
        except Exception:
            logger.warning("could not copy the tokenizer; sharing the engine's", exc_info=True)
        vocab_size = engine.model_config.vocab_size
        cache = engine.config.cache
        self.info = ModelInfo(
            model_name=engine.model_name,
            max_model_len=engine.max_model_len,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            block_size=engine.block_size,
            num_blocks=engine.num_blocks,
            enable_prefix_caching=cache.enable_prefix_caching,
        )
        if self.registry is not None:
            self.metrics = ServerMetrics(
                self.registry,
                engine.model_name,
                block_size=engine.block_size,
                num_gpu_blocks=engine.num_blocks,
                enable_prefix_caching=cache.enable_prefix_caching,
                vllm_names=self._vllm_metrics,
            )
            self.metrics.bind_engine_state(
                lambda: self.num_waiting, lambda: self.num_running, lambda: self.kv_cache_usage
            )
        self._publish(engine)

    def _handle_commands(self, engine: Any, live: dict[str, _Live], *, block: bool) -> bool:
        """Apply every queued command; False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        num_added = 0
        try:
            while True:
                if isinstance(command, _Stop):
                    return False
                if isinstance(command, _Add):
                    num_added += 1
                    self._add(engine, live, command)
                elif command.request_id in live:
                    engine.abort_request(command.request_id)
                    del live[command.request_id]
                    if self.metrics is not None:
                        self.metrics.request_success["abort"].inc()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    return True
        finally:
            # Publish before the adds stop counting as pending: otherwise, for the whole next
            # step, the requests just added would be in neither count and the queue would read
            # empty (to the autoscaler and to --max-queue). Counted twice for an instant instead.
            self._publish(engine)
            if num_added:
                with self._lock:
                    self._num_pending_adds -= num_added

    def _add(self, engine: Any, live: dict[str, _Live], command: _Add) -> None:
        error: BaseException | None = None
        try:
            engine.add_request(
                command.request_id,
                command.prompt_ids,
                command.params,
                cache_salt=command.cache_salt,
                arrival_time=command.arrival_time,
            )
            live[command.request_id] = _Live(command.stream)
        except Exception as exc:
            error = exc
        try:
            command.stream.loop.call_soon_threadsafe(_resolve, command.added, error)
        except RuntimeError:  # the requester's event loop is closed: nobody to serve
            if command.request_id in live:
                engine.abort_request(command.request_id)
                del live[command.request_id]

    def _step(self, engine: Any, live: dict[str, _Live]) -> None:
        start = time.monotonic()
        outputs = engine.step()
        now = time.monotonic()
        if self.metrics is not None:
            self.metrics.engine_step_duration.observe(now - start)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for output in outputs:
            entry = live.get(output.request_id)
            if entry is None:
                continue
            self._observe_tokens(entry, output, now)
            if output.finished:
                del live[output.request_id]
                if self.metrics is not None:
                    self.metrics.record_finished(output, finished_reason(output))
            by_loop.setdefault(entry.stream.loop, []).append(
                (entry.stream, snapshot_output(output))
            )
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its requests have no reader
                for stream, _ in items:
                    if stream.request_id in live:
                        engine.abort_request(stream.request_id)
                        del live[stream.request_id]

    def _observe_tokens(self, entry: _Live, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        if num_tokens <= entry.num_tokens:
            return
        if entry.last_token_time is not None and self.metrics is not None:
            self.metrics.inter_token_latency.observe(now - entry.last_token_time)
        entry.num_tokens = num_tokens
        entry.last_token_time = now

    def _publish(self, engine: Any) -> None:
        stats = engine.stats()
        self._state = StateSnapshot(stats.num_waiting, stats.num_running, stats.kv_cache_usage)
        if self.metrics is not None:
            self.metrics.record_counters(EngineCounters.of(stats))

    def _fail_all(self, live: dict[str, _Live], exc: BaseException) -> None:
        for entry in live.values():
            with contextlib.suppress(RuntimeError):
                entry.stream.loop.call_soon_threadsafe(entry.stream._fail, exc)
        live.clear()
        # Adds still queued will never be applied: fail them too.
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                with self._lock:
                    self._num_pending_adds -= 1
                with contextlib.suppress(RuntimeError):
                    command.stream.loop.call_soon_threadsafe(_resolve, command.added, exc)
