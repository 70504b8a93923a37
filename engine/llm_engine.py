"""The step-level engine in one process: add_request / step / abort_request.

Glue between the tokenizer, the engine core (which steps on token ids) and the output processor
(which turns tokens into text and RequestOutputs). `kvpilot serve` runs the same two halves in two
processes instead (server/async_engine.py); this is the offline path `LLM` uses.

Not thread-safe: one thread owns an engine.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.core.engine_core import EngineCore
from kvpilot.engine.core.messages import AddRequest, EngineStats
from kvpilot.engine.model.loader import eos_token_ids, has_tokenizer, load_tokenizer
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import OutputKind, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

log = logging.getLogger("kvpilot")

__all__ = ["EngineStats", "LLMEngine", "eos_token_ids"]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.core = EngineCore(config)
        described = self.core.description
        self.model_name = described.model_name
        hf_dir = Path(described.hf_dir)
        self.tokenizer = load_tokenizer(hf_dir) if has_tokenizer(hf_dir) else None
        if self.tokenizer is None:
            log.warning("no tokenizer files in %s: prompts must be token ids", described.hf_dir)
        self.eos_token_ids = eos_token_ids(described.eos_token_ids, self.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)

    # The core's parts, for tools and tests that look inside.
    @property
    def model_config(self) -> Any:
        return self.core.model_config

    @property
    def runner(self) -> Any:
        return self.core.runner

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    @property
    def block_manager(self) -> Any:
        return self.core.block_manager

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.core.num_blocks

    @property
    def block_size(self) -> int:
        return self.core.block_size

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kind: OutputKind = OutputKind.CUMULATIVE,
        lora_name: str | None = None,
        priority: int = 0,
        shared_prefix_tokens: int = 0,
        guard_priority: int | None = None,
    ) -> None:
        """kind: what step() returns for this request (outputs.py's OutputKind); priority,
        shared_prefix_tokens and guard_priority: as the core's AddRequest."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            prompt_text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            prompt_text, prompt_ids = None, list(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(
            AddRequest(
                request_id,
                prompt_ids,
                params,
                self.eos_token_ids,
                cache_salt,
                arrival,
                lora_name=lora_name,
                priority=priority,
                shared_prefix_tokens=shared_prefix_tokens,
                guard_priority=guard_priority,
            )
        )
        self.processor.add_request(request_id, prompt_text, prompt_ids, params, arrival, kind=kind)

    def abort_request(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.processor.abort(request_id)

    def reset_prefix_cache(self) -> bool:
        """See EngineCore.reset_prefix_cache."""
        return self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests()

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Raises ValueError for a request the core refused (it is dropped first)."""
        outputs = self.core.step()
        for request_id, why in outputs.rejected:
            self.processor.abort(request_id)
            raise ValueError(f"request {request_id} refused: {why}")
        processed = self.processor.process(outputs)
        for request_id, index in processed.stop_hits:
            self.core.abort(request_id, index)
        return processed.outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stops the tensor-parallel worker processes, if any (they also die with this one)."""
        self.core.shutdown()
