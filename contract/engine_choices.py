"""The values engine settings take, by name: `kvpilot serve`'s argument parser
(kvpilot.contract.engine_flags) is built from them, the engine's configs check against them, and
the operator parses spec.engine.extraArgs with that parser."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Backends by name; "auto" (a config value only) resolves to one of them for the device.
ATTENTION_BACKEND_NAMES = ("torch", "cpu", "triton")
ATTENTION_BACKENDS = ("auto", *ATTENTION_BACKEND_NAMES)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "llguidance")
BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV block the kernels handle
# The KV cache's element type (vLLM's names): "auto" stores the model's dtype; "fp8" is fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# The tool-call formats the server parses (kvpilot.engine.server.tools.parsers).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")
# How the scheduler orders waiting requests (vLLM's names): by arrival, or by the request's
# `priority` (lower first) and then arrival, preempting worse priorities for better ones.
SCHEDULING_POLICIES = ("fcfs", "priority")
