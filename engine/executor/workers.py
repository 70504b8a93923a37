"""Rank 0's side of tensor parallelism: start the other ranks, send them each step, and notice
when one dies.

Each worker is a plain child process (not multiprocessing: the engine core is itself a daemonic
multiprocessing child, which may not have children of its own). Its stdin carries the steps; a
pipe of its own carries its one ready/failed report. A worker that exits is seen at the next step
(its process is polled before every send, and a send to it fails) and while the engine idles
(check_alive); one that hangs is caught by the collectives' timeout on rank 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import msgspec

from kvpilot.engine.executor.messages import (
    FromWorker,
    StopWorker,
    WorkerArgs,
    WorkerFailed,
    WorkerReady,
    read_frame,
    write_frame,
)
from kvpilot.engine.step_input import StepInput

log = logging.getLogger("kvpilot.tp")


class WorkerDied(RuntimeError):
    """A tensor-parallel rank is gone (or failed to load): the engine cannot step any more."""


class TPWorkers:
    """Ranks 1..size-1, started by rank 0 before it joins the process group itself."""

    def __init__(self, args: list[WorkerArgs], workdir: str) -> None:
        self._workdir = workdir
        self._encoder = msgspec.msgpack.Encoder()
        self._procs: list[subprocess.Popen[bytes]] = []
        self._status: list[int] = []
        try:
            for worker_args in args:
                read_end, write_end = os.pipe()
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvpilot.engine.executor.worker", str(write_end)],
                    stdin=subprocess.PIPE,
                    pass_fds=(write_end,),
                )
                os.close(write_end)
                self._procs.append(proc)
                self._status.append(read_end)
                assert proc.stdin is not None
                write_frame(proc.stdin, pickle.dumps(worker_args))
        except BaseException:
            self.stop(0)
            raise

    @classmethod
    def start(cls, args: WorkerArgs, size: int) -> TPWorkers:
        """Starts ranks 1..size-1 with `args` (their rank and rendezvous file filled in)."""
        workdir = tempfile.mkdtemp(prefix="kvpilot-tp-")
        init_file = os.path.join(workdir, "rendezvous")
        ranks = [replace(args, rank=rank, init_file=init_file) for rank in range(1, size)]
        return cls(ranks, workdir)

    @property
    def init_file(self) -> str:
        return os.path.join(self._workdir, "rendezvous")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def wait_ready(self, timeout_s: float) -> list[WorkerReady]:
        """Each worker's ready report, in rank order; WorkerDied when one failed, exited or did
        not report within timeout_s."""
        decoder = msgspec.msgpack.Decoder(FromWorker)
        reports: dict[int, WorkerReady] = {}
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(self._status, start=1))
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkerDied(
                    f"tensor-parallel ranks {sorted(pending)} not ready in {timeout_s:.0f} s"
                )
            readable, _, _ = select.select(list(pending.values()), [], [], min(remaining, 1.0))
            for rank, fd in list(pending.items()):
                if fd in readable:
                    with os.fdopen(os.dup(fd), "rb") as stream:
                        frame = read_frame(stream)
                    report = None if frame is None else decoder.decode(frame)
                    if isinstance(report, WorkerFailed):
                        raise WorkerDied(f"tensor-parallel rank {rank} failed: {report.message}")
                    if report is None:
                        raise WorkerDied(self._exit_message(rank))
                    reports[rank] = report
                    del pending[rank]
            self.check_alive()
        return [reports[r] for r in sorted(reports)]

    def check_alive(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                raise WorkerDied(self._exit_message(rank))

    def blame(self, error: BaseException, grace_s: float = 2.0) -> None:
        """After a failed collective: raise WorkerDied naming the rank that died (from `error`),
        if one exits within grace_s; return otherwise (the caller re-raises `error`)."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.check_alive()
            except WorkerDied as died:
                raise died from error
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def send(self, step: StepInput) -> None:
        self._send(self._encoder.encode(step))

    def _send(self, data: bytes) -> None:
        self.check_alive()
        for rank, proc in enumerate(self._procs, start=1):
            assert proc.stdin is not None
            try:
                write_frame(proc.stdin, data)
            except (BrokenPipeError, OSError):
                proc.wait(timeout=5)
                raise WorkerDied(self._exit_message(rank)) from None

    def _exit_message(self, rank: int) -> str:
        code = self._procs[rank - 1].poll()
        how = "is not answering" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how = f"was killed by signal {-code}"
        return f"tensor-parallel rank {rank} (pid {self._procs[rank - 1].pid}) {how}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask every worker to stop; kill those that have not within timeout_s."""
        stop = self._encoder.encode(StopWorker())
        for proc in self._procs:
            if proc.poll() is None and proc.stdin is not None:
                with contextlib.suppress(OSError):
                    write_frame(proc.stdin, stop)
                    proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait(5)
        for fd in self._status:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._status = []
        shutil.rmtree(self._workdir, ignore_errors=True)
