"""Peak memory of an example's engine pod under the example's own maximum load.

    python bench/example_memory.py examples/smollm2-cpu.yaml [--json out.json]

Starts `kvpilot serve` with exactly the arguments the operator's builder gives the example's
InferenceService (only --host/--port changed for loopback), then loads it as hard as the example
allows: maxNumSeqs streams whose prompts and completions fill maxModelLen (ignore_eos), as many
again waiting behind them, and one body at the server's size limit (--max-request-body-bytes,
which goes to the big-body worker process) sent alongside. Meanwhile it samples, every 50 ms, the
summed RSS of every process of the server's tree (the API process, the engine core, the worker:
what the pod's cgroup is charged for, besides page cache), and at the end reads each process's
own peak (VmHWM). Reports both, with the breakdown the engine's start-up memory check predicts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

from kvpilot.operator.builders import build_engine_args
from kvpilot.operator.spec import parse_spec

MIB = 2**20


def is_ready(port: list[int]) -> bool:
    """Whether the server answers /ready with 200 (its port logged, its socket accepting)."""
    if not port:
        return False
    try:
        return httpx.get(f"http://127.0.0.1:{port[0]}/ready").status_code == 200
    except httpx.TransportError:  # the port is logged a moment before it accepts
        return False


def tree_pids(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(p) for p in (task / "children").read_text().split()]
    return pids


def status_kib(pid: int, field: str) -> int:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    return int(found.group(1)) if found else 0


def serve_args(example: Path) -> list[str]:
    manifest = yaml.safe_load(example.read_text())
    spec = parse_spec(manifest["spec"])
    args = build_engine_args(spec, manifest["metadata"]["name"])
    host = args.index("--host")
    args[host + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = "0"
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--big-body-mib", type=int, default=32, help="the server's body limit")
    opts = parser.parse_args(argv)
    manifest = yaml.safe_load(opts.example.read_text())
    spec = parse_spec(manifest["spec"])
    args = serve_args(opts.example)
    print("kvpilot", " ".join(args), flush=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.cli", *args],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    log: list[str] = []
    port: list[int] = []

    def read_log() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            log.append(line)
            found = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if found:
                port.append(int(found.group(1)))

    threading.Thread(target=read_log, daemon=True).start()
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(sum(status_kib(p, "VmRSS") for p in tree_pids(proc.pid)) * 1024)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        deadline = time.monotonic() + 600
        while not is_ready(port):
            assert proc.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "not ready"
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port[0]}"
        idle = samples[-1]
        max_len = spec.engine.max_model_len or 2048
        max_seqs = spec.engine.max_num_seqs or 128
        prompt_words = max_len * 3 // 4  # ~1 token per word (see bench/serve_bench.py)

        def one(i: int) -> int:
            body = {
                "model": manifest["metadata"]["name"],
                "prompt": f"Request {i}: " + " the" * prompt_words,
                "ignore_eos": True,
                "temperature": 0.8,
            }
            with httpx.Client(timeout=1800) as http:
                response = http.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["total_tokens"])

        def big() -> int:
            blob = b'{"prompt": "' + b"x" * (opts.big_body_mib * MIB - 64) + b'"}'
            with httpx.Client(timeout=600) as http:
                return http.post(f"{url}/v1/completions", content=blob).status_code

        started = time.monotonic()
        with ThreadPoolExecutor(2 * max_seqs + 1) as pool:
            big_status = pool.submit(big)
            totals = list(pool.map(one, range(2 * max_seqs)))
        elapsed = time.monotonic() - started
        hwm = {p: status_kib(p, "VmHWM") * 1024 for p in tree_pids(proc.pid)}
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        stop.set()
        sampler.join()
        proc.terminate()
        proc.wait(120)
    result = {
        "example": str(opts.example),
        "args": args,
        "requests": len(totals),
        "tokens_per_request": totals[:3],
        "big_body_status": big_status.result(),
        "load_seconds": round(elapsed, 1),
        "idle_rss_mib": round(idle / MIB),
        "peak_sampled_rss_mib": round(max(samples) / MIB),
        "sum_of_process_peaks_mib": round(sum(hwm.values()) / MIB),
        "process_peaks_mib": {str(p): round(v / MIB) for p, v in hwm.items()},
        "preemptions": re.findall(r"^vllm:num_preemptions_total\S* (\S+)", metrics, re.M),
        "memory_limit_mib": None if spec.memory_limit is None else spec.memory_limit // MIB,
        "exit_code": proc.returncode,
        "machine": f"{os.cpu_count()} CPUs, shared with other jobs",
    }
    print(json.dumps(result, indent=2))
    if opts.json is not None:
        opts.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
