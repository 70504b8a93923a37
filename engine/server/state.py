"""What one HTTP app knows beyond the engine: settings, readiness, draining, in-flight requests."""

from __future__ import annotations

import asyncio
import copy
import logging
import multiprocessing
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from starlette.requests import Request

from kvpilot.contract import errors
from kvpilot.contract.openai import RequestKind
from kvpilot.engine.server.async_engine import TOKENIZER_THREADS, AsyncEngine, ModelInfo
from kvpilot.engine.server.preprocess import (
    BIG_BODY_BYTES,
    Preprocessed,
    init_worker,
    preprocess,
    preprocess_in_worker,
)
from kvpilot.engine.server.settings import ServerSettings

logger = logging.getLogger("kvpilot.server")


class InFlight:
    """One admitted request: counted until released; `on_cut` ends it early at a drain timeout."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self.on_cut: Callable[[], None] | None = None

    def release(self) -> None:
        if self in self._state.in_flight:
            self._state.in_flight.discard(self)
            if self._state.engine.metrics is not None:
                self._state.engine.metrics.num_requests_in_flight.dec()

    def cut(self) -> None:
        if self.on_cut is not None:
            self.on_cut()


class ServerState:
    """Lives on the app's event loop: nothing here is touched from another thread."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings | None = None) -> None:
        self.engine = engine
        self.settings = settings or ServerSettings()
        self.draining = False
        self.in_flight: set[InFlight] = set()
        # Parsing, chat templates and tokenization run off the event loop (see preprocess.py).
        # At normal priority: every request is tokenized here before it can run, and a niced
        # thread gets next to no CPU beside the engine core's busy threads (TTFT then waits on it).
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, "kvpilot-tokenize")
        self._tokenizers = threading.local()
        self._big_body_pool: ProcessPoolExecutor | None = None
        self.big_body_worker_up: Future[int] | None = None

    def _thread_tokenizer(self, info: ModelInfo) -> Any:
        """This pool thread's own copy of the tokenizer (copies never share Rust borrows): one
        made while the model loaded, so a first request never waits for a copy."""
        tokenizer = getattr(self._tokenizers, "tokenizer", None)
        if tokenizer is None and info.tokenizer is not None:
            try:
                tokenizer = info.spare_tokenizers.get_nowait()
            except queue.Empty:  # more threads than spares (several servers on one engine)
                tokenizer = copy.deepcopy(info.tokenizer)
            self._tokenizers.tokenizer = tokenizer
        return tokenizer

    async def read_body(self, http: Request) -> bytes:
        """The body, or a 413 as soon as it is known to be over the limit (before reading it, when
        the client declares its length)."""
        limit = self.settings.limits.max_body_bytes
        declared = http.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.too_large(int(declared), limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise errors.too_large(None, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def preprocess(self, info: ModelInfo, kind: RequestKind, http: Request) -> Preprocessed:
        """The request read, parsed, validated and tokenized, off the event loop; APIError for
        the client's faults (a wrong model is counted as such)."""
        body = await self.read_body(http)
        loop = asyncio.get_running_loop()
        adapters = frozenset(self.engine.adapters)
        try:
            if len(body) > BIG_BODY_BYTES:
                return await loop.run_in_executor(
                    self._big_body_executor(info), preprocess_in_worker, kind, body, adapters
                )
            return await loop.run_in_executor(
                self._tokenizer_pool,
                lambda: preprocess(
                    kind,
                    body,
                    self._thread_tokenizer(info),
                    info.limits(self.settings.limits, self.settings.chat, adapters),
                ),
            )
        except errors.APIError as exc:
            if exc.code == "model_not_found":
                raise self.reject("model_not_found", exc) from None
            raise
        except BrokenProcessPool:
            self._big_body_pool = None  # started again for the next big request
            logger.exception("the preprocessing worker died")
            raise errors.internal_error("The request's preprocessing worker died.") from None

    def start_big_body_worker(self) -> None:
        """Spawn the worker that parses bodies over BIG_BODY_BYTES, and let it load its tokenizer,
        now (once the model is loaded): started by the first big request instead, it took seconds
        of CPU while streams ran, and they stalled. The worker runs niced. `big_body_worker_up`
        resolves once it has started."""
        info = self.engine.info
        if info is not None and self.big_body_worker_up is None:
            # The pool spawns its worker on the first task: int() is a picklable no-op.
            self.big_body_worker_up = self._big_body_executor(info).submit(int)

    def _big_body_executor(self, info: ModelInfo) -> ProcessPoolExecutor:
        """The pool of start_big_body_worker, started again after its worker died."""
        if self._big_body_pool is None:
            self._big_body_pool = ProcessPoolExecutor(
                1,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=init_worker,
                initargs=(
                    info.hf_dir if info.tokenizer is not None else None,
                    info.limits(self.settings.limits, self.settings.chat),
                    os.getpid(),
                ),
            )
        return self._big_body_pool

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        if self._big_body_pool is not None:
            pool = self._big_body_pool
            pool.shutdown(wait=False, cancel_futures=True)
            # A worker still loading its tokenizer (niced: tens of seconds on a busy CPU) would
            # hold the server's exit, which joins the pool's threads: nothing it would do is
            # wanted any more. ProcessPoolExecutor has no public way to end its workers (3.14's
            # terminate_workers).
            for process in list((pool._processes or {}).values()):
                process.terminate()

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    @property
    def is_ready(self) -> bool:
        return self.engine.is_alive and not self.draining

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            if self.engine.metrics is not None:
                self.engine.metrics.draining.set(1)
            logger.info("draining: %d request(s) in flight; refusing new ones", self.num_in_flight)

    def reject(self, reason: str, error: errors.APIError) -> errors.APIError:
        if self.engine.metrics is not None:
            self.engine.metrics.requests_rejected[reason].inc()
        return error

    def model_info(self) -> ModelInfo:
        """The loaded model, or a 503 while it loads (or after the engine died)."""
        if self.draining:
            raise self.reject(
                "draining",
                errors.unavailable(
                    "The server is shutting down; retry on another replica.", code="draining"
                ),
            )
        if self.engine.info is None or not self.engine.is_loaded:
            raise self.reject(
                "loading", errors.unavailable("The model is still loading.", code="model_loading")
            )
        if not self.engine.is_alive:
            raise errors.unavailable("The engine is not running.", code="engine_dead")
        return self.engine.info

    def check_queue(self) -> None:
        max_queue = self.settings.max_queue
        waiting = self.engine.num_waiting
        if max_queue is not None and waiting >= max_queue:
            raise self.reject(
                "queue_full", errors.queue_full(waiting, max_queue, self.settings.retry_after_s)
            )

    def admit(self) -> InFlight:
        """Count a request as in flight until its release() (idempotent)."""
        ticket = InFlight(self)
        self.in_flight.add(ticket)
        if self.engine.metrics is not None:
            self.engine.metrics.num_requests_in_flight.inc()
        return ticket

    def cut_all(self) -> None:
        """End every in-flight request now, each with an error its client can read."""
        for ticket in list(self.in_flight):
            ticket.cut()
