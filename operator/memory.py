"""What a CPU engine pod needs in memory, where the operator can know it without the model's
files: the builtin models, whose shapes ship with the engine. The same arithmetic as the engine's
start-up check (engine/memory_fit.py, engine/core/engine_core.py cpu_memory_need; a test holds the
two equal), so a limit the operator admits is one the engine starts under.

hf://, pvc:// and file:// models are only known once downloaded or mounted: there the engine's
own check at start is the guard (a clear message in the pod's log and status, not an OOM kill).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.operator.modeluri import BuiltinModel
from kvpilot.operator.spec import InferenceServiceSpec


@dataclass(frozen=True)
class ModelShape:
    num_params: int
    kv_elements_per_token: int  # K and V over all layers
    hidden_size: int
    intermediate_size: int
    vocab_size: int


BUILTIN_SHAPES = {
    "smollm2-135m-instruct": ModelShape(
        num_params=134_515_008,
        kv_elements_per_token=11_520,
        hidden_size=576,
        intermediate_size=1536,
        vocab_size=49_152,
    ),
}
# Mirrors of the engine's defaults and its runtime allowance (engine/memory_fit.py).
RUNTIME_BYTES = 1280 * 2**20
DEFAULT_KV_CACHE_BYTES = 2**30
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128
ITEMSIZE = {"auto": 4, "float32": 4, "bfloat16": 2, "float16": 2}  # auto is float32 on CPU


def cpu_memory_need(spec: InferenceServiceSpec) -> int | None:
    """Bytes the engine pod needs at its peak; None where the model's shape is not known here
    or the engine runs on a GPU (weights and KV cache in GPU memory)."""
    source = spec.model.source
    if spec.gpus or not isinstance(source, BuiltinModel):
        return None
    shape = BUILTIN_SHAPES[source.name]
    engine = spec.engine
    itemsize = ITEMSIZE[engine.dtype or "auto"]
    kv = spec.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
    tokens = engine.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    seqs = engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    activations = (
        tokens * (4 * shape.hidden_size + 3 * shape.intermediate_size) * itemsize
        + 3 * seqs * shape.vocab_size * 4
    )
    return shape.num_params * itemsize + kv + RUNTIME_BYTES + activations


def limit_problem(spec: InferenceServiceSpec) -> str | None:
    """Why the memory limit cannot hold the engine (the engine would refuse to start)."""
    need, limit = cpu_memory_need(spec), spec.memory_limit
    if need is None or limit is None or need <= limit:
        return None
    return (
        f"resources.limits.memory ({limit / 2**30:.2f} GiB) is below what the engine needs "
        f"for this model and settings ({need / 2**30:.2f} GiB: weights, KV cache and working "
        "memory); raise the limit or lower engine.kvCacheBytes, maxNumSeqs or "
        "maxNumBatchedTokens"
    )


def request_shortfall(spec: InferenceServiceSpec) -> str | None:
    """Why the memory request is below the engine's need (the pod may be placed on a node that
    cannot hold it), or None."""
    need, request = cpu_memory_need(spec), spec.memory_request
    if need is None or request is None or request >= need:
        return None
    return (
        f"resources.requests.memory ({request / 2**30:.2f} GiB) is below what the engine needs "
        f"({need / 2**30:.2f} GiB): the scheduler may place it on a node without that much free "
        "memory"
    )
