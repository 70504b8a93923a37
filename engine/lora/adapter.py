"""A PEFT LoRA adapter read from its directory and checked against the base model: every weight
the engine will add, per layer and projection, in float32 on the host, with the adapter's scaling
already in B.

What PEFT writes for a Llama-family model: `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules, use_rslora, ...) and `adapter_model.safetensors` with
`base_model.model.model.layers.{i}.{self_attn,mlp}.{name}.lora_{A,B}.weight`: A [r, in], B [out, r].
Anything the engine cannot apply exactly (DoRA, bias training, modules_to_save, per-module ranks or
alphas, an embedding or lm_head target) is refused with the reason, never silently dropped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpilot.contract.lora import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILES, TARGET_MODULES
from kvpilot.engine.config import ModelConfig

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_WEIGHT_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)


class AdapterError(ValueError):
    """The adapter's files are wrong for this engine or model (an HTTP 400: the message names
    what is wrong)."""


class AdapterNotFound(AdapterError):
    """No adapter at the path (an HTTP 404, as vLLM answers it)."""


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: frozenset[str]

    @property
    def scaling(self) -> float:
        """PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class LoRAAdapter:
    """weights[(layer, module)] = (A [r, in], B [out, r] times the scaling), float32, full size
    (each tensor-parallel rank takes its slice when it fills a slot)."""

    name: str
    path: str
    config: AdapterConfig
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a target projection of the unsplit model."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    shapes = {
        "q_proj": (cfg.hidden_size, q),
        "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv),
        "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    return shapes[module]


def read_adapter_config(path: Path, max_rank: int) -> AdapterConfig:
    """The adapter's settings, refused (AdapterError) where the engine cannot apply them."""
    config_file = path / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        raise AdapterNotFound(f"No adapter found at {path}: no {ADAPTER_CONFIG_FILE}")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_file} does not parse as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{config_file} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {raw.get('peft_type')!r} is not LORA")
    _refuse_unsupported(raw)
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"adapter_config.json r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(
            f"the adapter's rank {rank} is above this engine's --max-lora-rank {max_rank}"
        )
    alpha = raw.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"adapter_config.json lora_alpha must be a number, got {alpha!r}")
    return AdapterConfig(
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_targets(raw.get("target_modules")),
    )


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    if raw.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if raw.get("bias", "none") != "none":
        raise AdapterError(f"adapters that train biases (bias={raw['bias']!r}) are not supported")
    if raw.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save {raw['modules_to_save']!r} is not supported: only LoRA weights"
        )
    if raw.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out adapters (Conv1D layers) are not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise AdapterError(f"per-module ranks or alphas ({key}) are not supported")
    if raw.get("layers_to_transform") is not None:
        raise AdapterError("layers_to_transform is not supported: target every layer")


def _targets(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        if value == "all-linear":
            return frozenset(TARGET_MODULES)
        # PEFT reads a string as a regex over full module names.
        pattern = re.compile(value)
        names = {
            m
            for m in TARGET_MODULES
            if pattern.fullmatch(f"model.layers.0.{_parent(m)}.{m}") or pattern.fullmatch(m)
        }
        if not names:
            raise AdapterError(f"target_modules {value!r} matches none of {list(TARGET_MODULES)}")
        return frozenset(names)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"target_modules must be a non-empty list of names, got {value!r}")
    unknown = sorted(set(value) - set(TARGET_MODULES))
    if unknown:
        raise AdapterError(
            f"target_modules {unknown} are not supported (supported: {list(TARGET_MODULES)})"
        )
    return frozenset(value)


def _parent(module: str) -> str:
    return "self_attn" if module in _ATTENTION else "mlp"


_HF_URI = re.compile(r"^(?:hf://)?([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@([\w./-]+))?$")


def adapter_directory(path: str) -> Path:
    """A local directory, or, as vLLM takes them, a Hugging Face repo (`org/name`, also written
    `hf://org/name[@revision]`) fetched into the hub's cache (only the adapter's files)."""
    local = Path(path).expanduser()
    if local.is_dir() or path.startswith(("/", ".", "~")):
        return local
    match = _HF_URI.match(path)
    if match is None:
        return local
    from huggingface_hub import snapshot_download

    try:
        fetched = snapshot_download(
            match[1],
            revision=match[2],
            allow_patterns=[ADAPTER_CONFIG_FILE, *ADAPTER_WEIGHTS_FILES],
        )
    except Exception as exc:  # offline, unknown repo, no access: the hub raises many kinds
        raise AdapterNotFound(f"No adapter found at {path}: {type(exc).__name__}") from None
    return Path(fetched)


def read_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` (adapter_directory's forms), checked against the model's shape."""
    directory = adapter_directory(str(path))
    if not directory.is_dir():
        raise AdapterNotFound(f"No adapter found at {path}")
    config = read_adapter_config(directory, max_rank)
    tensors = _read_tensors(directory)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT_KEY.match(key)
        if match is None:
            raise AdapterError(f"the adapter has a weight the engine cannot apply: {key}")
        layer, parent, module, which = int(match[1]), match[2], match[3], match[4]
        if module not in TARGET_MODULES or parent != _parent(module):
            raise AdapterError(f"the adapter has a weight the engine cannot apply: {key}")
        if layer >= cfg.num_hidden_layers:
            raise AdapterError(
                f"{key}: layer {layer}, but the model has {cfg.num_hidden_layers} layers"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module}: lora_A and lora_B must come in pairs")
        a, b = pair["A"].float(), pair["B"].float()
        fan_in, fan_out = module_shape(cfg, module)
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank) or rank != config.rank:
            raise AdapterError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do "
                f"not fit the model's ({fan_out} x {fan_in}) projection at rank {config.rank}"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"layer {layer} {module}: the weights hold NaN or infinity")
        weights[(layer, module)] = (a.contiguous(), (b * config.scaling).contiguous())
    if not weights:
        raise AdapterError(f"{directory}: the adapter has no LoRA weights")
    return LoRAAdapter(name, str(directory), config, weights)


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    for filename in ADAPTER_WEIGHTS_FILES:
        file = directory / filename
        if not file.is_file():
            continue
        try:
            if filename.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            loaded = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # safetensors and torch raise assorted errors on a damaged file
            raise AdapterError(f"{file} is not a readable weights file: {exc}") from None
        if not isinstance(loaded, dict):
            raise AdapterError(f"{file} does not hold a dictionary of tensors")
        return loaded
    raise AdapterNotFound(f"No adapter found at {directory}: none of {list(ADAPTER_WEIGHTS_FILES)}")
