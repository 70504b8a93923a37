"""LoRA adapters as the engine, the operator and the router agree on them: what an adapter may be
called, which layers it may target, the engine's limits and defaults, and the HTTP API through
which adapters are loaded and unloaded at run time (vLLM's, so that vLLM clients and the Gateway
API Inference Extension work unchanged).

An adapter is a PEFT directory: `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora) and `adapter_model.safetensors`. Its name is the `model` a request asks for, so names
share the base model's namespace: a name must not equal the served model's name, and two adapters
of one engine never share a name.

Runtime loading (POST LOAD_LORA_PATH / UNLOAD_LORA_PATH) is off unless the engine is started with
RUNTIME_LORA_FLAG or with RUNTIME_LORA_ENV=True (vLLM's switch). Answers, as vLLM gives them:
200 with a plain-text SUCCESS line; 400 for a bad body, a name already loaded, or adapter files
that are wrong (the message names what is wrong); 404 for an unload of an unknown name or a load
from a path with no adapter; 409 for an unload of an adapter requests are still using (the
operator retries: nothing is dropped).
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# A name becomes a `model` id, a Prometheus label value and a Kubernetes status key: letters,
# digits, '.', '_' and '-', starting and ending with a letter or digit, at most 63 characters.
NAME_MAX_LENGTH = 63
NAME_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
_NAME = re.compile(NAME_PATTERN)

# The projections an adapter may target (PEFT's module names for Llama-family models).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The engine's limits and their defaults (vLLM's: --max-loras 1, --max-lora-rank 16,
# --max-cpu-loras = --max-loras).
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
MAX_LORA_RANK_LIMIT = 512
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# The runtime-loading API.
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
RUNTIME_LORA_FLAG = "--allow-runtime-lora-updating"
# The metric the Gateway API Inference Extension reads: one sample of value 1 (the scrape time's
# wall clock in vLLM) whose labels list the adapters (comma-separated names).
LORA_INFO_METRIC = "vllm:lora_requests_info"
LORA_INFO_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


def load_success(name: str) -> str:
    return f"Success: LoRA adapter '{name}' added successfully."


def unload_success(name: str) -> str:
    return f"Success: LoRA adapter '{name}' removed successfully."


def name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (None: it can)."""
    if not _NAME.match(name):
        return (
            f"adapter name {name!r} must be 1-{NAME_MAX_LENGTH} letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    return None


def is_truthy(value: str | None) -> bool:
    """How vLLM reads RUNTIME_LORA_ENV: 'True', 'true' or '1'."""
    return value is not None and value.strip().lower() in ("true", "1")


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class LoadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    # Replace an adapter of the same name (new weights, same name) instead of refusing it.
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Field(min_length=1)]
    lora_int_id: int | None = None  # vLLM's; accepted and ignored: names are the identity


def parse_lora_module(value: str) -> tuple[str, str, str | None]:
    """One --lora-modules value, in either of vLLM's forms: `name=path`, or JSON
    `{"name": ..., "path": ..., "base_model_name": ...}`. Returns (name, path, base_model_name);
    ValueError says what is wrong."""
    import json

    text = value.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules JSON does not parse: {exc.msg}") from None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError('--lora-modules JSON needs "name" and "path" strings')
        name, path, base = item["name"], item.get("path"), item.get("base_model_name")
        if not isinstance(path, str) or not path:
            raise ValueError('--lora-modules JSON needs "name" and "path" strings')
        if base is not None and not isinstance(base, str):
            raise ValueError('--lora-modules "base_model_name" must be a string')
    else:
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise ValueError(f"--lora-modules takes name=path or JSON, got {value!r}")
        base = None
    problem = name_problem(name)
    if problem:
        raise ValueError(problem)
    return name, path, base
