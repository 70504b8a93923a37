"""The model, ready on its device: built from its config with the attention backend's layer ops,
its weights loaded (or dummy), and on a CPU its linear layers packed for the fastest kernel this
build has."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.attention import get_attention_backend
from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.model.cpu_linear import pack_linears, packing_available
from kvpilot.engine.model.layer_ops import LayerOps
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.loader import (
    ResolvedModel,
    build_model,
    init_dummy_weights,
    load_model_from_files,
    model_size_gib,
)
from kvpilot.engine.parallel.group import TPGroup

log = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    backend_name: str  # the attention backend's
    bytes_loaded: int  # of weight files read (0 for dummy weights)


def layer_ops_for(backend: str) -> LayerOps:
    if backend == "cpu":
        from kvpilot.engine.cpu.layer_ops import cpu_layer_ops

        return cpu_layer_ops()
    if backend != "triton":
        return LayerOps()
    from kvpilot.engine.kernels import get_layer_ops

    return get_layer_ops(backend)


def load_model(
    config: EngineConfig,
    model_config: ModelConfig,
    source: ResolvedModel,
    max_model_len: int,
    device: torch.device,
    tp: TPGroup | None,
) -> LoadedModel:
    """tp: this process's rank when the model is split (None: the whole model)."""
    dtype = config.resolved_dtype
    backend = get_attention_backend(config.resolved_attention_backend)
    ops = layer_ops_for(backend.name)
    if config.lora is not None:
        from kvpilot.engine.lora.ops import add_lora

        ops = dataclasses.replace(ops, add_lora=add_lora)
    if source.load_format == "dummy":
        model = build_model(model_config, backend, max_model_len, device, dtype, ops, tp)
        init_dummy_weights(model, config.seed)
        bytes_loaded = 0
    else:
        model, bytes_loaded = load_model_from_files(
            model_config, backend, max_model_len, device, dtype, source.hf_dir, ops, tp
        )
    log.info(
        "model weights: %.2f GiB in %s on %s%s",
        model_size_gib(model),
        dtype,
        device,
        "" if tp is None else f" (tensor-parallel rank {tp.rank} of {tp.size})",
    )
    # After the size is logged: packed weights are buffers, not parameters.
    if device.type == "cpu":
        pack_cpu_linears(model, backend.name, dtype, batch_hint=config.scheduler.max_num_seqs)
    return LoadedModel(model, backend.name, bytes_loaded)


def pack_cpu_linears(
    model: LlamaForCausalLM, backend_name: str, dtype: torch.dtype, *, batch_hint: int
) -> None:
    """The 'cpu' backend's own linear kernel where the library has it for this dtype (faster
    than oneDNN at every batch size measured, bench/RESULTS.md), else oneDNN's packed
    linear; the other backends keep oneDNN's, or nn.Linear where this torch lacks it."""
    if backend_name == "cpu":
        from kvpilot.engine.cpu.build import load_library
        from kvpilot.engine.cpu.linear import use_kernel_linears

        kernel = use_kernel_linears(model, load_library(), dtype, batch_hint)
        if kernel:
            log.info("%d %s linear layers on kvpilot's CPU kernel", kernel, dtype)
            return
    if packing_available(dtype):
        packed = pack_linears(model, batch_hint=batch_hint)
        log.info("packed %d %s linear layers for oneDNN", packed, dtype)
