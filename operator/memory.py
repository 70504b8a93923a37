"""What a CPU engine pod needs in memory, where the operator can know it without the model's
files: the builtin models, whose shapes ship with the engine. The arithmetic and the defaults are
the engine's own (contract/sizing.py, contract/engine_defaults.py), so a limit the operator admits
is one the engine starts under.

hf://, pvc:// and file:// models are only known once downloaded or mounted: there the engine's
own check at start is the guard (a clear message in the pod's log and status, not an OOM kill).
The same holds for a speculative draft model (`--speculative-config` in extraArgs): a builtin
draft's weights and KV pool are counted here, another one's only by the engine.
"""

from __future__ import annotations

from kvpilot.contract import sizing
from kvpilot.contract.engine_defaults import (
    AUTO_DTYPE,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DTYPE_ITEMSIZE,
)
from kvpilot.contract.engine_flags import read_flags
from kvpilot.engine.server.from_flags import engine_config
from kvpilot.operator.builtin_models import BUILTIN_MODELS, ModelShape
from kvpilot.operator.modeluri import BuiltinModel, parse_model_uri
from kvpilot.operator.spec import InferenceServiceSpec


def cpu_memory_need(spec: InferenceServiceSpec) -> int | None:
    """Bytes the engine pod needs at its peak; None where the model's shape is not known here
    or the engine runs on a GPU (weights and KV cache in GPU memory)."""
    source = spec.model.source
    if spec.gpus or not isinstance(source, BuiltinModel):
        return None
    shape = BUILTIN_MODELS[source.name]
    engine = spec.engine
    dtype = engine.dtype or "auto"
    itemsize = DTYPE_ITEMSIZE[AUTO_DTYPE["cpu"] if dtype == "auto" else dtype]
    need = sizing.cpu_memory_need(
        num_params=shape.num_params,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        itemsize=itemsize,
        kv_cache_bytes=spec.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
        max_num_batched_tokens=engine.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=engine.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
    )
    draft = _draft_bytes(spec, shape, itemsize)
    if draft is None:
        return None
    return need.total + _adapter_bytes(spec, itemsize) + draft


def _draft_bytes(spec: InferenceServiceSpec, target: ModelShape, itemsize: int) -> int | None:
    """What a draft model in extraArgs' --speculative-config holds (the engine's rule,
    contract/sizing.py): 0 without one (or with n-gram speculation), None where its shape is
    not known here."""
    flags = engine_config(read_flags(spec.engine.extra_args))
    speculative = flags.speculative
    if speculative is None or speculative.method != "draft_model":
        return 0
    assert speculative.model is not None
    try:
        source = parse_model_uri(speculative.model)
    except ValueError:  # a path in the pod, as the engine takes it
        return None
    if not isinstance(source, BuiltinModel):
        return None
    draft = BUILTIN_MODELS[source.name]
    engine = spec.engine
    block_size = engine.block_size or flags.cache.block_size
    kv_itemsize = 1 if (engine.kv_cache_dtype or "auto") != "auto" else itemsize
    target_tokens = sizing.kv_cache_tokens(
        kv_cache_bytes=spec.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES,
        kv_bytes_per_token=sizing.kv_bytes_per_token(
            num_layers=target.num_layers,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            itemsize=kv_itemsize,
        ),
        block_size=block_size,
    )
    max_model_len = engine.max_model_len or target.max_position_embeddings
    return sizing.draft_model_bytes(
        num_params=draft.num_params,
        num_layers=draft.num_layers,
        num_kv_heads=draft.num_kv_heads,
        head_dim=draft.head_dim,
        itemsize=itemsize,
        kv_tokens=sizing.draft_kv_tokens(
            target_kv_tokens=target_tokens,
            max_seq_len=min(max_model_len, target_tokens),
            max_speculating_seqs=speculative.disable_by_batch_size,
            block_size=block_size,
        ),
    )


def _adapter_bytes(spec: InferenceServiceSpec, itemsize: int) -> int:
    """What LoRA's limits reserve (the engine counts it at start): by the limits, not by the
    adapters listed, which come and go at run time."""
    source = spec.model.source
    if not spec.is_lora_enabled or not isinstance(source, BuiltinModel):
        return 0
    shape, limits = BUILTIN_MODELS[source.name], spec.lora_limits
    return sizing.lora_bytes(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        q_size=shape.num_heads * shape.head_dim,
        kv_size=shape.num_kv_heads * shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_rank=limits.max_lora_rank,
        max_loras=limits.max_loras,
        max_cpu_loras=limits.effective_max_cpu_loras,
        itemsize=itemsize,
    )


def limit_problem(spec: InferenceServiceSpec) -> str | None:
    """Why the memory limit cannot hold the engine (the engine would refuse to start)."""
    need, limit = cpu_memory_need(spec), spec.memory_limit
    if need is None or limit is None or need <= limit:
        return None
    parts, knobs = "weights, KV cache and working memory", "maxNumSeqs or maxNumBatchedTokens"
    if spec.is_lora_enabled:
        parts = "weights, KV cache, LoRA adapters and working memory"
        knobs = "maxNumSeqs, maxNumBatchedTokens or engine.lora's limits"
    return (
        f"resources.limits.memory ({limit / 2**30:.2f} GiB) is below what the engine needs "
        f"for this model and settings ({need / 2**30:.2f} GiB: {parts}); raise the limit or "
        f"lower engine.kvCacheBytes, {knobs}"
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
