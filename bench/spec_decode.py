"""Speculative decoding (n-gram, or a draft model) against plain decoding, side by side in one
process: inter-token
latency (decode time per output token after the first: (last token - first token) / (tokens - 1),
per request, a burst of accepted tokens counting as its tokens) on an input-grounded workload.

The workload: SmolLM2 chat prompts that each hold a paragraph and ask for it back, edited
(repeat it, replace a word, fix its tense, extract sentences). Greedy decoding, so both engines
produce the same tokens (checked: a mismatch fails the run) and the same token counts.

Each concurrency C runs C requests at once (max_num_seqs C) on two engines built alike but for
--speculative-config; rounds alternate the engines, so load on a shared VM falls on both. At
concurrency 64 the back-off (engine/spec_decode/policy.py: more running sequences than
disable_by_batch_size) keeps speculation off: the goal there is "never slower".

    .venv/bin/python bench/spec_decode.py --concurrency 1,8,64 --rounds 2 \
        --out bench/spec_decode.json

--method draft_model proposes with a draft model instead (--draft-model, default the bundled
SmolLM2 itself; --draft-layers N cuts it to its first N layers, engine/model/layer_cut.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.model.layer_cut import cut_layers
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.spec_decode.draft_model import BUILTIN_NAME, BUILTIN_SCHEME, draft_source

NGRAM_CONFIG = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}'
)
DRAFT_CONFIG = '{"method": "draft_model", "num_speculative_tokens": 4}'

PARAGRAPHS = [
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the reading room, the children's corner and the "
    "archive, but postponed the decision on the roof garden until the spring meeting.",
    "Our store opens at nine in the morning and closes at six in the evening from Monday to "
    "Friday. On Saturdays we open at ten and close at four. We are closed on Sundays and on "
    "public holidays, and orders placed online ship on the next working day.",
    "To reset the router, unplug it from the wall, wait thirty seconds, and plug it back in. "
    "When the front light turns green, open the settings page, sign in with the password on "
    "the label, and choose a new name and password for the wireless network.",
    "Maria planted tomatoes, beans and peppers in the small garden behind her house. Every "
    "evening she watered the plants, pulled the weeds and checked the leaves for insects, and "
    "by the end of the summer she had more vegetables than her family could eat.",
]
TASKS = [
    "Repeat this text exactly: {p}",
    "Copy the following paragraph word for word: {p}",
    "Rewrite this text, replacing every 'the' with 'a': {p}",
    "Repeat the text below, then repeat its first sentence again: {p}",
]


def chat_prompts(llm: LLM, tasks: list[str]) -> list[str]:
    """Each task as one user message, rendered with the model's chat template."""
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": task}], add_generation_prompt=True, tokenize=False
        )
        for task in tasks
    ]


