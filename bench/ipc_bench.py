"""What the engine core's IPC costs: one step's outputs, encoded, sent to another process, decoded.

Compares the transport kvpilot uses (ZMQ PUSH/PULL over a Unix socket, msgspec msgpack structs)
with the obvious alternatives (multiprocessing.Pipe with pickle; ZMQ with pickle). The message is
a real StepOutputs of `--batch` sequences (one token each, optionally with top-5 logprobs), sent
`--steps` times; the child echoes a tiny acknowledgement per message, so each figure is a full
round trip: encode, send, receive, decode on both sides.

    python bench/ipc_bench.py --batch 64 --steps 2000
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from kvpilot.engine.core.messages import CoreEvent, EngineStats, SeqUpdate, StepOutputs


def make_step(batch: int, with_logprobs: bool) -> StepOutputs:
    top = [(1000 + k, -1.5 - k) for k in range(5)]
    updates = [
        SeqUpdate(f"cmpl-{i:032x}", 0, 1234 + i, (-0.25, 1, top) if with_logprobs else None)
        for i in range(batch)
    ]
    stats = EngineStats(0, batch, 0.5, 1000, 16, 10, 5, 0, 100, 200)
    return StepOutputs(updates, stats, 7, token_time=time.monotonic(), step_duration=0.01)


def zmq_echo(address: str, codec: str) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(address)
    decode: Callable[[bytes], Any] = (
        msgspec.msgpack.Decoder(CoreEvent).decode if codec == "msgspec" else pickle.loads
    )
    while True:
        data = socket.recv(copy=False).buffer
        if len(data) == 1:
            return
        decode(data)
        socket.send(b"ok")


def pipe_echo(conn: Connection) -> None:
    while True:
        message = conn.recv()
        if message is None:
            return
        conn.send(b"ok")


def run_zmq(step: StepOutputs, steps: int, codec: str) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        context = zmq.Context()
        socket = context.socket(zmq.PAIR)
        socket.bind(f"ipc://{tmp}/bench")
        child = multiprocessing.get_context("spawn").Process(
            target=zmq_echo, args=(f"ipc://{tmp}/bench", codec)
        )
        child.start()
        encode: Callable[[Any], bytes] = (
            msgspec.msgpack.Encoder().encode if codec == "msgspec" else pickle.dumps
        )
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            socket.send(encode(step), copy=False)
            socket.recv()
            times.append(time.perf_counter() - start)
        socket.send(b"x")
        child.join()
        socket.close(linger=0)
        context.term()
    return times


def run_pipe(step: StepOutputs, steps: int) -> list[float]:
    parent, child_end = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(target=pipe_echo, args=(child_end,))
    child.start()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        parent.send(step)  # pickle
        parent.recv()
        times.append(time.perf_counter() - start)
    parent.send(None)
    child.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--logprobs", action="store_true", help="top-5 logprobs on every token")
    args = ap.parse_args()
    step = make_step(args.batch, args.logprobs)
    sizes = {
        "msgspec": len(msgspec.msgpack.encode(step)),
        "pickle": len(pickle.dumps(step)),
    }
    print(f"one step of {args.batch} sequences:", ", ".join(f"{k} {v} B" for k, v in sizes.items()))
    results = {
        "zmq + msgspec (kvpilot)": run_zmq(step, args.steps, "msgspec"),
        "zmq + pickle": run_zmq(step, args.steps, "pickle"),
        "multiprocessing.Pipe + pickle": run_pipe(step, args.steps),
    }
    for name, times in results.items():
        times_us = sorted(t * 1e6 for t in times[args.steps // 10 :])  # drop the warm-up tenth
        p99 = times_us[int(len(times_us) * 0.99)]
        print(
            f"{name:32s} round trip median {statistics.median(times_us):7.1f} us, p99 {p99:7.1f} us"
        )


if __name__ == "__main__":
    main()
