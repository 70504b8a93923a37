"""The API process's side of the engine: the engine core in its own process, output processing on
one thread here, and the per-request streams the event loops read.

Event loops hand requests (token ids) to the core directly over the client's socket; one thread
(`kvpilot-output`) receives each step's token updates, turns them into text and RequestOutputs
(output_processor.py), records metrics, and hands each loop its outputs with `call_soon_threadsafe`,
one callback per loop per step. So no event loop ever blocks on the engine, and tokenizing or
parsing on the HTTP side never delays the step loop, which runs in another process.

A streamed request's outputs are DELTAs (only what each step added: O(1) per token at any output
length); a RequestStream keeps one pending output, merging what arrives before its reader looks
(outputs.merge_deltas). A CUMULATIVE or FINAL_ONLY output replaces the pending one.

If the core process dies, every request fails with EngineDeadError, /health turns 503 and the
server exits non-zero (cli.py): a pod restarts instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from kvpilot.contract.kv_events import Load
from kvpilot.contract.limits import RequestLimits
from kvpilot.engine.config import EngineConfig
from kvpilot.engine.core.client import CoreProcessExited, EngineCoreClient
from kvpilot.engine.core.fit import check_prompt_fits
from kvpilot.engine.core.messages import (
    Abort,
    AddRequest,
    CoreFailed,
    CoreReady,
    LoadLoRA,
    LoRAReply,
    ModelDescription,
    ModelFilesFound,
    StepOutputs,
    UnloadLoRA,
)
from kvpilot.engine.gc_freeze import freeze_startup_objects
from kvpilot.engine.model.files import (
    eos_token_ids,
    has_tokenizer,
    load_tokenizer,
    torch_kept_out,
)
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import OutputKind, RequestOutput, merge_deltas
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.server.kv_events import KvEventHub
from kvpilot.engine.server.metrics import EngineCounters, ServerMetrics, finished_reason
from kvpilot.engine.server.preprocess import PromptLimits, max_chars_per_token
from kvpilot.engine.server.settings import ChatOptions

logger = logging.getLogger("kvpilot.server")

_POLL_S = 0.5  # how often the output thread looks up from the socket to check for a shutdown


class RequestFailed(RuntimeError):
    """A request ended without finishing; the HTTP side turns it into an error."""


class EngineDeadError(RequestFailed):
    """The engine core stopped (crash or shutdown); no request can make progress."""


class RequestCut(RequestFailed):
    """The server cut the request short (the drain's --shutdown-timeout ran out)."""


class RequestStream:
    """The event-loop side of one engine request. All methods run on the owning event loop."""

    def __init__(
        self,
        request_id: str,
        loop: asyncio.AbstractEventLoop,
        engine: AsyncEngine,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.loop = loop
        self._engine = engine
        self._merge = kind is OutputKind.DELTA
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False

    def _put(self, output: RequestOutput) -> None:
        if self._merge and self._latest is not None:
            output = merge_deltas(self._latest, output)
        self._latest = output
        self._event.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    async def next_output(self) -> RequestOutput:
        """The next output (for DELTA, everything since the last one read); raises
        EngineDeadError if the engine stopped."""
        while self._latest is None:
            if self._error is not None:
                raise self._error
            await self._event.wait()
            self._event.clear()
        output, self._latest = self._latest, None
        self.finished = output.finished
        return output

    async def final_output(self) -> RequestOutput:
        """The whole output once finished (a DELTA stream's outputs merged)."""
        output = await self.next_output()
        while not output.finished:
            newer = await self.next_output()
            output = merge_deltas(output, newer) if self._merge else newer
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
class _Live:
    """Output-side bookkeeping of one request in the engine."""

    stream: RequestStream
    params: SamplingParams | None = None  # for the request_params_* metrics
    lora_name: str | None = None  # for the per-adapter metrics


# Threads of the API process that parse and tokenize requests (state.py runs them).
TOKENIZER_THREADS = 2


@dataclass(frozen=True)
class StateSnapshot:
    """Scheduler state as of the core's latest report."""

    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP side needs to know about the loaded model (immutable once loaded)."""

    model_name: str
    max_model_len: int
    tokenizer: Any  # None for a dummy model without tokenizer files: token-id prompts only
    vocab_size: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    eos_token_ids: tuple[int, ...] = ()
    hf_dir: str = ""  # the tokenizer's files
    max_chars_per_token: int | None = None  # see preprocess.py; None without a tokenizer
    # Copies for the tokenizer threads, made while loading (each taken by one thread only): a
    # deepcopy holds the interpreter lock for a long while, which on a first request would stall
    # every stream and probe.
    spare_tokenizers: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    grammar_backend: str = "xgrammar"  # the core's, which request constraints are checked with
    async_scheduling: bool = False  # the core's: tokens arrive a step after their step launched
    max_loras: int = 0  # adapter slots (0: adapters off)
    max_lora_rank: int = 0
    max_num_seqs: int = 0  # the core's: sequences a step runs at most
    scheduling_policy: str = "fcfs"  # the core's (engine.config.SchedulerConfig.policy)

    def limits(
        self,
        requests: RequestLimits,
        chat: ChatOptions | None = None,
        adapters: frozenset[str] = frozenset(),
    ) -> PromptLimits:
        """adapters: the LoRA adapters a request's `model` may name besides the model."""
        return PromptLimits(
            self.model_name,
            self.max_model_len,
            self.vocab_size,
            self.max_chars_per_token,
            requests,
            chat or ChatOptions(),
            self.grammar_backend,
            adapters,
        )

    def check_prompt_fits(self, num_tokens: int) -> None:
        """ValueError unless the core has room for a prompt this long (checked here, before it is
        sent; preprocessing has checked its ids)."""
        check_prompt_fits(
            num_tokens,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
        )


@dataclass(frozen=True)
class Tokenizers:
    """The API process's copies of the model's tokenizer (all None for a model without tokenizer
    files), loaded while the core loads the weights."""

    hf_dir: Path
    detokenizer: Any  # the output thread's
    http: Any  # the HTTP side's (it tokenizes on its threads while the output thread detokenizes)
    spares: queue.SimpleQueue[Any]  # see ModelInfo.spare_tokenizers
    max_chars_per_token: int | None

    @classmethod
    def load(cls, hf_dir: Path) -> Tokenizers:
        started = time.perf_counter()
        spares: queue.SimpleQueue[Any] = queue.SimpleQueue()
        if not has_tokenizer(hf_dir):
            return cls(hf_dir, None, None, spares, None)
        with torch_kept_out():  # in `kvpilot serve`'s API process; a no-op where torch runs
            tokenizer = load_tokenizer(hf_dir)
        http = tokenizer
        try:
            # Separate copies keep the Rust tokenizer's interior borrows out of each other's way.
            http = copy.deepcopy(tokenizer)
            for _ in range(TOKENIZER_THREADS):
                spares.put(copy.deepcopy(tokenizer))
        except Exception:
            logger.warning("could not copy the tokenizer; sharing one", exc_info=True)
        loaded = cls(hf_dir, tokenizer, http, spares, max_chars_per_token(tokenizer))
        logger.debug("tokenizer loaded in %.2f s", time.perf_counter() - started)
        return loaded


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._put(output)


def _resolve(future: asyncio.Future[LoRAReply], reply: LoRAReply) -> None:
    if not future.done():
        future.set_result(reply)


def _fail_future(future: asyncio.Future[LoRAReply], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _fail_streams(streams: list[RequestStream], exc: BaseException) -> None:
    for stream in streams:
        stream._fail(exc)


class AsyncEngine:
    """Starts the engine-core process and serves its outputs to any number of event loops."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        registry: CollectorRegistry | None = None,
        vllm_metrics: bool = True,
        core_threads: int | None = None,
        core_cpus: tuple[int, ...] | None = None,
        log_level: int = logging.INFO,
    ) -> None:
        self.config = config
        self.registry = registry
        self._vllm_metrics = vllm_metrics
        self._client = EngineCoreClient(
            config, num_threads=core_threads, cpus=core_cpus, log_level=log_level
        )
        self._thread = threading.Thread(target=self._run, name="kvpilot-output", daemon=True)
        self._loaded = threading.Event()
        # Guards the processor, the live requests and the command count: event loops add and
        # abort while the output thread processes steps.
        self._lock = threading.Lock()
        self._processor: OutputProcessor | None = None
        self._live: dict[str, _Live] = {}
        self._num_commands_sent = 0
        self._pending_adds: deque[int] = deque()  # command numbers of adds the core has not seen
        self._state = StateSnapshot()
        # LoRA adapters as the core has them (name -> path), and the replies awaited.
        self.adapters: dict[str, str] = {}
        self._lora_waiters: dict[
            str, tuple[LoadLoRA | UnloadLoRA, asyncio.AbstractEventLoop, asyncio.Future[LoRAReply]]
        ] = {}
        self._stopping = False
        self.info: ModelInfo | None = None
        self.kv_events: KvEventHub | None = None  # set once loaded
        self.metrics: ServerMetrics | None = None
        self.error: BaseException | None = None
        self.died_at: float | None = None  # time.monotonic() when the core was found dead
        self.stopped = False

    # ---- lifecycle (any thread) ----

    def start(self) -> None:
        self._client.start()
        self._thread.start()

    @property
    def core_pid(self) -> int | None:
        return self._client.pid

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded or failed to load; True when it is servable."""
        self._loaded.wait(timeout)
        return self.is_alive

    @property
    def is_loaded(self) -> bool:
        return self._loaded.is_set() and self.info is not None

    @property
    def is_alive(self) -> bool:
        """Loaded, and the core process still runs."""
        return self.is_loaded and self.error is None and not self.stopped

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._client.stop(timeout)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._client.close()

    # ---- scheduler state (any thread: reads one immutable snapshot) ----

    @property
    def num_waiting(self) -> int:
        # Requests already sent but not yet seen by the core count as waiting too.
        return self._state.num_waiting + len(self._pending_adds)

    @property
    def num_running(self) -> int:
        return self._state.num_running

    @property
    def kv_cache_usage(self) -> float:
        return self._state.kv_cache_usage

    def queue_counts(self) -> tuple[int, int, int]:
        """(waiting, running, unfinished requests here), read at one instant: a request the core
        reports finished leaves both sides together."""
        with self._lock:
            return self.num_waiting, self.num_running, len(self._live)

    # ---- requests (event loop) ----

    async def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prompt_text: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kind: OutputKind = OutputKind.CUMULATIVE,
        lora_name: str | None = None,
        priority: int = 0,
        shared_prefix_tokens: int = 0,
        guard_priority: int | None = None,
    ) -> RequestStream:
        """Hand a request to the core; ValueError when it cannot run (a client error).
        kind: DELTA for a stream (each output holds what is new), FINAL_ONLY for a response that
        reads nothing before the end (one output, when the request finishes). priority,
        shared_prefix_tokens and guard_priority: as the core's AddRequest."""
        info = self.info
        if not self.is_alive or info is None or self._processor is None:
            raise EngineDeadError("the engine is not running")
        info.check_prompt_fits(len(prompt_ids))
        stream = RequestStream(request_id, asyncio.get_running_loop(), self, kind)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        command = AddRequest(
            request_id,
            prompt_ids,
            params,
            info.eos_token_ids,
            cache_salt,
            arrival,
            lora_name=lora_name,
            priority=priority,
            shared_prefix_tokens=shared_prefix_tokens,
            guard_priority=guard_priority,
        )
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine is not running: {self.error}")
            self._processor.add_request(
                request_id, prompt_text, prompt_ids, params, arrival, kind=kind
            )
            self._live[request_id] = _Live(stream, params, lora_name)
            # Numbered and sent under the lock, so numbers follow the order the core sees.
            self._num_commands_sent += 1
            self._pending_adds.append(self._num_commands_sent)
            self._client.send(command)
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._live.pop(request_id, None) is None:
                return  # finished (or never added)
            if self._processor is not None:
                self._processor.abort(request_id)
            if self.metrics is not None:
                self.metrics.request_success["abort"].inc()
            self._send(Abort(request_id))

    def _send(self, command: Abort | LoadLoRA | UnloadLoRA) -> None:
        """Under the lock."""
        self._num_commands_sent += 1
        self._client.send(command)

    async def load_lora(self, name: str, path: str, *, replace: bool = False) -> LoRAReply:
        """The core reads the adapter and registers it; its reply (an HTTP status and message)."""
        return await self._lora_command(LoadLoRA(uuid.uuid4().hex, name, path, replace))

    async def unload_lora(self, name: str) -> LoRAReply:
        return await self._lora_command(UnloadLoRA(uuid.uuid4().hex, name))

    async def _lora_command(self, command: LoadLoRA | UnloadLoRA) -> LoRAReply:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[LoRAReply] = loop.create_future()
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError("the engine is not running")
            self._lora_waiters[command.command_id] = (command, loop, reply)
            self._send(command)
        return await reply

    def _on_lora_reply(self, reply: LoRAReply) -> None:
        with self._lock:
            waiter = self._lora_waiters.pop(reply.command_id, None)
            if waiter is None:
                return
            command, loop, future = waiter
            if reply.status == 200 and isinstance(command, LoadLoRA):
                self.adapters[command.name] = command.path
            elif reply.status == 200:
                self.adapters.pop(command.name, None)
        with contextlib.suppress(RuntimeError):  # that event loop is closed
            loop.call_soon_threadsafe(_resolve, future, reply)

    # ---- the output thread ----

    def _run(self) -> None:
        try:
            if not self._wait_ready():
                return
            while True:
                try:
                    event = self._client.receive(_POLL_S)
                except CoreProcessExited:
                    if self._stopping:
                        break
                    raise
                if isinstance(event, StepOutputs):
                    self._on_step(event)
                elif isinstance(event, LoRAReply):
                    self._on_lora_reply(event)
                elif isinstance(event, CoreFailed):
                    raise RuntimeError(event.message)
        except BaseException as exc:
            logger.error("the engine core failed: %s; failing all requests", exc)
            self._die(EngineDeadError(f"the engine core failed: {exc}"))
            return
        self.stopped = True
        self._fail_all(EngineDeadError("the engine was shut down"))

    def _wait_ready(self) -> bool:
        """Wait for the core to load; False (with self.error set) when it could not."""
        tokenizers: Tokenizers | None = None
        try:
            while True:
                try:
                    event = self._client.receive(_POLL_S)
                except CoreProcessExited as exc:
                    raise RuntimeError(f"{exc} while loading the model") from None
                if isinstance(event, ModelFilesFound):
                    # The core loads the weights meanwhile: both are done at about one time.
                    tokenizers = Tokenizers.load(Path(event.hf_dir))
                elif isinstance(event, CoreReady):
                    if tokenizers is None or tokenizers.hf_dir != Path(event.model.hf_dir):
                        tokenizers = Tokenizers.load(Path(event.model.hf_dir))
                    self._on_loaded(event.model, tokenizers)
                    return True
                if isinstance(event, CoreFailed):
                    raise RuntimeError(event.message)
                if event is None and self._stopping:
                    raise RuntimeError("shut down while loading")
        except BaseException as exc:
            logger.error("loading the model failed: %s", exc)
            self.error = exc
            self.died_at = time.monotonic()
            return False
        finally:
            self._loaded.set()

    def _on_loaded(self, model: ModelDescription, tokenizers: Tokenizers) -> None:
        tokenizer = tokenizers.detokenizer
        self._processor = OutputProcessor(tokenizer)
        self.kv_events = KvEventHub(
            model.model_name,
            model.block_size,
            max_loras=model.max_loras,
            max_num_seqs=model.max_num_seqs,
        )
        if self.registry is not None:
            self.metrics = ServerMetrics(
                self.registry,
                model.model_name,
                block_size=model.block_size,
                num_gpu_blocks=model.num_blocks,
                enable_prefix_caching=model.enable_prefix_caching,
                cache_dtype=model.cache_dtype,
                max_model_len=model.max_model_len,
                vllm_names=self._vllm_metrics,
                tensor_parallel_size=model.tensor_parallel_size,
                max_loras=model.max_loras,
                num_speculative_tokens=model.num_speculative_tokens,
            )
            self.metrics.bind_engine_state(
                lambda: self.num_waiting, lambda: self.num_running, lambda: self.kv_cache_usage
            )
        self.info = ModelInfo(
            spare_tokenizers=tokenizers.spares,
            model_name=model.model_name,
            max_model_len=model.max_model_len,
            tokenizer=tokenizers.http,
            vocab_size=model.vocab_size,
            block_size=model.block_size,
            num_blocks=model.num_blocks,
            enable_prefix_caching=model.enable_prefix_caching,
            eos_token_ids=eos_token_ids(model.eos_token_ids, tokenizer),
            hf_dir=model.hf_dir,
            grammar_backend=model.grammar_backend,
            async_scheduling=model.async_scheduling,
            max_chars_per_token=tokenizers.max_chars_per_token,
            max_loras=model.max_loras,
            max_lora_rank=model.max_lora_rank,
            max_num_seqs=model.max_num_seqs,
            scheduling_policy=model.scheduling_policy,
        )
        self.adapters = dict(model.lora_modules)
        # Everything this process keeps is loaded now: a full collection walking it would stall
        # the event loop (and /health) for 100+ ms under load.
        freeze_startup_objects("API process")

    def _on_step(self, step: StepOutputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        failed: list[tuple[RequestStream, RequestFailed]] = []
        metrics = self.metrics
        assert self._processor is not None
        with self._lock:
            while self._pending_adds and self._pending_adds[0] <= step.num_commands_applied:
                self._pending_adds.popleft()
            stats = step.stats
            self._state = StateSnapshot(stats.num_waiting, stats.num_running, stats.kv_cache_usage)
            if self.kv_events is not None:
                load = Load(
                    self.num_waiting,
                    stats.num_running,
                    stats.kv_cache_usage,
                    stats.resident_loras,
                    self.info.max_loras if self.info is not None else 0,
                    self.info.max_num_seqs if self.info is not None else 0,
                )
                self.kv_events.publish(step.kv_events, load)
            if metrics is not None:
                metrics.record_counters(EngineCounters.of(stats))
                if metrics.max_loras:
                    metrics.record_loras(stats.running_loras, stats.waiting_loras, time.time())
                if step.step_duration is not None:
                    metrics.engine_step_duration.observe(step.step_duration)
            for request_id, why in step.rejected:
                entry = self._live.pop(request_id, None)
                self._processor.abort(request_id)
                if entry is not None:
                    failed.append((entry.stream, RequestFailed(f"the engine refused it: {why}")))
            processed = self._processor.process(step)
            for request_id, index in processed.stop_hits:
                self._send(Abort(request_id, index))
            if metrics is not None:
                for gap in processed.token_gaps:
                    metrics.inter_token_latency.observe(gap)
            for output in processed.outputs:
                entry = self._live.get(output.request_id)
                if entry is None:
                    continue
                if output.finished:
                    del self._live[output.request_id]
                    if metrics is not None:
                        metrics.record_finished(
                            output,
                            finished_reason(output),
                            entry.params,
                            processed.generated.get(output.request_id),
                        )
                        if entry.lora_name is not None:
                            generated = processed.generated.get(output.request_id)
                            metrics.record_adapter_request(
                                entry.lora_name,
                                len(output.prompt_token_ids),
                                sum(generated)
                                if generated is not None
                                else sum(len(o.token_ids) for o in output.outputs),
                            )
                by_loop.setdefault(entry.stream.loop, []).append((entry.stream, output))
        for stream, exc in failed:
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream._fail, exc)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: its requests have no reader
                for stream, _ in items:
                    self.abort(stream.request_id)

    def _die(self, exc: BaseException) -> None:
        self.error = exc
        self.died_at = time.monotonic()
        self._fail_all(exc)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            live, self._live = self._live, {}
            self._pending_adds.clear()
            waiters, self._lora_waiters = self._lora_waiters, {}
        for _, loop, future in waiters.values():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail_future, future, exc)
        by_loop: dict[asyncio.AbstractEventLoop, list[RequestStream]] = {}
        for entry in live.values():
            by_loop.setdefault(entry.stream.loop, []).append(entry.stream)
        for loop, streams in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail_streams, streams, exc)
