"""Offline throughput on CPU: kvpilot vs transformers generate, same requests, same maximum batch.

Workload (fixed seed): N chat requests whose user message is 1-12 filler sentences (prompt lengths
vary from ~60 to ~220 tokens with the chat template) and whose output length is uniform in
[min_out, max_out], forced with ignore_eos (transformers: min_new_tokens) so every system produces
exactly the tokens asked for. Only requested tokens count as output; the extra tokens static
batching generates for the shorter requests of a batch are waste, as in serving.

Both systems are warmed up first on other requests of the same shapes; then kvpilot and static
batching alternate for --repeats rounds and the median round of each is reported (with every
round's ratio), since the shared VM drifts by ~10% between runs.

Systems, in one run:
- kvpilot: all requests submitted at once, continuous batching with max_num_seqs = --max-batch.
- transformers static batching: batches of --max-batch in request order, left-padded, each batch
  run to its longest request.
- transformers one at a time: --single-subset requests alone (a subset: it is slow), tokens/s
  compared.

    python bench/offline_throughput.py --num-requests 64 --max-batch 32

With --baseline-src DIR (a directory holding another build's `kvpilot` package, e.g.
`mkdir -p DIR/kvpilot && git archive <commit> engine operator router cli | tar -x -C DIR/kvpilot`),
that build's engine runs too, in a worker of its own, in every round beside this one: the ratio of
the two and whether their greedy outputs are the same token for token.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch
from tqdm import tqdm

FILLER = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Kubernetes schedules pods onto nodes that have enough free resources.",
    "A paged KV cache stores attention keys and values in fixed-size blocks.",
    "The museum opens at nine and the guided tours start every hour.",
    "Continuous batching lets new requests join while others are still decoding.",
    "Our team measured latency at the fiftieth and ninety-ninth percentiles.",
    "Rain is expected in the afternoon, so bring an umbrella to the park.",
    "Prefix caching reuses the blocks of a shared system prompt across requests.",
]


@dataclass(frozen=True)
class Request:
    messages: list[dict[str, str]]
    max_tokens: int


@dataclass
class Result:
    system: str
    num_requests: int
    output_tokens: int
    seconds: float
    outputs_digest: str | None = None  # of every request's output token ids (kvpilot's runs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def make_requests(
    n: int, min_out: int, max_out: int, seed: int, first_index: int = 0
) -> list[Request]:
    """first_index numbers the requests; warm-up requests use their own numbers, so that their
    cached prompt blocks never serve a measured request."""
    rng = random.Random(seed)
    requests = []
    for i in range(first_index, first_index + n):
        sentences = " ".join(rng.choice(FILLER) for _ in range(rng.randint(1, 12)))
        content = f"Request {i}. Read this and write a long, detailed reply: {sentences}"
        requests.append(
            Request([{"role": "user", "content": content}], rng.randint(min_out, max_out))
        )
    return requests


def prompt_ids(tokenizer: object, requests: list[Request]) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(r.messages, add_generation_prompt=True, tokenize=False)
        for r in requests
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def run_kvpilot(llm: object, ids: list[list[int]], requests: list[Request]) -> Result:
    from kvpilot.engine import SamplingParams

    params = [
        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outputs = llm.generate(ids, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(r.max_tokens for r in requests), "kvpilot did not produce every token"
    digest = hashlib.sha256(repr([o.outputs[0].token_ids for o in outputs]).encode()).hexdigest()
    return Result("kvpilot (continuous batching)", len(requests), produced, seconds, digest)


@torch.inference_mode()
def run_hf_static(
    model: object, pad: int, ids: list[list[int]], requests: list[Request], batch: int
) -> Result:
    useful = 0
    start = time.perf_counter()
    for lo in tqdm(range(0, len(ids), batch), desc="transformers static", unit="batch"):
        chunk, reqs = ids[lo : lo + batch], requests[lo : lo + batch]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        longest = max(r.max_tokens for r in reqs)
        out = model.generate(
            input_ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,
            do_sample=False,
            pad_token_id=pad,
        )
        assert out.shape[1] - width == longest
        useful += sum(r.max_tokens for r in reqs)
    return Result("transformers static batching", len(ids), useful, time.perf_counter() - start)


@torch.inference_mode()
def run_hf_single(model: object, pad: int, ids: list[list[int]], requests: list[Request]) -> Result:
    produced = 0
    start = time.perf_counter()
    for p, r in tqdm(list(zip(ids, requests, strict=True)), desc="transformers single", unit="req"):
        out = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=r.max_tokens,
            min_new_tokens=r.max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        produced += out.shape[1] - len(p)
    return Result("transformers one at a time", len(ids), produced, time.perf_counter() - start)


def median_result(results: list[Result]) -> Result:
    """The round with the median throughput (the lower middle one for an even count)."""
    ordered = sorted(results, key=lambda r: r.tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def system_worker(system: str, args: argparse.Namespace, conn: Connection) -> None:
    """One system in its own process, so neither inherits the other's allocator, thread-pool or
    oneDNN kernel-cache state: loads its model once, then runs what the parent sends."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if system == "kvpilot-base":
        sys.path.insert(0, args.baseline_src)  # before any kvpilot import
    if system.startswith("kvpilot"):
        from kvpilot.engine import LLM

        llm = LLM(
            dtype=args.dtype,
            attention_backend=args.attention_backend,
            max_num_seqs=args.max_batch,
            max_num_batched_tokens=2048,
        )
        tok = llm.tokenizer
    else:
        from transformers import AutoModelForCausalLM

        from kvpilot.engine.model.loader import bundled_gguf_path

        gguf = bundled_gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=getattr(torch, args.dtype)
        ).eval()
    conn.send("ready")
    while True:
        command, *payload = conn.recv()
        if command == "stop":
            return
        if command == "prompt_ids":  # and the pad id, for transformers' left padding
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            conn.send((prompt_ids(tok, payload[0]), pad))
        elif command == "kvpilot":
            # Every run starts as cold as the first: no prompt block cached by an earlier one.
            assert llm.reset_prefix_cache()
            conn.send(run_kvpilot(llm, *payload))
        elif command == "source":
            import kvpilot.engine

            conn.send(kvpilot.engine.__file__)
        elif command == "static":
            conn.send(run_hf_static(hf, *payload, args.max_batch))
        elif command == "single":
            conn.send(run_hf_single(hf, *payload))


