"""The FastAPI app: routes, probes, /metrics, and OpenAI-shaped errors for everything that fails."""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse

from kvpilot.contract import errors
from kvpilot.contract.http_errors import ErrorObserver, install_error_handlers
from kvpilot.contract.kv_events import KV_EVENTS_PATH, TOKENIZER_FILE_PATH, TOKENIZER_FILES
from kvpilot.contract.openai import PATHS, ChatCompletionRequest, CompletionRequest
from kvpilot.engine.server.access_log import AccessLogMiddleware
from kvpilot.engine.server.kv_events import KvEventHub, encode_lines
from kvpilot.engine.server.lora_routes import adapter_cards, add_lora_routes
from kvpilot.engine.server.request_id import HEADER, RequestIdMiddleware, request_id_of
from kvpilot.engine.server.serving import create_chat_completion, create_completion
from kvpilot.engine.server.state import ServerState

logger = logging.getLogger("kvpilot.server")


def request_body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI requestBody of a route that reads its body itself (to bound and parse it off
    the event loop): the same pydantic model validates it, so app.openapi() describes the API
    that is served (the property-based tests generate requests from it)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {k: v for k, v in schema.items() if k != "$defs"}}
            },
        },
        "x-components": schema.get("$defs", {}),
    }


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """app.openapi() with the request models' nested schemas under components (FastAPI does not
    collect those of openapi_extra)."""
    document = dict(app.openapi())
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for path in document["paths"].values():
        for operation in path.values():
            components.update(operation.pop("x-components", {}))
    return document


def create_app(state: ServerState) -> FastAPI:
    """One app serves one model; `state` holds the engine, the settings and the drain flag."""
    app = FastAPI(title="kvpilot", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvpilot = state
    app.add_middleware(RequestIdMiddleware)
    if state.settings.access_log:
        app.add_middleware(AccessLogMiddleware)
    install_error_handlers(app, unexpected=unexpected_error, observe=error_observer(state))
    add_probe_routes(app, state)
    add_kv_event_routes(app, state)
    add_openai_routes(app, state, created=int(time.time()))
    return app


def error_observer(state: ServerState) -> ErrorObserver:
    """Counts invalid requests and logs server faults before they are answered."""

    def observe(request: Request, exc: errors.APIError) -> None:
        if exc.status_code == 400:
            state.reject("invalid_request", exc)
        if exc.status_code == 500:
            logger.error("request %s failed: %s", request_id_of(request), exc.message)

    return observe


def unexpected_error(request: Request, exc: Exception) -> errors.APIError:
    """A 500 naming the request: its handler runs outside every middleware (the request-id one
    too), so it sets the request-id header itself."""
    request_id = request_id_of(request)
    logger.exception("request %s: unhandled error", request_id)
    error = errors.internal_error(f"Internal server error (request {request_id}): {exc!r}")
    error.headers[HEADER] = request_id
    return error


def auth_check(state: ServerState) -> Callable[[Request], None]:
    """401 unless the request carries the server's API key (when it has one)."""

    def check_auth(request: Request) -> None:
        key = state.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise errors.unauthorized()

    return check_auth


def add_probe_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /ready and /metrics: unauthenticated, for kubelets and scrapers."""

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the process answers and its engine core has not died."""
        if state.engine.error is not None:
            return JSONResponse({"status": "engine_dead"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the model is loaded and servable, and the server is not draining."""
        if state.is_ready:
            return JSONResponse({"status": "ready"})
        reason = (
            "draining" if state.draining else "loading" if not state.engine.is_loaded else "dead"
        )
        return JSONResponse({"status": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        # Scraped often (every 50 ms by the Gateway API Inference Extension's endpoint picker):
        # the server's own metrics take the fast path.
        metrics, registry = state.engine.metrics, state.engine.registry
        if metrics is not None:
            body = metrics.exposition()
        else:
            body = generate_latest(registry) if registry is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)


def add_kv_event_routes(app: FastAPI, state: ServerState) -> None:
    """What a router needs to predict this server's prefix cache (kvpilot.contract.kv_events):
    the block-hash stream and the tokenizer's files."""
    check_auth = auth_check(state)

    def kv_event_hub() -> KvEventHub:
        hub = state.engine.kv_events
        if hub is None:
            raise errors.unavailable("The model is still loading.", code="loading")
        return hub

    @app.get(KV_EVENTS_PATH)
    async def kv_events(request: Request) -> Response:
        """The prefix cache's block hashes and the load, for routers."""
        check_auth(request)
        lines = encode_lines(kv_event_hub().subscribe())
        return StreamingResponse(lines, media_type="application/x-ndjson")

    @app.get(TOKENIZER_FILE_PATH)
    async def tokenizer_file(name: str, request: Request) -> Response:
        """The tokenizer's files, so a router tokenizes exactly as this server does."""
        check_auth(request)
        kv_event_hub()
        info = state.model_info()
        if name not in TOKENIZER_FILES or not (Path(info.hf_dir) / name).is_file():
            raise errors.APIError(404, f"No tokenizer file {name!r}.", type="not_found_error")
        return FileResponse(Path(info.hf_dir) / name)


def add_openai_routes(app: FastAPI, state: ServerState, *, created: int) -> None:
    """The OpenAI API: the model list and the two generation routes."""
    check_auth = auth_check(state)

    def model_card() -> dict[str, object]:
        info = state.model_info()
        return {
            "id": info.model_name,
            "object": "model",
            "created": created,
            "owned_by": "kvpilot",
            "root": info.model_name,
            "parent": None,
            "max_model_len": info.max_model_len,
        }

    def model_cards() -> list[dict[str, object]]:
        return [model_card(), *adapter_cards(state, created)]

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": model_cards()})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request) -> Response:
        check_auth(request)
        cards = model_cards()
        for card in cards:
            if card["id"] == model:
                return JSONResponse(card)
        raise errors.model_not_found(model, str(cards[0]["id"]))

    @app.post(PATHS["completion"], openapi_extra=request_body_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        check_auth(request)
        return await create_completion(state, request)

    @app.post(PATHS["chat"], openapi_extra=request_body_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        return await create_chat_completion(state, request)

    lora = state.engine.config.lora
    if lora is not None and lora.allow_runtime_updating:
        add_lora_routes(app, state, check_auth)
