"""The engine core's own process: load the model, then apply commands and step until told to stop.

Three threads, as vLLM's engine core has them: one receives and decodes commands from the API
process, one encodes and sends step outputs, and the main thread steps. Decoding and encoding then
overlap the model's forward pass (torch releases the interpreter lock while it computes), and the
step loop never waits on a socket.

The process dies with its parent: PR_SET_PDEATHSIG on Linux, and a check of the parent pid while
idle elsewhere. It ignores SIGINT and SIGTERM, which a terminal or a container runtime may send to
the whole process group: the API process drains first, then stops the core with a Shutdown.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from kvpilot.engine.config import LOG_FORMAT, EngineConfig
from kvpilot.engine.core.messages import (
    Abort,
    AddRequest,
    Command,
    CoreEvent,
    CoreFailed,
    CoreReady,
    LoadLoRA,
    ModelFilesFound,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
    UnloadLoRA,
)
from kvpilot.engine.parent_death import die_with_parent

if TYPE_CHECKING:
    from kvpilot.engine.core.engine_core import EngineCore

log = logging.getLogger("kvpilot.core")

_IDLE_POLL_S = 1.0  # how often an idle core checks that its parent still lives
_LORA_POLL_S = 0.005  # how often an idle core looks at an adapter being read
_FLUSH_S = 5  # how long the last messages may take to leave at exit


def run_engine_core(
    config: EngineConfig,
    commands_address: str,
    events_address: str,
    parent_pid: int,
    num_threads: int | None,
    log_level: int,
    cpus: tuple[int, ...] | None = None,
) -> None:
    """The child's entry point (multiprocessing spawn target). `cpus`: bind this process to them
    (--engine-cpus, --api-cpus) before any compute thread starts; torch's threads: `num_threads`,
    else fitted to the CPU quota."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=LOG_FORMAT, stream=sys.stderr)
    import torch
    from tqdm import tqdm

    from kvpilot.engine.cpu.affinity import bind_this_process
    from kvpilot.engine.cpu.threads import fit_threads_to_cpu_quota

    # tqdm's default lock is a multiprocessing semaphore, which this process's exit would leave to
    # the resource tracker (a "leaked semaphore" warning at every shutdown): one process, one lock.
    tqdm.set_lock(threading.RLock())

    if cpus:
        bind_this_process(cpus)  # OpenMP's threads start later, from a bound thread
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    else:
        fit_threads_to_cpu_quota()

    context = zmq.Context()
    events = context.socket(zmq.PUSH)
    events.setsockopt(zmq.SNDHWM, 0)
    events.connect(events_address)
    # Connected before the (long) load, so the API process's first command finds its peer.
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(commands_address)
    outbox: queue.SimpleQueue[CoreEvent | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_events, args=(events, outbox), name="core-send")
    sender.start()
    try:
        from kvpilot.engine.core.engine_core import EngineCore

        # The API process counted the GPUs by their device nodes; torch's count is the truth.
        config.check_placement(torch.cuda.device_count())
        core = EngineCore(
            config,
            log_level,
            on_model_files=lambda hf_dir: outbox.put(ModelFilesFound(str(hf_dir))),
        )
    except BaseException as exc:
        log.exception("loading the model failed")
        outbox.put(CoreFailed(f"loading the model failed: {exc}", during_load=True))
        commands.close(linger=0)
        _flush_and_exit(context, sender, outbox, 1)
    from kvpilot.engine.gc_freeze import freeze_startup_objects

    freeze_startup_objects("engine core")  # a full collection would stall a step by 100+ ms
    outbox.put(CoreReady(core.description))

    inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
    threading.Thread(
        target=_receive_commands, args=(commands, inbox), name="core-receive", daemon=True
    ).start()
    try:
        _step_loop(core, inbox, outbox, parent_pid)
    except BaseException as exc:
        log.exception("the engine core crashed")
        outbox.put(CoreFailed(f"the engine core crashed: {exc!r}", during_load=False))
        _stop_workers(core, timeout_s=0)
        _flush_and_exit(context, sender, outbox, 1)
    _stop_workers(core, timeout_s=None)
    _flush_and_exit(context, sender, outbox, 0)


