"""OpenAI's Predicted Outputs on n-gram speculation: inter-token latency of greedy requests
without speculation, with n-gram speculation, and with it and a prediction, side by side in one
process (ITL as bench/spec_decode.py measures it: (last token - first token) / (tokens - 1)).

Two workloads of SmolLM2 chat prompts:
  edit        a paragraph and an edit to make (bench/spec_decode.py's prompts); the prediction is
              the paragraph, as an editor sends the file being edited. The prompt holds the text
              too, so the sequence's own lookup finds it as well: what the prediction adds is
              where in it the output stands.
  regenerate  a request whose prompt holds no text to copy ("write about ..."); the prediction is
              the answer an earlier run of the same request gave (a client regenerating, a
              cached draft): the case a prompt lookup cannot serve.
Greedy decoding: the three give the same tokens (checked: a mismatch fails the run). Each
concurrency C runs max(C, 4) requests, C at a time (max_num_seqs C); rounds alternate the order.

    .venv/bin/python bench/predicted_outputs.py --concurrency 1,8 --rounds 2 \
        --out bench/predicted_outputs.json --plot bench/predicted_outputs.png
    .venv/bin/python bench/predicted_outputs.py --replot bench/predicted_outputs.json \
        --plot bench/predicted_outputs.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

from spec_decode import (
    NGRAM_CONFIG,
    chat_prompts,
    edit_tasks,
    request_itls,
    run_facts,
    with_prediction,
)

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import SpeculativeConfig

TOPICS = ["a lighthouse keeper", "a city at night", "an old bicycle", "the first snow of winter"]
REGENERATE = "Write three sentences about {t}."
VARIANTS = ("plain", "ngram", "ngram + prediction")
# Prompts per workload at least: at concurrency 1 they run one after another (max_num_seqs 1).
MIN_PROMPTS = 4


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    tasks: list[str]  # the user messages
    predictions: list[str] | None  # the text of each prediction (None: the plain answers)


def workloads(num: int) -> list[Workload]:
    edits = edit_tasks(num)
    return [
        Workload("edit", [task.format(p=p) for task, p in edits], [p for _, p in edits]),
        Workload(
            "regenerate", [REGENERATE.format(t=TOPICS[i % len(TOPICS)]) for i in range(num)], None
        ),
    ]


def measure(
    engines: dict[str, LLM], workload: Workload, rounds: int, max_tokens: int
) -> dict[str, object]:
    plain_params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    prompts = chat_prompts(engines["plain"], workload.tasks)
    answers = engines["plain"].generate(prompts, plain_params)  # also the warm-up
    texts = workload.predictions or [out.outputs[0].text for out in answers]
    predicted = [with_prediction(plain_params, engines["plain"].tokenizer, t) for t in texts]
    engines["ngram"].generate(prompts[:1], plain_params)  # warm-up
    params = {"plain": plain_params, "ngram": plain_params, "ngram + prediction": predicted}
    engine_of = {"plain": "plain", "ngram": "ngram", "ngram + prediction": "ngram"}
    got: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, list[list[int]]] = {}
    accepted = dict.fromkeys(VARIANTS, 0)
    drafted = dict.fromkeys(VARIANTS, 0)
    for r in range(rounds):
        for variant in VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS)):
            llm = engines[engine_of[variant]]
            llm.engine.core.block_manager.reset_prefix_cache()
            speculation = llm.engine.core.speculation
            before = (0, 0) if speculation is None else (
                speculation.counters.num_accepted_tokens, speculation.counters.num_draft_tokens
            )  # fmt: skip
            outs = llm.generate(prompts, params[variant])
            if speculation is not None:
                accepted[variant] += speculation.counters.num_accepted_tokens - before[0]
                drafted[variant] += speculation.counters.num_draft_tokens - before[1]
            got[variant].extend(request_itls(outs))
            tokens[variant] = [list(out.outputs[0].token_ids) for out in outs]
    if not tokens["plain"] == tokens["ngram"] == tokens["ngram + prediction"]:
        raise SystemExit(f"{workload.name}: greedy outputs differ between the variants")
    ms = {v: statistics.mean(got[v]) * 1000 for v in VARIANTS}
    return {
        "workload": workload.name,
        **{f"itl_ms {v}": round(ms[v], 2) for v in VARIANTS},
        "speedup ngram": round(ms["plain"] / ms["ngram"], 2),
        "speedup ngram + prediction": round(ms["plain"] / ms["ngram + prediction"], 2),
        "prediction / ngram": round(ms["ngram"] / ms["ngram + prediction"], 2),
        "output_tokens_per_request": statistics.mean(len(t) for t in tokens["plain"]),
        **{
            f"acceptance {v}": round(accepted[v] / drafted[v], 3) if drafted[v] else None
            for v in VARIANTS[1:]
        },
        **{f"accepted tokens {v}": accepted[v] for v in VARIANTS[1:]},
    }


def plot(results: list[dict[str, object]], path: Path) -> None:
    """Mean ITL per variant, one group of bars per workload and concurrency."""
    from common.plotting import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(VARIANTS)
    labels = [f"{row['workload']}\nc={row['concurrency']}" for row in results]
    for i, variant in enumerate(VARIANTS):
        values = [float(row[f"itl_ms {variant}"]) for row in results]  # type: ignore[arg-type]
        xs = [x + (i - 1) * width for x in range(len(results))]
        bars = ax.bar(xs, values, width, label=variant)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(results)), labels)
    ax.set_ylabel("mean ITL per request (ms), lower is better")
    ax.set_title("OpenAI's prediction on n-gram speculation (SmolLM2-135M, CPU, greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    parser.add_argument("--plot", type=Path, default=None, help="draw the ITLs here (png)")
    parser.add_argument("--replot", type=Path, help="no run: the plot of an --out file")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text())["results"], args.plot or Path("itl.png"))
        return
    spec = SpeculativeConfig.from_json(NGRAM_CONFIG)
    results = []
    for conc in (int(c) for c in args.concurrency.split(",")):
        engines = {
            name: LLM(dtype=args.dtype, max_num_seqs=conc, speculative=speculative)
            for name, speculative in (("plain", None), ("ngram", spec))
        }
        for workload in workloads(max(conc, MIN_PROMPTS)):
            row = {"concurrency": conc, **measure(engines, workload, args.rounds, args.max_tokens)}
            print(json.dumps(row), flush=True)
            results.append(row)
        del engines
    report = {
        "command": f"python bench/predicted_outputs.py --concurrency {args.concurrency} "
        f"--rounds {args.rounds} --max-tokens {args.max_tokens}",
        **run_facts(),
        "dtype": args.dtype,
        "speculative_config": NGRAM_CONFIG,
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