def edit_tasks(num: int) -> list[tuple[str, str]]:
    """num (task, paragraph) pairs, cycling through the paragraphs and tasks."""
    return [
        (TASKS[i % len(TASKS)], PARAGRAPHS[(i // len(TASKS)) % len(PARAGRAPHS)]) for i in range(num)
    ]


def workload(llm: LLM, num: int) -> list[str]:
    """num chat prompts, cycling through the paragraphs and tasks."""
    return chat_prompts(llm, [task.format(p=p) for task, p in edit_tasks(num)])


def itl_s(out: RequestOutput) -> float | None:
    """A request's ITL: (last token - first token) / (tokens - 1); None under two tokens."""
    m, n = out.metrics, len(out.outputs[0].token_ids)
    if n < 2 or m.first_token_time is None or m.last_token_time is None:
        return None
    return (m.last_token_time - m.first_token_time) / (n - 1)


def request_itls(outs: list[RequestOutput]) -> list[float]:
    """The ITL of each request of two tokens or more."""
    return [itl for out in outs if (itl := itl_s(out)) is not None]


def with_prediction(params: SamplingParams, tokenizer: Any, text: str) -> SamplingParams:
    """params with `text` as the request's prediction (OpenAI's Predicted Outputs), tokenized as
    the server tokenizes one."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return dataclasses.replace(params, prediction_token_ids=tuple(ids))


def run_round(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[list[float], list]:
    """Per-request ITL (s) and the token ids, all prompts at once."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return request_itls(outs), [out.outputs[0].token_ids for out in outs]


def run_facts() -> dict[str, str]:
    """Where and when a report's figures were taken."""
    return {
        "machine": f"{platform.machine()} {platform.node()}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,64", help="comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--method", choices=("ngram", "draft_model"), default="ngram")
    parser.add_argument(
        "--speculative-config",
        default=None,
        help=f"default: {NGRAM_CONFIG} (ngram), {DRAFT_CONFIG} and the draft (draft_model)",
    )
    parser.add_argument("--draft-model", default=f"{BUILTIN_SCHEME}{BUILTIN_NAME}")
    parser.add_argument(
        "--draft-layers", type=int, default=None, help="cut the draft to its first N layers"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="each engine's KV budget (default the engine's; a draft's pool holds as many tokens)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = speculative_config(args, Path(tmp))
        run(args, spec)


def speculative_config(args: argparse.Namespace, tmp: Path) -> SpeculativeConfig:
    if args.speculative_config is not None:
        return SpeculativeConfig.from_json(args.speculative_config)
    if args.method == "ngram":
        return SpeculativeConfig.from_json(NGRAM_CONFIG)
    draft = args.draft_model
    if args.draft_layers is not None:
        draft = str(cut_layers(draft_source(draft).hf_dir, args.draft_layers, tmp / "draft"))
    fields = json.loads(DRAFT_CONFIG)
    return SpeculativeConfig(**fields, model=draft)


def run(args: argparse.Namespace, spec: SpeculativeConfig) -> None:
    method = spec.method
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results = []
    for conc in concurrencies:
        engines = {
            name: LLM(
                dtype=args.dtype,
                max_num_seqs=conc,
                **({} if args.kv_cache_gib is None else {"kv_cache_gib": args.kv_cache_gib}),
                speculative=spec if name == method else None,
            )
            for name in ("plain", method)
        }
        prompts = workload(engines["plain"], conc)
        for llm in engines.values():  # warm-up (and prefix-cache state alike for both)
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))
        itls: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list] = {}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                engines[name].engine.core.block_manager.reset_prefix_cache()
                round_itls, tokens[name] = run_round(engines[name], prompts, args.max_tokens)
                itls[name].extend(round_itls)
        if tokens["plain"] != tokens[method]:
            raise SystemExit(f"concurrency {conc}: greedy outputs differ with speculation")
        counters = engines[method].engine.core.speculation.counters
        plain_ms = statistics.mean(itls["plain"]) * 1000
        spec_ms = statistics.mean(itls[method]) * 1000
        row = {
            "concurrency": conc,
            "itl_ms_plain": round(plain_ms, 2),
            f"itl_ms_{method}": round(spec_ms, 2),
            "speedup": round(plain_ms / spec_ms, 2),
            "output_tokens_per_request": statistics.mean(len(t) for t in tokens["plain"]),
            "drafts": counters.num_drafts,
            "draft_tokens": counters.num_draft_tokens,
            "accepted_tokens": counters.num_accepted_tokens,
            "acceptance": round(counters.num_accepted_tokens / counters.num_draft_tokens, 3)
            if counters.num_draft_tokens
            else None,
        }
        print(json.dumps(row), flush=True)
        results.append(row)
        del engines
    draft = "" if method == "ngram" else f" --method {method} --draft-model {args.draft_model}"
    if method != "ngram" and args.draft_layers is not None:
        draft += f" --draft-layers {args.draft_layers}"
    if args.kv_cache_gib is not None:
        draft += f" --kv-cache-gib {args.kv_cache_gib}"
    report = {
        "command": "python bench/spec_decode.py "
        f"--concurrency {args.concurrency} --rounds {args.rounds} --max-tokens {args.max_tokens}"
        + draft,
        **run_facts(),
        "dtype": args.dtype,
        "speculative_config": args.speculative_config or repr(spec),
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
