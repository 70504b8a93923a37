"""kvpilot serving against its own offline run, per CPU placement, in one run.

On the 2-core VM, `kvpilot serve` reaches ~0.95x the tok/s of its own offline `LLM` on the same
requests (bench/RESULTS.md, issue 12). The question this answers: is that loss the API process
and the load generator sharing the CPUs with the engine core's compute threads (a preempted
thread holds up its step), or something in the serving path itself (IPC, the turnover of
requests)? Each placement (--placements, comma-separated) runs serving and offline on the same
CPUs for the engine:

- `shared`: `kvpilot serve` as by default (the engine core's threads on every CPU, the API
  process beside them), the offline `LLM` on every CPU, the load generator unbound.
- `api-cpus=N`: `kvpilot serve --api-cpus N` (the engine core on all CPUs but the last N, the API
  process on those N); the offline `LLM` bound to the same engine CPUs with the same threads; the
  load generator bound to the API process's CPUs.

Both servers and both offline workers (peer_offline.py's kvpilot worker) stay up. Per round (a
new seed: new requests), per placement (order alternating by round): the serving run (streamed
/v1/completions at --concurrency, serve_bench.py's client), then the offline run of the same
token ids at max_num_seqs = the concurrency, each after every process went quiet. Prints every
round's tok/s and serving / offline ratio, the medians; writes OUT.json and OUT.png.

    python bench/serve_vs_offline.py --placements shared,api-cpus=1 --rounds 6 \\
        --dtype bfloat16 --concurrency 16 --num-prompts 64 --out bench/out/serve_vs_offline
    python bench/serve_vs_offline.py --combine bench/out/serve_vs_offline_*.json \\
        --out bench/serve_vs_offline   # several runs' JSON in one figure
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench
from common.client import run_once
from common.offline_workers import BLOCK_SIZE, MAX_NUM_BATCHED_TOKENS, OfflineWorker
from common.peer import WARMUP_OUTPUT_LEN, WARMUP_SEED, peer_dataset, prompts_and_lengths
from common.plotting import pyplot
from common.processes import ServerProcess, kvpilot_serve_cmd, wait_until_idle

from kvpilot.contract.cpus import format_cpu_list
from kvpilot.engine.cpu.affinity import bind_this_process, place
from kvpilot.engine.cpu.threads import read_cpu_limit

GOAL = 0.95  # issue 12: serving >= 0.95x its own offline tok/s at the same batch


@dataclass(frozen=True)
class Placement:
    name: str
    serve_args: tuple[str, ...]
    engine_cpus: tuple[int, ...] | None  # None: every CPU (not bound)
    engine_threads: int | None  # None: torch's default
    client_cpus: tuple[int, ...] | None  # the load generator's CPUs (None: every CPU)


def parse_placement(name: str, allowed: set[int], quota: float | None) -> Placement:
    """`shared` or `api-cpus=N`, placed as `kvpilot serve` would place it on this machine."""
    if name == "shared":
        return Placement(name, (), None, None, None)
    key, _, value = name.partition("=")
    if key != "api-cpus" or not value.isdigit():
        raise ValueError(f"a placement is shared or api-cpus=N, got {name!r}")
    found = place(allowed, quota, {}, api_cpus=int(value))
    assert found is not None
    return Placement(name, ("--api-cpus", value), found.engine, found.engine_threads, found.api)


def offline_config(args: argparse.Namespace, placement: Placement) -> dict[str, Any]:
    config: dict[str, Any] = {
        "dtype": args.dtype,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": args.concurrency,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
    }
    if placement.engine_cpus is not None:
        config["cpus"] = list(placement.engine_cpus)
        config["threads"] = placement.engine_threads
    return config


def workload_args(args: argparse.Namespace) -> argparse.Namespace:
    """serve_bench's namespace for its client (run_once) with this run's workload."""
    return serve_bench.build_parser().parse_args(
        [
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--no-progress",
        ]
    )  # fmt: skip


def run_rounds(
    args: argparse.Namespace, placements: list[Placement], logs: Path
) -> list[dict[str, Any]]:
    bench_args = workload_args(args)
    allowed = os.sched_getaffinity(0)
    servers: dict[str, ServerProcess] = {}
    workers: dict[str, OfflineWorker] = {}
    records: list[dict[str, Any]] = []
    try:
        for p in placements:
            cmd = kvpilot_serve_cmd(
                ["--block-size", str(BLOCK_SIZE), "--dtype", args.dtype,
                 *p.serve_args]
            )  # fmt: skip
            servers[p.name] = ServerProcess(p.name, cmd, "/ready", log=logs / f"serve-{p.name}.log")
            workers[p.name] = OfflineWorker(
                "kvpilot", sys.executable, offline_config(args, p), dict(os.environ),
                logs / f"offline-{p.name}.log",
            )  # fmt: skip
        urls = {name: server.wait_ready() for name, server in servers.items()}
        for worker in workers.values():
            worker.wait_ready()
        pgids = [s.proc.pid for s in servers.values()] + [w.proc.pid for w in workers.values()]
        warm = peer_dataset(bench_args, WARMUP_SEED, WARMUP_OUTPUT_LEN)
        warm_prompts, warm_lengths = prompts_and_lengths(bench_args, warm)
        for p in placements:
            bind_this_process(p.client_cpus or allowed)
            run_once(bench_args, urls[p.name], warm, args.concurrency, warm[0].index)
            ids = workers[p.name]("tokenize", prompts=warm_prompts)
            workers[p.name]("run", prompts=ids, max_tokens=warm_lengths)
        for r in range(args.rounds):
            seed = args.seed + r
            requests = peer_dataset(bench_args, seed)
            prompts, lengths = prompts_and_lengths(bench_args, requests)
            order = placements if r % 2 == 0 else placements[::-1]
            for p in order:
                wait_until_idle(pgids)
                bind_this_process(p.client_cpus or allowed)
                run = run_once(bench_args, urls[p.name], requests, args.concurrency, seed, False)
                bind_this_process(allowed)
                summary = run.report()["summary"]
                if summary["failed"]:
                    raise RuntimeError(f"{summary['failed']} requests failed ({p.name})")
                ids = workers[p.name]("tokenize", prompts=prompts)
                wait_until_idle(pgids)
                offline = workers[p.name]("run", prompts=ids, max_tokens=lengths)
                offline_tok_s = offline["output_tokens"] / offline["seconds"]
                record = {
                    "round": r + 1,
                    "seed": seed,
                    "placement": p.name,
                    "serve_tok_s": summary["output_throughput"],
                    "offline_tok_s": offline_tok_s,
                    "ratio": summary["output_throughput"] / offline_tok_s,
                    "ttft_p50_ms": summary["ttft_ms"]["p50"],
                    "itl_p50_ms": summary["itl_ms"]["p50"],
                    "output_tokens": summary["total_output_tokens"],
                }
                records.append(record)
                print(
                    f"round {r + 1} {p.name:>12}: serving {record['serve_tok_s']:6.1f} tok/s, "
                    f"offline {offline_tok_s:6.1f} tok/s, serving/offline {record['ratio']:.3f}",
                    flush=True,
                )
    finally:
        bind_this_process(allowed)
        for worker in workers.values():
            worker.stop()
        for server in servers.values():
            server.stop()
    return records


def summarize(placements: list[Placement], records: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for p in placements:
        mine = [r for r in records if r["placement"] == p.name]
        ratios = [r["ratio"] for r in mine]
        out[p.name] = {
            "engine_cpus": format_cpu_list(p.engine_cpus) if p.engine_cpus else "all",
            "client_cpus": format_cpu_list(p.client_cpus) if p.client_cpus else "all",
            "rounds": len(mine),
            "ratios": [round(x, 4) for x in ratios],
            "median_ratio": statistics.median(ratios),
            "rounds_meeting_goal": sum(x >= GOAL for x in ratios),
            "median_serve_tok_s": statistics.median([r["serve_tok_s"] for r in mine]),
            "median_offline_tok_s": statistics.median([r["offline_tok_s"] for r in mine]),
        }
    return out


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        "| placement | engine CPUs | client CPUs | serving tok/s | offline tok/s | "
        "serving / offline per round | median | rounds >= 0.95 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['engine_cpus']} | {s['client_cpus']} | "
            f"{s['median_serve_tok_s']:.1f} | {s['median_offline_tok_s']:.1f} | "
            f"{', '.join(f'{x:.2f}' for x in s['ratios'])} | **{s['median_ratio']:.3f}** | "
            f"{s['rounds_meeting_goal']} of {s['rounds']} |"
        )
    return "\n".join(lines)


def plot(summary: dict[str, Any], records: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()

    fig, (ax_ratio, ax_tok) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(summary)
    for i, name in enumerate(names):
        ratios = summary[name]["ratios"]
        ax_ratio.scatter([i] * len(ratios), ratios, color="tab:blue", alpha=0.6, zorder=3)
        ax_ratio.hlines(summary[name]["median_ratio"], i - 0.25, i + 0.25, color="black", lw=2)
        mine = [r for r in records if r["placement"] == name]
        rounds = [r["round"] for r in mine]
        ax_tok.plot(rounds, [r["serve_tok_s"] for r in mine], "o-", label=f"{name}: serving")
        ax_tok.plot(rounds, [r["offline_tok_s"] for r in mine], "s--", label=f"{name}: offline")
    ax_ratio.axhline(GOAL, color="tab:red", ls=":", label=f"goal {GOAL}")
    ax_ratio.set_xticks(range(len(names)), names)
    ax_ratio.set_ylabel("serving / own offline tok/s (per round; bar: median)")
    ax_ratio.legend(loc="lower right")
    ax_tok.set_xlabel("round")
    ax_tok.set_ylabel("output tok/s")
    ax_tok.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_combined(reports: list[dict[str, Any]], path: Path) -> None:
    """One panel for several runs (OUT.json files): per configuration, each placement's per-round
    ratios and median, side by side."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(10, 4.5))
    colors = ["tab:orange", "tab:blue", "tab:green", "tab:purple"]
    labels: list[str] = []
    placements = list(reports[0]["summary"])
    width = 0.8 / len(placements)
    for i, report in enumerate(reports):
        a = report["args"]
        labels.append(f"{a['dtype']}, c={a['concurrency']}")
        for j, name in enumerate(placements):
            s = report["summary"][name]
            x = i + (j - (len(placements) - 1) / 2) * width
            ax.scatter([x] * len(s["ratios"]), s["ratios"], color=colors[j], alpha=0.5, s=18)
            ax.hlines(
                s["median_ratio"], x - width / 2.5, x + width / 2.5, color=colors[j], lw=3,
                label=name if i == 0 else None,
            )  # fmt: skip
            ax.annotate(
                f"{s['median_ratio']:.3f}", (x, s["median_ratio"]), textcoords="offset points",
                xytext=(0, -14), ha="center", fontsize=8,
            )  # fmt: skip
    ax.axhline(GOAL, color="tab:red", ls=":", label=f"goal {GOAL}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("serving / own offline tok/s\n(dots: rounds; bars: medians)")
    cpus = len(reports[0]["cpus"])
    ax.set_title(
        f"kvpilot serving against its own offline run, {cpus} CPUs: shared CPUs vs the API "
        "process on a CPU of its own (--api-cpus 1)",
        fontsize=10,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--placements", default="shared,api-cpus=1")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="bench/out/serve_vs_offline")
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="JSON",
        help="no run: plot these earlier runs' OUT.json in one figure, OUT.png",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.combine:
        reports = [json.loads(Path(path).read_text()) for path in args.combine]
        plot_combined(reports, Path(f"{args.out}.png"))
        print(f"wrote {args.out}.png")
        return 0
    if os.environ.get("OMP_NUM_THREADS"):
        print("unset OMP_NUM_THREADS: the placements choose the engine's threads", file=sys.stderr)
        return 2
    allowed, quota = os.sched_getaffinity(0), read_cpu_limit()
    placements = [parse_placement(n, allowed, quota) for n in args.placements.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records = run_rounds(args, placements, Path(f"{out}-logs"))
    summary = summarize(placements, records)
    print(format_summary(summary))
    title = (
        f"kvpilot serving vs its own offline, {args.dtype}, concurrency {args.concurrency}, "
        f"{args.num_prompts} requests x {args.output_len} tokens, {len(allowed)} CPUs"
    )
    report = {"args": vars(args), "cpus": sorted(allowed), "summary": summary, "runs": records}
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    plot(summary, records, Path(f"{out}.png"), title)
    print(f"wrote {out}.json, {out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
