"""The offline workers of bench/lora_throughput.py: kvpilot's `LLM` or vLLM's `LLM`, with or
without LoRA adapters, each in a process of its own and run with its own interpreter (vLLM's venv
must never mix with kvpilot's: /work/shared/notes/vllm-cpu-peer.md).

    python bench/peer_lora.py --worker kvpilot|vllm CONFIG_JSON

CONFIG_JSON: dtype, block_size, max_num_seqs, max_num_batched_tokens, and `lora` (null: an engine
without adapters, the base model alone; else max_loras, max_lora_rank, max_cpu_loras and
`adapters`, a list of [name, path]); vLLM also `model` (kvpilot's dequantized HF directory, the
same float32 weights) and `served_model_name`. The worker answers one JSON line on its original
stdout per JSON command line on stdin (common/offline_workers.py's OfflineWorker drives it):
`describe`, `tokenize`, `run` (timed: token ids in, ignore_eos, greedy) and `greedy` (outputs
compared between the systems), each request with its adapter's name or null for the base model.

Only the standard library at module level: this file runs in both venvs; kvpilot, vLLM and torch
are imported inside the functions that need them.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any


def digest(outputs: list[list[int]]) -> str:
    """One hash of every request's output token ids, in request order."""
    return hashlib.sha256(repr(outputs).encode()).hexdigest()


class KvpilotWorker:
    def __init__(self, config: dict[str, Any]) -> None:
        from kvpilot.engine import LLM
        from kvpilot.engine.config import LoRAConfig

        lora = config["lora"]
        self.llm = LLM(
            dtype=config["dtype"],
            block_size=config["block_size"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            lora=None
            if lora is None
            else LoRAConfig(
                max_loras=lora["max_loras"],
                max_lora_rank=lora["max_lora_rank"],
                max_cpu_loras=lora["max_cpu_loras"],
                modules=tuple((name, path) for name, path in lora["adapters"]),
            ),
        )

    def describe(self) -> dict[str, Any]:
        import torch

        import kvpilot.engine

        return {
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "kvpilot": os.path.dirname(kvpilot.engine.__file__),
        }

    def tokenize(self, prompts: list[list[dict[str, str]]]) -> list[list[int]]:
        """Chat messages to token ids as `kvpilot serve` makes them: the chat template, then
        `encode` without special tokens."""
        tok = self.llm.tokenizer
        texts = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts
        ]
        return [list(tok.encode(t, add_special_tokens=False)) for t in texts]

    def _generate(
        self, prompts: list[list[int]], max_tokens: list[int], adapters: list[str | None], eos: bool
    ) -> list[list[int]]:
        from kvpilot.engine import SamplingParams

        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not eos) for n in max_tokens
        ]
        outputs = self.llm.generate(prompts, params, lora_name=adapters, use_tqdm=True)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def run(
        self, prompts: list[list[int]], max_tokens: list[int], adapters: list[str | None]
    ) -> dict[str, Any]:
        # Every run starts as cold as the first: no prompt block cached by an earlier one.
        assert self.llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = self._generate(prompts, max_tokens, adapters, eos=False)
        return result(outputs, max_tokens, time.perf_counter() - start)

    def greedy(
        self, prompts: list[list[int]], max_tokens: list[int], adapters: list[str | None]
    ) -> list[list[int]]:
        return self._generate(prompts, max_tokens, adapters, eos=True)


class VllmWorker:
    def __init__(self, config: dict[str, Any]) -> None:
        from vllm import LLM

        lora = config["lora"]
        extra: dict[str, Any] = {}
        if lora is not None:
            extra = {
                "enable_lora": True,
                "max_loras": lora["max_loras"],
                "max_lora_rank": lora["max_lora_rank"],
                "max_cpu_loras": lora["max_cpu_loras"],
            }
            # vLLM's adapter ids are ints from 1 (0 means none); the order of `adapters` is kept.
            self.ids = {name: (i + 1, path) for i, (name, path) in enumerate(lora["adapters"])}
        self.llm = LLM(
            model=config["model"],
            served_model_name=config["served_model_name"],
            dtype=config["dtype"],
            block_size=config["block_size"],
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            enable_prefix_caching=True,
            seed=0,
            **extra,
        )

    def describe(self) -> dict[str, Any]:
        import torch
        import vllm

        return {"vllm": vllm.__version__, "torch": torch.__version__}

    def _generate(
        self, prompts: list[list[int]], max_tokens: list[int], adapters: list[str | None], eos: bool
    ) -> list[list[int]]:
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=not eos) for n in max_tokens
        ]
        requests = [
            None if name is None else LoRARequest(name, self.ids[name][0], self.ids[name][1])
            for name in adapters
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            params,
            lora_request=requests if any(requests) else None,
            use_tqdm=True,
        )
        return [list(o.outputs[0].token_ids) for o in outputs]

    def run(
        self, prompts: list[list[int]], max_tokens: list[int], adapters: list[str | None]
    ) -> dict[str, Any]:
        self.llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = self._generate(prompts, max_tokens, adapters, eos=False)
        return result(outputs, max_tokens, time.perf_counter() - start)

    def greedy(
        self, prompts: list[list[int]], max_tokens: list[int], adapters: list[str | None]
    ) -> list[list[int]]:
        return self._generate(prompts, max_tokens, adapters, eos=True)


def result(outputs: list[list[int]], max_tokens: list[int], seconds: float) -> dict[str, Any]:
    produced = sum(len(o) for o in outputs)
    if produced != sum(max_tokens):  # ignore_eos: every case must produce the same tokens
        raise RuntimeError(f"produced {produced} tokens, {sum(max_tokens)} asked for")
    return {"output_tokens": produced, "seconds": seconds, "digest": digest(outputs)}


def worker_main(system: str, config: dict[str, Any]) -> None:
    # The protocol of peer_offline.py (beside this file: on the path of a script run from here).
    from peer_offline import serve_worker

    serve_worker(lambda: KvpilotWorker(config) if system == "kvpilot" else VllmWorker(config))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3 or argv[0] != "--worker" or argv[1] not in ("kvpilot", "vllm"):
        print(__doc__, file=sys.stderr)
        print("the benchmark itself: python bench/lora_throughput.py --help", file=sys.stderr)
        return 2
    worker_main(argv[1], json.loads(argv[2]))
    return 0


if __name__ == "__main__":  # vLLM spawns processes that re-import this file: keep the guard
    sys.exit(main())
