"""The values engine settings take, by name. Torch-free: `kvpilot serve`'s argument parser is
built from them, and the operator parses spec.engine.extraArgs with that parser without loading
torch."""

from __future__ import annotations

DTYPE_NAMES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
# Backends by name; "auto" (a config value only) resolves to one of them for the device.
ATTENTION_BACKEND_NAMES = ("torch", "cpu", "triton")
ATTENTION_BACKENDS = ("auto", *ATTENTION_BACKEND_NAMES)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "llguidance")
BLOCK_SIZES = (8, 16, 32, 64, 128)  # tokens per KV block the kernels handle
