"""FP8 KV cache accuracy on SmolLM2 (builtin://): perplexity of a fixed text, teacher-forced in
prefill chunks of 128 tokens, through a full-precision pool and through FP8 pools (e4m3 with
per-head and with per-tensor calibrated scales, e5m2 per-head), all on the same loaded model.

The text: ARCHITECTURE.md and README.md at commit 16c1047 (fixed, whatever the tree holds now).

    .venv/bin/python bench/fp8_kv_accuracy.py [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from kvpilot.engine import LLM
from kvpilot.engine.kv_cache.kv_scales import calibrate_scales
from kvpilot.engine.kv_cache.pool import Fp8KVPool, PagedKVPool
from kvpilot.engine.perplexity import perplexity, text_logprobs

TEXT_COMMIT = "16c1047"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    text = "\n\n".join(
        subprocess.run(
            ["git", "show", f"{TEXT_COMMIT}:{name}"], capture_output=True, text=True, check=True
        ).stdout
        for name in ("ARCHITECTURE.md", "README.md")
    )
    llm = LLM(block_size=16, num_blocks=8)
    runner = llm.engine.runner
    model, layout, device = runner.model, runner.kv_pool.layout, runner.device
    ids = llm.tokenizer.encode(text)[: args.tokens]
    blocks = -(-len(ids) // 16)
    pools = {"full (float32)": lambda: PagedKVPool(layout, blocks, torch.float32, device)}
    for name, fp8, per_head in (
        ("fp8_e4m3 per-head", torch.float8_e4m3fn, True),
        ("fp8_e4m3 per-tensor", torch.float8_e4m3fn, False),
        ("fp8_e5m2 per-head", torch.float8_e5m2, True),
    ):
        pools[name] = lambda fp8=fp8, per_head=per_head: Fp8KVPool(
            layout, blocks, fp8, device,
            calibrate_scales(model, fp8, torch.float32, device, 16, per_head=per_head),
        )  # fmt: skip
    results = {}
    full_lp = None
    for name, make in pools.items():
        start = time.perf_counter()
        lp = text_logprobs(model, make(), ids, 128)
        full_lp = lp if full_lp is None else full_lp
        results[name] = {
            "ppl": perplexity(lp),
            "mean_abs_dlogprob": float((lp - full_lp).abs().mean()),
            "seconds": time.perf_counter() - start,
        }
        row = results[name]
        rel = (row["ppl"] / results["full (float32)"]["ppl"] - 1) * 100
        print(
            f"{name:22s} ppl {row['ppl']:.4f} ({rel:+.2f}%)"
            f"  mean |d logprob| {row['mean_abs_dlogprob']:.4f}",
            flush=True,
        )
    print(json.dumps({"tokens": len(ids), "results": results}))
    llm.shutdown()


if __name__ == "__main__":
    main()
