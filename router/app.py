"""The router's ASGI app: the OpenAI routes every model shares (kvpilot.router.openai_routes),
probes, the model list and /metrics (FastAPI)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from kvpilot.contract import errors
from kvpilot.contract.http_errors import install_error_handlers
from kvpilot.engine.gc_freeze import freeze_startup_objects
from kvpilot.router.openai_routes import OpenAIRoutes, unexpected_error
from kvpilot.router.proxy import LISTED_MODELS_HINT
from kvpilot.router.runtime import RouterRuntime
from kvpilot.router.tenants import check_grant, is_route_granted, not_granted

log = logging.getLogger("kvpilot.router")

Lifespan = Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]


def create_app(runtime: RouterRuntime) -> OpenAIRoutes:
    app = FastAPI(
        title="kvpilot router",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        lifespan=lifespan(runtime),
    )
    app.state.runtime = runtime
    install_error_handlers(app, unexpected=lambda _, exc: unexpected_error(exc))
    add_probe_routes(app, runtime)
    add_index_route(app, runtime)
    add_model_routes(app, runtime, created=int(time.time()))
    # The OpenAI routes are served in front of it (kvpilot.router.openai_routes).
    return OpenAIRoutes(app, runtime.proxy, runtime.config.max_body_bytes)


def lifespan(runtime: RouterRuntime) -> Lifespan:
    """Starts the runtime (watches, streams) with the app and stops it on shutdown."""

    @contextlib.asynccontextmanager
    async def run(_: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        # What startup loaded (transformers, the app) lives until exit: out of the collector's
        # sight, full collections stop walking it on the routing loop (in the engine's API
        # process, which loads the same libraries, each one stalled the loop 100-150 ms).
        freeze_startup_objects("router")
        try:
            yield
        finally:
            await runtime.stop()

    return run


def add_probe_routes(app: FastAPI, runtime: RouterRuntime) -> None:
    """/health, /ready and /metrics."""

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Ready once the first listing of every watched namespace arrived."""
        if runtime.is_synced:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "syncing"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        runtime.registry.refresh_gauges()
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def add_index_route(app: FastAPI, runtime: RouterRuntime) -> None:
    @app.get("/kvpilot/v1/router/index")
    async def index() -> Response:
        """What this router knows of every replica (for operators and tests)."""
        now = time.monotonic()
        return JSONResponse(
            {
                model: {
                    name: {
                        "url": r.url,
                        "routable": r.is_routable(now, runtime.config.dead_after_s),
                        "seq": r.seq,
                        "num_blocks": len(r.index),
                        "digest": r.index.digest(),
                        "in_flight": r.in_flight,
                        "num_waiting": r.load.num_waiting,
                        "kv_cache_usage": r.load.kv_cache_usage,
                        "resident_loras": r.load.resident_loras,
                        "max_loras": r.load.max_loras,
                    }
                    for name, r in pool.replicas.items()
                }
                for model, pool in runtime.registry.pools.items()
            }
        )


def add_model_routes(app: FastAPI, runtime: RouterRuntime, *, created: int) -> None:
    """The models this router serves: one card per InferenceService and one per LoRA adapter
    (with `parent`, its base model, as vLLM lists adapters)."""

    def card(model: str) -> dict[str, Any]:
        route = runtime.registry.routes[model]
        pool, adapter = route.pool, route.adapter
        routable = pool.routable(time.monotonic(), runtime.config.dead_after_s)
        extra: dict[str, Any] = {
            "namespace": pool.service.namespace,
            "inferenceService": pool.service.name,
            "replicas": len(routable),
            # Until it is, requests are routed by load alone (`fallback`).
            "tokenizerLoaded": pool.tokenizer is not None,
        }
        if adapter is not None:
            # Those that serve it at once; the others load it into a slot first.
            extra["residentReplicas"] = sum(adapter.name in r.load.resident_loras for r in routable)
        return {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "kvpilot",
            "root": model if adapter is None else adapter.uri or adapter.name,
            "parent": None if adapter is None else pool.service.model,
            "kvpilot": extra,
        }

    def visible(request: Request, model: str) -> bool:
        """With tenants: whether the caller's tenant may use the model (401 without a key)."""
        tenant = runtime.proxy.authenticate(request.headers)
        if tenant is None:
            return True
        route = runtime.registry.routes[model]
        return is_route_granted(tenant, model, is_adapter=route.adapter is not None)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        runtime.proxy.authenticate(request.headers)
        models = [m for m in sorted(runtime.registry.routes) if visible(request, m)]
        return JSONResponse({"object": "list", "data": [card(m) for m in models]})

    @app.get("/v1/models/{model:path}")
    async def get_model(request: Request, model: str) -> Response:
        tenant = runtime.proxy.authenticate(request.headers)
        if tenant is not None:
            check_grant(tenant, model)  # 403 alike for a model that does not exist
        if model not in runtime.registry.routes:
            raise errors.model_does_not_exist(model, LISTED_MODELS_HINT)
        if not visible(request, model):
            raise not_granted(model)
        return JSONResponse(card(model))
