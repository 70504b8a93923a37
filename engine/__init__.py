"""kvpilot's inference engine: paged KV cache, prefix caching, continuous batching."""

from __future__ import annotations

from kvpilot.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvpilot.engine.llm import LLM, engine_config
from kvpilot.engine.llm_engine import EngineStats, LLMEngine
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.sampling_params import SamplingParams

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
    "engine_config",
]