def _stop_workers(core: EngineCore, timeout_s: float | None) -> None:
    """Tensor-parallel ranks stop with the core (they would die with it anyway, by
    PR_SET_PDEATHSIG; this lets them leave cleanly)."""
    try:
        if timeout_s is None:
            core.shutdown()
        else:
            core.shutdown(timeout_s)
    except Exception:
        log.exception("stopping the tensor-parallel workers failed")


def _step_loop(
    core: EngineCore,
    inbox: queue.SimpleQueue[Command],
    outbox: queue.SimpleQueue[CoreEvent | None],
    parent_pid: int,
) -> None:
    num_applied = 0
    while True:
        busy = core.has_unfinished_requests()
        # While an adapter is read, look at it often: its LoadLoRA waits for the reply.
        idle_wait = _LORA_POLL_S if core.lora_reads else _IDLE_POLL_S
        try:
            command = inbox.get(block=not busy, timeout=None if busy else idle_wait)
        except queue.Empty:
            if not busy and os.getppid() != parent_pid:
                return
            core.check_workers()  # a rank that died while idle ends the core now
            command = None
        applied_any = False
        while command is not None:
            if isinstance(command, Shutdown):
                return
            _apply(core, command, outbox, num_applied)
            num_applied += 1
            applied_any = True
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                command = None
        for reply in core.finished_lora_reads():
            outbox.put(reply)

        if core.has_unfinished_requests():
            outputs = core.step(num_applied)
            # A step that scheduled nothing changed nothing the API side could see.
            if outputs.step_duration is not None or applied_any or outputs.kv_events is not None:
                outbox.put(outputs)
        elif applied_any:
            # Aborts (or refused adds) emptied the core: say so, or the API side would count them
            # as waiting until the next request.
            outbox.put(core.idle_outputs(num_applied))


def _apply(
    core: EngineCore, command: Command, outbox: queue.SimpleQueue[CoreEvent | None], applied: int
) -> None:
    if isinstance(command, AddRequest):
        try:
            core.add_request(command)
        except ValueError as exc:
            refused = [(command.request_id, str(exc))]
            outbox.put(StepOutputs([], core.stats(), applied + 1, rejected=refused))
    elif isinstance(command, Abort):
        core.abort(command.request_id, command.index)
    elif isinstance(command, ResetPrefixCache):
        core.reset_prefix_cache()
    elif isinstance(command, LoadLoRA):
        reply = core.load_lora(command)
        if reply is not None:
            outbox.put(reply)
    elif isinstance(command, UnloadLoRA):
        outbox.put(core.unload_lora(command))


def _receive_commands(socket: zmq.Socket, inbox: queue.SimpleQueue[Command]) -> None:
    decoder = msgspec.msgpack.Decoder(Command)
    try:
        while True:
            inbox.put(decoder.decode(socket.recv(copy=False).buffer))
    except zmq.ZMQError:  # the context is terminating: this process is on its way out
        pass
    except BaseException:
        log.error("bad command from the API process:\n%s", traceback.format_exc())
    finally:
        socket.close(linger=0)
        inbox.put(Shutdown())


def _send_events(socket: zmq.Socket, outbox: queue.SimpleQueue[CoreEvent | None]) -> None:
    encoder = msgspec.msgpack.Encoder()
    while True:
        event = outbox.get()
        if event is None:
            socket.close(linger=_FLUSH_S * 1000)
            return
        socket.send(encoder.encode(event), copy=False)


def _flush_and_exit(
    context: zmq.Context,
    sender: threading.Thread,
    outbox: queue.SimpleQueue[CoreEvent | None],
    status: int,
) -> None:
    """Exit once the last events have left (a crash report must reach the API process)."""
    outbox.put(None)
    sender.join(timeout=_FLUSH_S)
    # term() waits for queued messages to be sent (up to the linger) and for every socket to close.
    terminating = threading.Thread(target=context.term, daemon=True)
    terminating.start()
    terminating.join(timeout=_FLUSH_S)
    os._exit(status)
