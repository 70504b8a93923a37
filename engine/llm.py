"""The offline API in the style vLLM users know: LLM(model=...).generate(prompts,
SamplingParams)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from kvpilot.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.outputs import OutputKind, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

# Every field of the nested configs, so a new one is a keyword argument too.
_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}


def engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """An EngineConfig from flat keyword arguments (block_size=..., max_num_seqs=..., dtype=...)."""
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}
    scheduler = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHEDULER_FIELDS}
    return EngineConfig(
        model=model, cache=CacheConfig(**cache), scheduler=SchedulerConfig(**scheduler), **kwargs
    )


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Seq[str] | Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        lora_name: str | Seq[str | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in input order. lora_name: the adapter of
        every prompt, or of each (None: the base model)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(all_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(all_params)} SamplingParams")
        adapters = (
            [lora_name] * len(prompts)
            if lora_name is None or isinstance(lora_name, str)
            else list(lora_name)
        )
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(adapters)} lora names")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, adapter in zip(
                ids, prompts, all_params, adapters, strict=True
            ):
                self.engine.add_request(
                    request_id,
                    prompt,
                    p,
                    cache_salt=cache_salt,
                    lora_name=adapter,
                    kind=OutputKind.FINAL_ONLY,
                )
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def chat(
        self,
        conversations: Seq[list[dict[str, str]]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=False)
            for c in conversations
        ]
        return self.generate(prompts, params, **kwargs)

    def reset_prefix_cache(self) -> bool:
        """See LLMEngine.reset_prefix_cache."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes (tensor_parallel_size > 1), if any."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
