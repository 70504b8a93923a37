"""kvpilot against vLLM's CPU build, serving and offline, in one run (serve_bench.py --peer-vllm,
py): both servers up per dtype, alternating rounds per concurrency, each round's
offline runs beside them, the per-(dtype, concurrency) summary with its goals, its text and its
figure. The procedure is described in bench/serve_bench.py's docstring."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common.client import run_once
from common.dataset import BenchRequest, request_prompt, synthetic_dataset
from common.offline_workers import (
    BLOCK_SIZE,
    CHECK_MAX_TOKENS,
    CHECK_QUESTIONS,
    SERVED_MODEL_NAME,
    SYSTEMS,
    OfflineWorker,
    format_greedy,
    format_offline,
    greedy_check,
    offline_batch,
    offline_round,
    offline_summary,
    progress_bar,
    start_workers,
    warm_up,
)
from common.plotting import pyplot
from common.processes import ServerProcess, free_port, kvpilot_serve_cmd, wait_until_idle
from common.stats import fmt, median_or_none, ratio
from kvpilot.contract.cpus import format_cpu_list

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WARMUP_SEED = 1_000_000  # far above every round's seed: a warm-up shares no prompt with a round
WARMUP_OUTPUT_LEN = 8
HEALTH_P99_GOAL_MS = 50.0
# Per-run figures the summary takes medians of: name -> its value in a run's summary.
SERVE_METRICS = {
    "out_tok_s": lambda s: s["output_throughput"],
    "ttft_p50_ms": lambda s: s["ttft_ms"]["p50"],
    "itl_p50_ms": lambda s: s["itl_ms"]["p50"],
    "health_p50_ms": lambda s: s["health_ms"]["p50"],
    "health_p99_ms": lambda s: s["health_ms"]["p99"],
    "health_max_ms": lambda s: s["health_ms"]["max"],
    # The API process's CPU per streamed token: HTTP, detokenizing, SSE (what serving adds).
    "api_cpu_us_per_tok": lambda s: 1e6 * s["api_cpu_s"] / max(1, s["total_output_tokens"]),
}
NAMES = {"kvpilot": "kvpilot", "vllm": "vLLM"}


def vllm_env(python: str, extra: list[str]) -> dict[str, str]:
    """The environment of vLLM's processes: its own venv first on PATH and nothing of kvpilot's
    (PYTHONPATH would mix the two venvs' packages), the notes' settings unless already set, then
    the --vllm-env overrides (e.g. an LD_PRELOAD meant for vLLM alone)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    bin_dir = Path(python).parent  # not resolved: the venv's python is a symlink out of it
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    # 1 GiB of KV cache, kvpilot's default --kv-cache-gib (unset, vLLM sizes it from the RAM).
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Every CPU for the model worker's OpenMP threads, as kvpilot computes with all of them; the
    # default "auto" reserves one core for vLLM's engine-core process (one of two here).
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", format_cpu_list(os.sched_getaffinity(0)))
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--vllm-env takes KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def bundled_hf_dir() -> str:
    """kvpilot's dequantized HF copy of the bundled GGUF (made on first use): vLLM loads it, so
    both systems run the very same float32 weights."""
    from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
    from kvpilot.engine.model.loader import bundled_gguf_path

    return str(gguf_to_hf_dir(bundled_gguf_path()))


def round_seed(args: argparse.Namespace, concurrency_index: int, round_index: int) -> int:
    """A new seed per round and concurrency (a repeated seed would send prompts the server has
    cached already); the same for both systems, for serving and offline, and for every dtype."""
    return args.seed + concurrency_index * args.rounds + round_index


def peer_dataset(
    args: argparse.Namespace, seed: int, output_len: int | None = None
) -> list[BenchRequest]:
    return synthetic_dataset(
        args.num_prompts, args.input_len, output_len or args.output_len, args.range_ratio,
        args.prefix_len, seed,
    )  # fmt: skip


def prompts_and_lengths(
    args: argparse.Namespace, requests: list[BenchRequest]
) -> tuple[list[Any], list[int]]:
    return [request_prompt(r, args.endpoint) for r in requests], [r.output_len for r in requests]


def format_run_line(record: dict[str, Any]) -> str:
    s = record["summary"]
    health = s.get("health_ms")
    probes = (
        f", /health p50/p99/max {health['p50']:.1f}/{health['p99']:.1f}/{health['max']:.1f} ms"
        f" ({health['probes']} probes, {health['failed']} failed)"
        if health
        else ""
    )
    cpu = record["server_cpu_s"]
    api, out = "api_cpu_s" in s, max(1, s["total_output_tokens"])
    return (
        f"{record['dtype']} c={record['concurrency']} round {record['round']} "
        f"{NAMES[record['system']]:7}: {s['output_throughput']:7.1f} out tok/s, TTFT p50 "
        f"{s['ttft_ms']['p50']:7.1f} ms, ITL p50 {s['itl_ms']['p50']:6.1f} ms{probes}, "
        f"{s['total_input_tokens']} prompt tokens ({s['cached_prompt_tokens']} cached), "
        f"failed {s['failed']}; {s['duration_s']:.1f} s, server CPU s "
        + ", ".join(f"{NAMES[n]} {v:.1f}" for n, v in cpu.items())
        + f", client CPU s {s['client_cpu_s']:.1f}"
        + (f", API process {1e6 * s['api_cpu_s'] / out:.0f} us/token" if api else "")
        + f" (after {record.get('settle_s', 0.0):.1f} s waiting for both to go quiet)"
    )


def peer_serving(
    args: argparse.Namespace,
    dtype: str,
    concurrencies: list[int],
    hf_dir: str,
    env: dict[str, str],
    logs: Path,
    commands: dict[str, dict[str, str]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One dtype: both servers up at once (an idle one should use next to no CPU while the other
    is measured: each run records both servers' CPU time to show it), then per concurrency a
    warm-up per server and the alternating rounds. Unless --no-offline or --offline-after, both
    offline workers (batch = the concurrency) are up beside the servers too, and each round's
    offline runs follow its serving runs on the same requests; returns the serving records, those
    offline records and the greedy check (empty when the offline part runs elsewhere)."""
    block = str(BLOCK_SIZE)
    kvpilot_args = [*shlex.split(args.serve_args), "--block-size", block, "--dtype", dtype]
    port = free_port()
    vllm_cmd = [
        args.peer_vllm, "-m", VLLM_SERVER_MODULE, "--model", hf_dir,
        "--served-model-name", SERVED_MODEL_NAME, "--dtype", dtype,
        "--block-size", block, "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.vllm_serve_args),
    ]  # fmt: skip
    servers: dict[str, ServerProcess] = {}
    records: list[dict[str, Any]] = []
    offline_records: list[dict[str, Any]] = []
    greedy: dict[str, Any] = {}
    interleave = not (args.no_offline or args.offline_after)
    try:
        servers["kvpilot"] = ServerProcess(
            "kvpilot", kvpilot_serve_cmd(kvpilot_args), "/ready",
            log=logs / f"serve-kvpilot-{dtype}.log",
        )  # fmt: skip
        servers["vllm"] = ServerProcess(
            "vllm", vllm_cmd, "/health", port=port, env=env, log=logs / f"serve-vllm-{dtype}.log"
        )
        commands[dtype] = {name: shlex.join(server.cmd) for name, server in servers.items()}
        start = time.perf_counter()
        urls = {name: server.wait_ready() for name, server in servers.items()}
        print(f"{dtype}: both servers ready in {time.perf_counter() - start:.0f} s", flush=True)
        for ci, concurrency in enumerate(concurrencies):
            warm = peer_dataset(args, WARMUP_SEED + ci, WARMUP_OUTPUT_LEN)
            for name in SYSTEMS:  # unmeasured: first-call overheads, this batch size's shapes
                run_once(args, urls[name], warm, concurrency, WARMUP_SEED)
            workers: dict[str, OfflineWorker] = {}
            if interleave:
                workers = start_workers(dtype, concurrency, args.peer_vllm, hf_dir, env, logs)
            try:
                offline_rounds: list[dict[str, Any]] = []
                if workers:
                    warm_up(workers, prompts_and_lengths(args, warm))
                for r in range(args.rounds):
                    seed = round_seed(args, ci, r)
                    requests = peer_dataset(args, seed)
                    records += peer_serving_round(
                        args, dtype, concurrency, r, seed, requests, servers, urls, workers
                    )
                    if workers:
                        prompts, lengths = prompts_and_lengths(args, requests)
                        server_pgids = tuple(s.proc.pid for s in servers.values())
                        offline_rounds.append(
                            offline_round(
                                workers, r, seed, prompts, lengths, quiet_pgids=server_pgids
                            )
                        )
                if workers and not greedy:
                    first = prompts_and_lengths(args, peer_dataset(args, round_seed(args, ci, 0)))
                    greedy = peer_greedy_check(args, workers, *first)
                info = {name: worker.info for name, worker in workers.items()}
            finally:
                for worker in workers.values():
                    worker.stop()
            if workers:
                print(format_offline(dtype, concurrency, offline_rounds), flush=True)
                offline_records.append(
                    {
                        "dtype": dtype,
                        "batch": concurrency,
                        "rounds": offline_rounds,
                        "workers": info,
                    }
                )
    finally:
        for server in servers.values():
            server.stop()
    if greedy:
        print(format_greedy(dtype, greedy), flush=True)
    return records, offline_records, greedy


def peer_serving_round(
    args: argparse.Namespace,
    dtype: str,
    concurrency: int,
    r: int,
    seed: int,
    requests: list[BenchRequest],
    servers: dict[str, ServerProcess],
    urls: dict[str, str],
    workers: dict[str, OfflineWorker],
) -> list[dict[str, Any]]:
    """Round r (0-based) of one concurrency: both servers on the same requests, kvpilot first in
    even rounds, each after everything up (servers, offline workers) has gone quiet."""
    records = []
    order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
    pgids = [s.proc.pid for s in servers.values()] + [w.proc.pid for w in workers.values()]
    for position, name in enumerate(order, 1):
        settle_s = wait_until_idle(pgids)
        cpu = {n: server.cpu_seconds() for n, server in servers.items()}
        api_cpu = servers[name].api_cpu_seconds()
        run = run_once(args, urls[name], requests, concurrency, seed, False, args.health_interval)
        api_cpu = servers[name].api_cpu_seconds() - api_cpu
        cpu = {n: server.cpu_seconds() - cpu[n] for n, server in servers.items()}
        report = run.report()
        report["summary"]["api_cpu_s"] = api_cpu
        record = {
            "dtype": dtype,
            "concurrency": concurrency,
            "round": r + 1,
            "seed": seed,
            "system": name,
            "position": position,
            "summary": report["summary"],
            "health_ms": [round(h * 1000, 3) for h in run.health_s],
            "server_cpu_s": cpu,  # both servers' CPU time during this run
            "settle_s": settle_s,  # waited for everything up to go quiet first
            "requests": report["requests"],
        }
        print(format_run_line(record), flush=True)
        records.append(record)
    return records


def peer_greedy_check(
    args: argparse.Namespace,
    workers: dict[str, OfflineWorker],
    prompts: list[Any],
    lengths: list[int],
) -> dict[str, Any]:
    """Greedy on the chat questions and the first --greedy-check of the first round's requests
    (their prompts and output lengths)."""
    questions = [[{"role": "user", "content": q}] for q in CHECK_QUESTIONS]
    n = args.greedy_check
    return greedy_check(
        workers,
        questions + prompts[:n],
        [CHECK_MAX_TOKENS] * len(questions) + lengths[:n],
    )


def peer_offline_runs(
    args: argparse.Namespace,
    dtype: str,
    concurrencies: list[int],
    hf_dir: str,
    env: dict[str, str],
    logs: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One dtype, offline: per batch size (= concurrency) both workers on the serving rounds'
    requests; the greedy check once, with the first batch size's workers."""
    records: list[dict[str, Any]] = []
    greedy: dict[str, Any] = {}
    for ci, batch in enumerate(concurrencies):
        rounds = []
        for r in range(args.rounds):
            seed = round_seed(args, ci, r)
            rounds.append((seed, *prompts_and_lengths(args, peer_dataset(args, seed))))
        warm = prompts_and_lengths(args, peer_dataset(args, WARMUP_SEED + ci, WARMUP_OUTPUT_LEN))
        progress, bar = progress_bar(
            1 + 2 * args.rounds, f"offline {dtype} batch {batch}", not args.no_progress
        )
        workers = start_workers(dtype, batch, args.peer_vllm, hf_dir, env, logs)
        try:
            batch_rounds = offline_batch(workers, rounds, warm, progress)
            if not greedy:
                _, first_prompts, first_lengths = rounds[0]
                greedy = peer_greedy_check(args, workers, first_prompts, first_lengths)
            info = {name: worker.info for name, worker in workers.items()}
        finally:
            bar.close()
            for worker in workers.values():
                worker.stop()
        print(format_offline(dtype, batch, batch_rounds), flush=True)
        records.append({"dtype": dtype, "batch": batch, "rounds": batch_rounds, "workers": info})
    print(format_greedy(dtype, greedy), flush=True)
    return records, greedy


def peer_summary(
    serving: list[dict[str, Any]], offline: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per (dtype, concurrency): medians over rounds per system, every round's kvpilot/vLLM
    ratio, the offline medians at batch = concurrency, and the goals."""
    keys = [(r["dtype"], r["concurrency"]) for r in serving]
    keys += [(o["dtype"], o["batch"]) for o in offline]
    configs = []
    for dtype, concurrency in dict.fromkeys(keys):
        config: dict[str, Any] = {"dtype": dtype, "concurrency": concurrency}
        runs = {
            (r["round"], r["system"]): r["summary"]
            for r in serving
            if (r["dtype"], r["concurrency"]) == (dtype, concurrency)
        }
        if runs:
            rounds = sorted({rnd for rnd, _ in runs})
            metrics = [m for m in SERVE_METRICS if "health" not in m and "api" not in m]
            for part, key in (("health", "health_ms"), ("api", "api_cpu_s")):
                if all(key in s for s in runs.values()):
                    metrics += [m for m in SERVE_METRICS if part in m]
            serve: dict[str, Any] = {}
            for name in SYSTEMS:
                mine = [runs[(rnd, name)] for rnd in rounds if (rnd, name) in runs]
                per_round = {m: [SERVE_METRICS[m](s) for s in mine] for m in metrics}
                serve[name] = {
                    "rounds": per_round,
                    "median": {m: statistics.median(v) for m, v in per_round.items() if v},
                    "failed": sum(s["failed"] for s in mine),
                }
            paired = [rnd for rnd in rounds if all((rnd, name) in runs for name in SYSTEMS)]
            config["rounds"] = rounds
            # The same requests everywhere: per round, the prompt tokens each server counted.
            config["prompt_tokens"] = {
                name: [runs[(rnd, name)]["total_input_tokens"] for rnd in paired]
                for name in SYSTEMS
            }
            config["serving"] = serve
            config["serving_ratios"] = {
                m: [
                    ratio(
                        SERVE_METRICS[m](runs[(rnd, "kvpilot")]),
                        SERVE_METRICS[m](runs[(rnd, "vllm")]),
                    )
                    for rnd in paired
                ]
                for m in ("out_tok_s", "ttft_p50_ms", "itl_p50_ms")
            }
        found = [o for o in offline if (o["dtype"], o["batch"]) == (dtype, concurrency)]
        if found:
            config["offline"] = offline_summary(found[0]["rounds"])
            config.setdefault("prompt_tokens", {})["offline"] = [
                r["prompt_tokens"] for r in found[0]["rounds"]
            ]
            if runs:
                # What the serving-against-offline goal reads (peer_goals): each round's serving
                # over its own offline run, the same requests back to back.
                by_round = {r["round"]: r for r in found[0]["rounds"] if "round" in r}
                config["serve_vs_offline"] = {
                    name: [
                        ratio(
                            SERVE_METRICS["out_tok_s"](runs[(rnd, name)]),
                            by_round[rnd][name]["tokens_per_s"],
                        )
                        for rnd in rounds
                        if (rnd, name) in runs and rnd in by_round
                    ]
                    for name in SYSTEMS
                }
        config["goals"] = peer_goals(config)
        configs.append(config)
    return configs


def own_offline_ratios(config: dict[str, Any]) -> tuple[float | None, float | None]:
    """kvpilot's serving over its own offline tok/s: (median of the per-round ratios, median
    serving over median offline). Paired by round, as the goals against vLLM are: a round's
    serving and offline runs are the same requests, and rounds differ in requests (seeds), by up to
    ~10 % in tok/s on their own, so the two medians can come from different requests."""
    serve, off = config.get("serving"), config.get("offline")
    if not (serve and off):
        return None, None
    paired = median_or_none((config.get("serve_vs_offline") or {}).get("kvpilot") or [])
    return paired, ratio(serve["kvpilot"]["median"]["out_tok_s"], off["kvpilot_tokens_per_s"])


def peer_goals(config: dict[str, Any]) -> list[dict[str, Any]]:
    goals: list[dict[str, Any]] = []

    def add(goal: str, value: float | None, op: str, target: float) -> None:
        met = None if value is None else {">=": value >= target, "<=": value <= target,
                                          "<": value < target}[op]  # fmt: skip
        goals.append({"goal": goal, "value": value, "op": op, "target": target, "met": met})

    serve, off = config.get("serving"), config.get("offline")
    batch = config["concurrency"]
    if serve and off:
        paired, of_medians = own_offline_ratios(config)
        add(
            f"kvpilot serving out tok/s / its offline tok/s at batch {batch}",
            paired if paired is not None else of_medians,
            ">=",
            0.95,
        )
    if serve:
        ratios = config["serving_ratios"]
        add("serving out tok/s, kvpilot / vLLM", median_or_none(ratios["out_tok_s"]), ">=", 1.10)
        add("TTFT p50, kvpilot / vLLM", median_or_none(ratios["ttft_p50_ms"]), "<=", 1.0)
        add("ITL p50, kvpilot / vLLM", median_or_none(ratios["itl_p50_ms"]), "<=", 1.0)
        health = serve["kvpilot"]["rounds"].get("health_p99_ms")
        if health:
            add("kvpilot /health p99 (ms), worst round", max(health), "<", HEALTH_P99_GOAL_MS)
    if off:
        add("offline tok/s, kvpilot / vLLM", off["ratio_median"], ">=", 1.10)
    return goals


def format_peer_config(config: dict[str, Any]) -> str:
    serve, off = config.get("serving"), config.get("offline")
    n = len(config.get("rounds") or (off or {}).get("ratios") or [])
    lines = [
        f"== {config['dtype']}, concurrency {config['concurrency']}: medians of {n} "
        f"round{'s' if n != 1 else ''} =="
    ]
    lines.append(
        f"{'':18}{'out tok/s':>10}{'TTFT p50':>10}{'ITL p50':>9}  "
        f"{'/health p50 / p99 / max (ms)':>28}{'failed':>8}"
        if serve
        else f"{'':18}{'out tok/s':>10}"
    )
    for name in SYSTEMS if serve else ():
        m = serve[name]["median"]
        health = (
            f"{m['health_p50_ms']:8.1f} / {m['health_p99_ms']:6.1f} / {m['health_max_ms']:6.1f}"
            if "health_p99_ms" in m
            else "-"
        )
        lines.append(
            f"{NAMES[name] + ' serve':18}{m['out_tok_s']:10.1f}{m['ttft_p50_ms']:10.1f}"
            f"{m['itl_p50_ms']:9.1f}  {health:>28}{serve[name]['failed']:8d}"
        )
    for name in SYSTEMS if off else ():
        label = f"{NAMES[name]} offline b{config['concurrency']}"
        lines.append(f"{label:18}{off[f'{name}_tokens_per_s']:10.1f}")
    if serve:
        for metric, label in (
            ("out_tok_s", "serving out tok/s"),
            ("ttft_p50_ms", "TTFT p50"),
            ("itl_p50_ms", "ITL p50"),
        ):
            values = ", ".join(fmt(v) for v in config["serving_ratios"][metric])
            lines.append(f"kvpilot/vLLM per round, {label}: {values}")
        if all("api_cpu_us_per_tok" in serve[name]["median"] for name in SYSTEMS):
            api = " / ".join(
                f"{NAMES[n]} {serve[n]['median']['api_cpu_us_per_tok']:.0f}" for n in SYSTEMS
            )
            lines.append(f"API process CPU per output token (us), median: {api}")
    if off:
        values = ", ".join(fmt(v) for v in off["ratios"])
        lines.append(f"kvpilot/vLLM per round, offline tok/s: {values}")
    paired = config.get("serve_vs_offline") or {}
    if any(paired.values()):
        each = "; ".join(
            f"{NAMES[name]} {', '.join(fmt(v) for v in values)} "
            f"(median {fmt(median_or_none(values))})"
            for name, values in paired.items()
        )
        lines.append(f"serving / own offline per round (same requests): {each}")
        if serve and off:
            of_medians = own_offline_ratios(config)[1]
            lines.append(
                "kvpilot median serving / median offline (maybe different rounds): "
                f"{fmt(of_medians)}"
            )
    tokens = config.get("prompt_tokens", {})
    if tokens:
        counts = "; ".join(f"{k} {v}" for k, v in tokens.items())
        same = "same" if len({json.dumps(v) for v in tokens.values()}) == 1 else "DIFFERENT"
        lines.append(f"prompt tokens per round ({same}): {counts}")
    for goal in config["goals"]:
        verdict = {True: "met   ", False: "MISSED", None: "n/a   "}[goal["met"]]
        lines.append(
            f"  [{verdict}] {goal['goal']}: {fmt(goal['value'])} (goal {goal['op']} "
            f"{goal['target']:g})"
        )
    return "\n".join(lines)


def plot_peer(configs: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()

    def serving(name: str, metric: str) -> Any:
        return lambda c: (c.get("serving") or {}).get(name, {}).get("rounds", {}).get(metric, [])

    def offline(name: str) -> Any:
        return lambda c: (c.get("offline") or {}).get("rounds", {}).get(name, [])

    blue, orange = "#2b6cb0", "#dd6b20"
    panels = [
        ("output tokens/s (higher is better)", "out_tok_s", [
            ("kvpilot serve", serving("kvpilot", "out_tok_s"), blue, ""),
            ("vLLM serve", serving("vllm", "out_tok_s"), orange, ""),
            ("kvpilot offline", offline("kvpilot"), blue, "//"),
            ("vLLM offline", offline("vllm"), orange, "//"),
        ]),
        ("TTFT p50, ms (lower is better)", "ttft_p50_ms", [
            ("kvpilot", serving("kvpilot", "ttft_p50_ms"), blue, ""),
            ("vLLM", serving("vllm", "ttft_p50_ms"), orange, ""),
        ]),
        ("ITL p50, ms (lower is better)", "itl_p50_ms", [
            ("kvpilot", serving("kvpilot", "itl_p50_ms"), blue, ""),
            ("vLLM", serving("vllm", "itl_p50_ms"), orange, ""),
        ]),
        ("/health p99 during the run, ms (goal < 50)", None, [
            ("kvpilot", serving("kvpilot", "health_p99_ms"), blue, ""),
            ("vLLM", serving("vllm", "health_p99_ms"), orange, ""),
        ]),
    ]  # fmt: skip
    labels = [f"{c['dtype']}\nconcurrency {c['concurrency']}" for c in configs]
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    for ax, (ylabel, ratio_key, series) in zip(axes.flat, panels, strict=True):
        width = 0.8 / len(series)
        for i, (label, values_of, color, hatch) in enumerate(series):
            for x, config in enumerate(configs):
                values = values_of(config)
                if not values:
                    continue
                pos = x - 0.4 + width * (i + 0.5)
                ax.bar(
                    pos,
                    statistics.median(values),
                    width,
                    color=color,
                    alpha=0.45 if hatch else 0.85,
                    hatch=hatch,
                    edgecolor=color,
                    label=label,
                )
                ax.scatter([pos] * len(values), values, s=12, color="black", zorder=3)
        if "health" in ylabel:
            ax.axhline(HEALTH_P99_GOAL_MS, color="red", linestyle="--", linewidth=1)
        # The ratios the goals read (medians of the paired rounds' ratios), over each group: a
        # bar is each server's own median over the rounds, which can rank them the other way.
        if ratio_key is not None:
            throughput = ratio_key == "out_tok_s"
            ax.set_ylim(top=ax.get_ylim()[1] * (1.3 if throughput else 1.2))
            for x, config in enumerate(configs):
                notes = []
                if config.get("serving"):
                    ratio = median_or_none(config["serving_ratios"][ratio_key])
                    notes.append(f"{'serve' if throughput else 'paired'} {fmt(ratio)}x")
                if config.get("offline") and throughput:
                    notes.append(f"offline {fmt(config['offline']['ratio_median'])}x")
                    paired = own_offline_ratios(config)[0]
                    if paired is not None:  # the serving-against-own-offline goal (>= 0.95)
                        notes.append(f"kvp serve/offline {fmt(paired)}")
                ax.text(
                    x, 0.98, "\n".join(notes), transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize="small",
                )  # fmt: skip
            ylabel += "\ntext: kvpilot/vLLM, medians of the rounds' ratios"
        ax.set_xticks(range(len(configs)), labels)
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles, strict=True))
        if not unique:  # e.g. the serving panels of an --offline-only run
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center")
            continue
        ax.legend(
            unique.values(), unique.keys(), fontsize="small", ncol=len(unique),
            loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False,
        )  # fmt: skip
    fig.suptitle(f"{title}\nbars: medians of the rounds; dots: each round")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_peer(args: argparse.Namespace) -> int:
    dtypes = [d for d in args.dtypes.split(",") if d]
    concurrencies = [int(c) for c in args.concurrencies.split(",") if c]
    out = Path(args.out)
    logs = out.with_name(out.name + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    hf_dir = bundled_hf_dir()
    env = vllm_env(args.peer_vllm, args.vllm_env)
    shown_env = {k: v for k, v in env.items() if k.startswith("VLLM_") or k == "LD_PRELOAD"}
    print(f"vLLM: {args.peer_vllm} on {hf_dir}; env {shown_env}; logs in {logs}", flush=True)
    serving: list[dict[str, Any]] = []
    offline: list[dict[str, Any]] = []
    greedy: dict[str, Any] = {}
    commands: dict[str, dict[str, str]] = {}
    start = time.perf_counter()

    def save() -> list[dict[str, Any]]:
        """The JSON so far (after each dtype too: a late failure keeps the earlier results)."""
        configs = peer_summary(serving, offline)
        config = {
            k: (None if isinstance(v, float) and math.isinf(v) else v)
            for k, v in vars(args).items()
        }
        report = {
            "config": config,
            "command": shlex.join(sys.argv),
            "hf_dir": hf_dir,
            "vllm_env": shown_env,
            "kvpilot_env": {k: v for k, v in os.environ.items() if k == "OMP_NUM_THREADS"},
            "server_commands": commands,
            "wall_s": time.perf_counter() - start,
            "summary": configs,
            "greedy_check": greedy,
            "offline": offline,
            "serving": serving,
        }
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        return configs

    for dtype in dtypes:
        if not args.offline_only:
            runs, beside, check = peer_serving(
                args, dtype, concurrencies, hf_dir, env, logs, commands
            )
            serving += runs
            offline += beside
            if check:
                greedy[dtype] = check
            save()
        if args.offline_after or args.offline_only:
            records, greedy[dtype] = peer_offline_runs(
                args, dtype, concurrencies, hf_dir, env, logs
            )
            offline += records
            save()
    configs = save()
    print()
    for config in configs:
        print(format_peer_config(config), end="\n\n")
    for dtype, check in greedy.items():
        print(f"greedy check {dtype}: {'MATCH' if check['match'] else 'MISMATCH'}")
    title = (
        f"kvpilot vs vLLM-CPU: {args.num_prompts} {args.endpoint} requests, input ~{args.input_len}"
        f", output ~{args.output_len} (±{args.range_ratio:.0%}), {args.rounds} rounds alternating"
    )
    plot_peer(configs, out.with_suffix(".png"), title)
    print(
        f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')} "
        f"({(time.perf_counter() - start) / 60:.1f} min)"
    )
    failed = any(r["summary"]["failed"] for r in serving)
    # Only float32 must match token for token: in 16 bits, two implementations' different (and
    # equally valid) rounding can flip a near-tie, which the report shows but is no failure.
    mismatch = not greedy.get("float32", {"match": True})["match"]
    return 1 if failed or mismatch else 0
