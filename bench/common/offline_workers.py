"""The parent side of the offline workers: kvpilot's and vLLM's offline `LLM`, each in a process of
its own (bench/peer_offline.py --worker, run with each system's interpreter), driven over JSON
lines; warm-up, alternating rounds on the same token ids, the greedy check, and their summaries.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.processes import log_tail, stop_group, wait_until_idle

# The worker script, run with either system's interpreter.
WORKER_SCRIPT = Path(__file__).resolve().parents[1] / "peer_offline.py"

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


class OfflineWorker:
    """One system's worker process; calls block until it answers."""

    def __init__(
        self,
        system: str,
        python: str,
        config: dict[str, Any],
        env: dict[str, str],
        log: Path,
        *,
        script: Path = WORKER_SCRIPT,
    ) -> None:
        """script: the worker's program (peer_offline.py's protocol: `--worker SYSTEM CONFIG`)."""
        self.system = system
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        cmd = [python, str(script), "--worker", system, json.dumps(config)]
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
        vllm_config = {**config, "model": hf_dir, "served_model_name": SERVED_MODEL_NAME}
        workers["vllm"] = OfflineWorker(
            "vllm", vllm_python, vllm_config, vllm_env,
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