class Worker:
    def __init__(self, system: str, args: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=system_worker, args=(system, args, child), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"the {system} worker did not start")

    def __call__(self, command: str, *payload: object) -> object:
        self.conn.send((command, *payload))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(("stop",))
        self.process.join(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--min-out", type=int, default=64)
    ap.add_argument("--max-out", type=int, default=128)
    ap.add_argument("--single-subset", type=int, default=8)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="interleaved rounds of kvpilot and static batching; medians are reported",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="one dtype for both systems",
    )
    ap.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "cpu"],
        help="kvpilot's attention backend (auto: the C kernels on CPU)",
    )
    ap.add_argument(
        "--baseline-src",
        default=None,
        help="a directory holding another build's kvpilot package, run beside this one",
    )
    ap.add_argument("--out", default="bench/out/offline_throughput.json")
    ap.add_argument(
        "--plot", default=None, help="PNG of the three throughputs (default: next to --out)"
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Only one worker computes at a time; the other waits on its pipe.
    kvpilot = Worker("kvpilot", args)
    baseline = Worker("kvpilot-base", args) if args.baseline_src else None
    if baseline is not None:
        print(f"this build: {kvpilot('source')}; baseline: {baseline('source')}")
    transformers = Worker("transformers", args)
    requests = make_requests(args.num_requests, args.min_out, args.max_out, args.seed)
    ids, pad = kvpilot("prompt_ids", requests)
    lens = sorted(len(p) for p in ids)
    print(
        f"{len(ids)} requests; prompt tokens min/median/max {lens[0]}/{lens[len(lens) // 2]}/"
        f"{lens[-1]}; output tokens {sum(r.max_tokens for r in requests)}; torch threads "
        f"{torch.get_num_threads()}; dtype {args.dtype}; each system in its own process"
    )
    # Warm-up, the same for both systems and outside the timings: the workload's shapes on other
    # requests (own numbers: no prompt block of theirs can serve a measured request), 8 tokens
    # each, so oneDNN's per-shape kernels and the allocators are warm, as in a running server.
    warm = make_requests(args.num_requests, 8, 8, args.seed + 1, first_index=10_000)
    warm_ids, _ = kvpilot("prompt_ids", warm)
    kvpilot("kvpilot", warm_ids, warm)
    if baseline is not None:
        baseline("kvpilot", warm_ids, warm)
    transformers("static", pad, warm_ids[: args.max_batch], warm[: args.max_batch])
    transformers("single", pad, warm_ids[:1], warm[:1])

    # Interleaved rounds, so that both systems see the same drift of a shared machine.
    rounds: list[tuple[Result, Result]] = []
    baseline_rounds: list[Result] = []
    for round_index in range(args.repeats):
        print(f"round {round_index + 1} of {args.repeats}")
        ours_round = kvpilot("kvpilot", ids, requests)
        if baseline is not None:
            baseline_rounds.append(
                replace(baseline("kvpilot", ids, requests), system="kvpilot baseline build")
            )
        rounds.append((ours_round, transformers("static", pad, ids, requests)))
    single = transformers("single", pad, ids[: args.single_subset], requests[: args.single_subset])
    for worker in (kvpilot, baseline, transformers):
        if worker is not None:
            worker.stop()
    results = [
        median_result([r[0] for r in rounds]),
        *([median_result(baseline_rounds)] if baseline_rounds else []),
        median_result([r[1] for r in rounds]),
        single,
    ]
    ours = results[0].tokens_per_s
    print(f"\n{'round':>5} {'kvpilot tok/s':>14} {'static tok/s':>13} {'ratio':>6}", end="")
    print(f" {'baseline tok/s':>15} {'ours/baseline':>13}" if baseline_rounds else "")
    for i, (k, st) in enumerate(rounds, 1):
        ratio = k.tokens_per_s / st.tokens_per_s
        print(f"{i:5d} {k.tokens_per_s:14.1f} {st.tokens_per_s:13.1f} {ratio:6.2f}", end="")
        if baseline_rounds:
            b = baseline_rounds[i - 1]
            print(f" {b.tokens_per_s:15.1f} {k.tokens_per_s / b.tokens_per_s:13.3f}", end="")
        print()
    if baseline_rounds:
        same = {r.outputs_digest for r, _ in rounds} == {b.outputs_digest for b in baseline_rounds}
        print(f"greedy outputs of this build and the baseline identical: {same}")
    print(
        f"\n{'system (median of rounds)':34} {'requests':>8} {'out tokens':>10} {'seconds':>8} "
        f"{'tok/s':>8} {'ours/x':>7}"
    )
    for r in results:
        print(
            f"{r.system:34} {r.num_requests:8d} {r.output_tokens:10d} {r.seconds:8.1f} "
            f"{r.tokens_per_s:8.1f} {ours / r.tokens_per_s:7.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "args": vars(args),
                "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
                "rounds": [
                    {"kvpilot_tokens_per_s": k.tokens_per_s, "static_tokens_per_s": st.tokens_per_s}
                    | (
                        {"baseline_tokens_per_s": baseline_rounds[i].tokens_per_s}
                        if baseline_rounds
                        else {}
                    )
                    for i, (k, st) in enumerate(rounds)
                ],
            },
            indent=2,
        )
    )
    plot = Path(args.plot or Path(args.out).with_suffix(f".{args.dtype}.png"))
    plot_results(results, args, plot)
    print(f"wrote {args.out} and {plot}")


def plot_results(results: list[Result], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours = results[0].tokens_per_s
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r.system for r in results]
    rates = [r.tokens_per_s for r in results]
    colors = ["#2b6cb0", *["#bbbbbb", "#999999", "#777777"][: len(results) - 1]]
    bars = ax.barh(names[::-1], rates[::-1], color=colors[::-1])
    for bar, rate in zip(bars, rates[::-1], strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {rate:.1f} tok/s ({ours / rate:.2f}x)" if rate != ours else f" {rate:.1f} tok/s",
            va="center",
        )
    ax.set_xlabel("output tokens/s (higher is better)")
    ax.set_xlim(0, max(rates) * 1.45)
    ax.set_title(
        f"SmolLM2-135M offline, {args.num_requests} requests, max batch {args.max_batch}, "
        f"{args.dtype}, {torch.get_num_threads()} CPU threads",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
