"""kvpilot's inference engine: paged KV cache, prefix caching, continuous batching.

The public names load lazily: importing the package costs nothing until one of them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CacheConfig": "kvpilot.engine.config",
    "EngineConfig": "kvpilot.engine.config",
    "ModelConfig": "kvpilot.engine.config",
    "SchedulerConfig": "kvpilot.engine.config",
    "LLM": "kvpilot.engine.llm",
    "engine_config": "kvpilot.engine.llm",
    "EngineStats": "kvpilot.engine.llm_engine",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "CompletionOutput": "kvpilot.engine.outputs",
    "Logprob": "kvpilot.engine.outputs",
    "RequestMetrics": "kvpilot.engine.outputs",
    "RequestOutput": "kvpilot.engine.outputs",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "StructuredSpec": "kvpilot.engine.structured.spec",
}

if TYPE_CHECKING:
    from kvpilot.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from kvpilot.engine.llm import LLM, engine_config
    from kvpilot.engine.llm_engine import EngineStats, LLMEngine
    from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.structured.spec import StructuredSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "LLM",
    "CacheConfig",
    "CompletionOutput",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
    "StructuredSpec",
    "engine_config",
]
