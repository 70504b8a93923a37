"""How long `kvpilot serve` takes from its start to answering /ready, split into phases by its log.

A replica woken from zero serves nothing before /ready (bench/router_wake.py: this is the wake,
nearly all of it), so every second here is a second a held request waits. Phases, from the
server's own log lines (wall-clock timestamps, this machine's one clock):

  imports      process start -> the API process's first line ("loading ...")
  core start   -> the engine core's first line (spawning it: a fresh interpreter importing torch)
  core load    -> "engine core ready" (model files, weights, KV cache, kernels)
  after core   -> /ready answers 200 (what the API process still does once the core is ready)

Each variant is a fresh `kvpilot serve` per round, the variants alternate (the machine may be
shared), one unmeasured start of each first (the page cache, the converted GGUF, the compiled C
kernels), and the median round is reported.

    python bench/serve_startup.py --rounds 7
    python bench/serve_startup.py --rounds 7 --baseline-src /tmp/base --json out.json --plot out.png
    python bench/serve_startup.py --replot out.json --plot out.png

--baseline-src is a directory holding a `kvpilot` package (e.g. `git archive <commit> engine cli |
tar -x -C /tmp/base/kvpilot`); the `base` variant runs with it first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

PHASES = ("imports", "core start", "core load", "after core", "total")
# The log lines that end each phase (see the module docstring).
API_FIRST = "kvpilot.server: loading"
CORE_FIRST = "kvpilot: loading model"
CORE_READY = "kvpilot: engine core ready"
PORT_LINE = "Uvicorn running on http://127.0.0.1:"


def log_time(line: str) -> float:
    """The wall-clock time of a log line of LOG_FORMAT ("2026-11-27 12:32:27,824 INFO ...")."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_line_with(lines: list[str], words: str) -> str:
    found = next((line for line in lines if words in line), None)
    if found is None:
        raise RuntimeError(f"no log line with {words!r}")
    return found


def phases(started: float, ready: float, lines: list[str]) -> dict[str, float]:
    """Seconds per phase of one start, from its log lines and the two times measured here."""
    api_first = log_time(first_line_with(lines, API_FIRST))
    core_first = log_time(first_line_with(lines, CORE_FIRST))
    core_ready = log_time(first_line_with(lines, CORE_READY))
    return {
        "imports": api_first - started,
        "core start": core_first - api_first,
        "core load": core_ready - core_first,
        "after core": ready - core_ready,
        "total": ready - started,
    }


@dataclass(frozen=True)
class Started:
    url: str  # http://127.0.0.1:PORT
    started: float  # time.time() at the process's start
    ready: float  # time.time() when /ready first answered 200


@contextlib.contextmanager
def serving(extra_path: str | None, log_path: Path, timeout_s: float) -> Iterator[Started]:
    """A fresh `kvpilot serve --port 0` (extra_path first on its PYTHONPATH), its log in log_path,
    until it answers /ready; terminated on the way out."""
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0"]
    with open(log_path, "w") as log:
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            url, ready = wait_ready(proc, log_path, started + timeout_s)
            yield Started(url, started, ready)
        finally:
            proc.terminate()
            proc.wait(60)


def start_once(extra_path: str | None, log_path: Path, timeout_s: float) -> dict[str, float]:
    with serving(extra_path, log_path, timeout_s) as server:
        pass
    return phases(server.started, server.ready, log_path.read_text().splitlines())


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, deadline: float) -> tuple[str, float]:
    """The server's URL and the time /ready first answered 200 (polled every 20 ms)."""
    url = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvpilot serve exited {proc.returncode}: see {log_path}")
        if url is None:
            text = log_path.read_text()
            if PORT_LINE in text:
                url = "http://127.0.0.1:" + text.split(PORT_LINE, 1)[1].split()[0]
        if url is not None:
            try:
                with urllib.request.urlopen(f"{url}/ready", timeout=1) as answer:
                    if answer.status == 200:
                        return url, time.time()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
        time.sleep(0.02)
    raise RuntimeError(f"not ready in time: see {log_path}")


def medians(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    return {
        name: {p: statistics.median(g[p] for g in got) for p in PHASES}
        for name, got in rounds.items()
    }


def print_table(rounds: dict[str, list[dict[str, float]]]) -> None:
    print("| variant | " + " | ".join(PHASES) + " |")
    print("| --- |" + " --- |" * len(PHASES))
    for name, m in medians(rounds).items():
        print(f"| {name} | " + " | ".join(f"{m[p]:.2f}" for p in PHASES) + " |")


def plot(rounds: dict[str, list[dict[str, float]]], path: Path) -> None:
    """One bar per variant: its median phases end to end, each round's total as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.8 * len(rounds)))
    names = list(rounds)
    for y, name in enumerate(names):
        left = 0.0
        m = medians(rounds)[name]
        for i, phase in enumerate(PHASES[:-1]):
            ax.barh(y, m[phase], left=left, color=f"C{i}", label=phase if y == 0 else None)
            left += m[phase]
        ax.plot([g["total"] for g in rounds[name]], [y] * len(rounds[name]), "k.", alpha=0.6,
                label="a round's total" if y == 0 else None)  # fmt: skip
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds from `kvpilot serve` starting to /ready 200 (median phases)")
    ax.legend(loc="upper left", fontsize=8, ncols=5)
    ax.set_ylim(-0.6, len(names) + 0.4)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline-src", help="a directory holding the baseline's kvpilot package")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="write every round's phases here")
    parser.add_argument("--plot", type=Path, help="draw the medians' phases here (png)")
    parser.add_argument("--replot", type=Path, help="no run: table and plot of a --json file")
    args = parser.parse_args()
    if args.replot:
        rounds = json.loads(args.replot.read_text())["rounds"]
        print_table(rounds)
        if args.plot:
            plot(rounds, args.plot)
        return

    variants: dict[str, str | None] = {"this": None}
    if args.baseline_src:
        variants = {"base": args.baseline_src, **variants}
    logs = Path(tempfile.mkdtemp(prefix="serve-startup-"))
    for name, extra_path in variants.items():
        start_once(extra_path, logs / f"warmup-{name}.log", args.timeout)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            got = start_once(variants[name], logs / f"{name}-{r}.log", args.timeout)
            rounds[name].append(got)
            print(f"round {r + 1}/{args.rounds} {name}: "
                  + ", ".join(f"{p} {got[p]:.2f} s" for p in PHASES), flush=True)  # fmt: skip

    print(f"\nmedians of {args.rounds} rounds (s); logs in {logs}")
    print_table(rounds)
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds}, indent=1))
    if args.plot:
        plot(rounds, args.plot)


if __name__ == "__main__":
    main()
