"""LoRA adapters over HTTP, as vLLM serves them: adapters in the model list (each with its `parent`,
the base model), and, when runtime updating is on, POST LOAD_LORA_PATH and UNLOAD_LORA_PATH
(contract/lora.py has the bodies and the answers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import PlainTextResponse, Response

from kvpilot.contract import errors
from kvpilot.contract.lora import (
    LOAD_LORA_PATH,
    UNLOAD_LORA_PATH,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_success,
    name_problem,
    unload_success,
)
from kvpilot.contract.openai import validation_error
from kvpilot.engine.server.state import ServerState

BodyT = TypeVar("BodyT", bound=BaseModel)
# The largest load/unload body read: a name and a path.
MAX_BODY_BYTES = 64 * 1024


def adapter_cards(state: ServerState, created: int) -> list[dict[str, object]]:
    """The adapters' entries of /v1/models, by name."""
    info = state.model_info()
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "kvpilot",
            "root": path,
            "parent": info.model_name,
            "max_model_len": info.max_model_len,
        }
        for name, path in sorted(state.engine.adapters.items())
    ]


def add_lora_routes(
    app: FastAPI, state: ServerState, check_auth: Callable[[Request], None]
) -> None:
    """The load and unload routes (only called when runtime updating is on: otherwise, as in
    vLLM, the paths do not exist)."""

    @app.post(LOAD_LORA_PATH)
    async def load_lora_adapter(request: Request) -> Response:
        check_auth(request)
        state.model_info()  # 503 while loading or draining
        body = await _read(state, request, LoadLoRAAdapterRequest)
        problem = name_problem(body.lora_name)
        if problem:
            raise errors.bad_request(problem, param="lora_name")
        info = state.model_info()
        if body.lora_name == info.model_name:
            raise errors.bad_request(
                f"The lora adapter name '{body.lora_name}' is the base model's name.",
                param="lora_name",
            )
        if body.lora_name in state.engine.adapters and not body.load_inplace:
            raise errors.bad_request(
                f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name"
            )
        reply = await state.engine.load_lora(
            body.lora_name, body.lora_path, replace=body.load_inplace
        )
        _raise_for(reply.status, reply.message)
        return PlainTextResponse(load_success(body.lora_name))

    @app.post(UNLOAD_LORA_PATH)
    async def unload_lora_adapter(request: Request) -> Response:
        check_auth(request)
        state.model_info()
        body = await _read(state, request, UnloadLoRAAdapterRequest)
        reply = await state.engine.unload_lora(body.lora_name)
        _raise_for(reply.status, reply.message)
        return PlainTextResponse(unload_success(body.lora_name))


async def _read(state: ServerState, request: Request, model: type[BodyT]) -> BodyT:
    raw = await state.read_body(request)
    if len(raw) > MAX_BODY_BYTES:
        raise errors.too_large(len(raw), MAX_BODY_BYTES)
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise errors.bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise errors.bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def _raise_for(status: int, message: str) -> None:
    if status == 200:
        return
    kind = {404: "not_found_error", 409: "conflict_error"}.get(status, "invalid_request_error")
    raise errors.APIError(status, message, type=kind)
