"""Load with faults on loopback, bounded in time, against a real `kvpilot serve` (on a read-only
root filesystem where the machine allows a private mount namespace, as in the operator's pods):

- 24 concurrent streaming clients against a server that runs 8 at a time (so most start queued);
  a third of them (seeded choice) disconnect at random points, from right after the response
  headers (possibly still queued) to a dozen tokens in;
- beside them, a burst of oversized bodies (413, by Content-Length and chunked) and 30,000-deep
  bodies (400);
- then SIGTERM while the others still stream.

Every client that stayed gets a complete stream (all its tokens, a finish_reason, [DONE]); every
disconnect is an abort in the engine; when the drain ends the engine runs and holds nothing (the
server's "drained" log line: 0 running, 0 waiting, KV usage 0); /health, polled from a process of
its own, answers every time in under 100 ms (less the time the server and the poller waited for a
CPU, which on a shared machine is other jobs' doing); the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.model.gguf_convert import cache_root

from .serve_process import can_make_root_read_only, launch_serve, read_only_wrapper

# More clients than the engine runs at once: some wait queued, and some of those leave there.
NUM_CLIENTS = 24
MAX_NUM_SEQS = 8
NUM_LEAVING = NUM_CLIENTS // 3
MAX_TOKENS = 16  # above the dozen tokens after which the last leaver leaves
BODY_LIMIT = 64 * 1024
HEALTH_BOUND_S = 0.100
MIN_HEALTH_SAMPLES = 20


def deep_body() -> bytes:
    # Past the JSON parser's own stack, yet under the body limit.
    return b'{"prompt": "hi", "x": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"


async def stream_one(
    http: httpx.AsyncClient, url: str, i: int, leave_after: int | None
) -> dict[str, object]:
    """Returns what the client saw: tokens, finish reason, [DONE], or that it left."""
    body = {
        "prompt": f"Client {i} says: once upon a time",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    seen: dict[str, object] = {"chunks": 0, "tokens": 0, "finish": None, "done": False,
                               "left": False}  # fmt: skip
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if leave_after is not None and seen["chunks"] >= leave_after:  # type: ignore[operator]
                seen["left"] = True
                return seen  # closing the stream here is the disconnect
            if line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk["usage"] is not None:  # the last chunk: no choices
                    seen["tokens"] = chunk["usage"]["completion_tokens"]
                    continue
                seen["chunks"] = int(seen["chunks"]) + 1  # type: ignore[call-overload]
                seen["finish"] = chunk["choices"][0]["finish_reason"] or seen["finish"]
    return seen


def hostile_burst(url: str) -> list[int]:
    """Oversized (declared and chunked) and deep bodies, sent from threads beside the streams."""
    statuses: list[int] = []

    def chunked() -> object:
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    def send(kind: str) -> None:
        with httpx.Client(timeout=60) as http:
            if kind == "big":
                content: object = b'{"prompt": "' + b"x" * (2 * BODY_LIMIT) + b'"}'
            elif kind == "chunked":
                content = chunked()
            else:
                content = deep_body()
            statuses.append(http.post(f"{url}/v1/completions", content=content).status_code)

    threads = [
        threading.Thread(target=send, args=(kind,))
        for kind in ["big"] * 6 + ["chunked"] * 4 + ["deep"] * 6
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return statuses


def aborts(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
        and sample.labels.get("finished_reason") == "abort"
    )


@pytest.mark.slow
def test_24_streams_with_disconnects_and_hostile_bodies_then_sigterm(tmp_path: Path) -> None:
    rng = random.Random(13)
    leaving = dict.fromkeys(rng.sample(range(NUM_CLIENTS), NUM_LEAVING), 0)
    for i in leaving:
        leaving[i] = rng.randint(0, 12)
    wrapper: tuple[str, ...] = ()
    env: dict[str, str] = {}
    if can_make_root_read_only(tmp_path):
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        cache_root().mkdir(parents=True, exist_ok=True)
        wrapper = read_only_wrapper()
        env = {"SCRATCH": str(scratch), "CACHE": str(cache_root()), "HOME": str(scratch),
               "TMPDIR": str(scratch), "KVPILOT_CACHE_DIR": str(cache_root()),
               "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
        # The wrapper really makes the root read-only (else that part proves nothing).
        denied = subprocess.run(
            [*wrapper, "touch", str(Path(__file__).parent / "written-by-test")],
            env={**env, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
        )
        assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    args = ("--dtype", "bfloat16", "--kv-cache-gib", "0.04", "--max-model-len", "256",
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-request-body-bytes", str(BODY_LIMIT), "--shutdown-timeout", "120")  # fmt: skip
    with launch_serve(*args, wrapper=wrapper, env=env) as served:
        url = served.url
        health_log, stop = tmp_path / "health", tmp_path / "stop-health"
        poller_script = str(Path(__file__).parent / "health_poller.py")
        pid = str(served.proc.pid)
        poller_args = [sys.executable, poller_script, url, pid, str(health_log), str(stop)]
        poller = subprocess.Popen(poller_args)
        before = aborts(url)

        async def run() -> tuple[list[dict[str, object]], list[int], float, int]:
            limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
            async with httpx.AsyncClient(timeout=300, limits=limits) as http:
                tasks = [
                    asyncio.create_task(stream_one(http, url, i, leaving.get(i)))
                    for i in range(NUM_CLIENTS)
                ]
                burst = asyncio.create_task(asyncio.to_thread(hostile_burst, url))
                leavers = [tasks[i] for i in leaving]
                await asyncio.wait_for(asyncio.gather(*leavers, burst), 240)
                # Every leaver is gone and the burst answered: SIGTERM while the rest stream.
                num_aborted = await asyncio.to_thread(aborts, url)
                unfinished = sum(not t.done() for t in tasks)
                served.proc.send_signal(signal.SIGTERM)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
                return results, burst.result(), num_aborted, unfinished

        results, burst_statuses, num_aborted, unfinished = asyncio.run(run())
        exit_code = served.proc.wait(120)
        stop.touch()
        poller.wait(30)

    log = "".join(served.log)
    assert exit_code == 0, log[-3000:]
    assert unfinished > 0, "every stream had ended before SIGTERM: the drain was not exercised"
    for i, seen in enumerate(results):
        if i in leaving:
            assert seen["left"], (i, seen)
        else:
            complete = {"tokens": MAX_TOKENS, "finish": "length", "done": True, "left": False}
            assert {k: v for k, v in seen.items() if k != "chunks"} == complete, (i, seen)
    assert sorted(burst_statuses) == [400] * 6 + [413] * 10, burst_statuses
    # Each disconnect is an abort (a leaver whose stream had already ended would not be, but
    # none has: 12 tokens at most of 16).
    assert num_aborted - before == NUM_LEAVING, (num_aborted, before)
    drained = re.search(r"drained: no request in flight \(engine: (\d+) running, (\d+) waiting, "
                        r"KV cache usage ([\d.]+)%\)", log)  # fmt: skip
    assert drained is not None, log[-3000:]
    assert drained.groups() == ("0", "0", "0.0"), drained.group(0)
    samples = [line.split() for line in health_log.read_text().splitlines()]
    # A sample every ~20 ms while the run lasts: a quiet machine finishes it in ~1.5 s (50 seen).
    assert len(samples) >= MIN_HEALTH_SAMPLES and all(s[1] == "200" for s in samples)
    latencies = sorted(float(s[0]) for s in samples)
    # A sample's time minus what the server's loop thread and the poller spent waiting for a
    # CPU meanwhile: on a shared machine, other jobs' load shows up in the waits, not here.
    served_in = sorted(float(s[0]) - float(s[2]) - float(s[3]) for s in samples)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(
        f"/health: {len(latencies)} samples, p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
        f"max {latencies[-1] * 1e3:.1f} ms; max less CPU waits {served_in[-1] * 1e3:.1f} ms"
    )
    # Every sample under 100 ms, net of the CPU waits: a full garbage collection over the API
    # process's startup objects once stalled the loop 100-150 ms (kvpilot.engine.gc_freeze).
    assert served_in[-1] < HEALTH_BOUND_S, f"/health took {served_in[-1] * 1e3:.0f} ms"
    if wrapper:
        assert "Read-only file system" not in log
