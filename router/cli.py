"""`kvpilot router`: the OpenAI-compatible front for every InferenceService in the watched
namespaces."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from kvpilot.contract.help_format import DefaultsOnceFormatter
from kvpilot.router.config import HoldConfig, RouterConfig, RoutingConfig, TenancyConfig


def build_parser() -> argparse.ArgumentParser:
    """`kvpilot router`'s options, each with its help text and default."""
    parser = argparse.ArgumentParser(
        prog="kvpilot router",
        description="Route OpenAI requests to InferenceServices by model name, prefix-cache "
        "aware, holding requests for models scaled to zero.",
        formatter_class=DefaultsOnceFormatter,
    )
    parser.add_argument(
        "--namespace",
        action="append",
        dest="namespaces",
        help="namespace to serve (repeatable; default: $KVPILOT_NAMESPACES, comma-separated)",
    )
    parser.add_argument(
        "--all-namespaces", action="store_true", help="serve the whole cluster's InferenceServices"
    )
    parser.add_argument(
        "--static",
        action="append",
        default=[],
        metavar="MODEL=URL[,URL...]",
        help="serve MODEL from these engine URLs, without Kubernetes (development, benchmarks; "
        "repeatable; default: none)",
    )
    parser.add_argument(
        "--static-adapters",
        action="append",
        default=[],
        metavar="MODEL=NAME[,NAME...]",
        help="the LoRA adapters the engines of static MODEL serve (requests name them in `model`; "
        "repeatable; default: none)",
    )
    parser.add_argument(
        "--static-shared-prefix",
        action="append",
        default=[],
        metavar="MODEL=FILE",
        help="a text (in FILE) whose KV the tenants of static MODEL share (repeatable; default: "
        "none)",
    )
    tenancy = parser.add_argument_group(
        "tenants", "API keys per team, grants, quotas, priority and fair sharing"
    )
    tenancy.add_argument(
        "--tenancy",
        action="store_true",
        help="require a tenant's key on every request (Tenants and their Secrets in the watched "
        "namespaces, or --tenants-file)",
    )
    tenancy.add_argument(
        "--tenants-file",
        help="Tenant and Secret manifests (YAML) instead of the Kubernetes API; re-read when it "
        "changes (implies --tenancy; default: none)",
    )
    tenancy.add_argument(
        "--quota-store-url",
        default=None,
        help="Redis URL of the quota counters all routers share, else $KVPILOT_QUOTA_STORE_URL; "
        "with neither (the default), this router counts alone",
    )
    tenancy.add_argument(
        "--replica-concurrency",
        type=int,
        default=None,
        help="requests of a class or better a replica takes from this router before the rest "
        "wait in its fair queue, for the classes below critical (critical: the engine's "
        "max_num_seqs; default: the engine's max_num_seqs, as it reports it)",
    )
    tenancy.add_argument(
        "--max-queued", type=int, default=TenancyConfig.max_queued_per_model,
        help="requests waiting per model in the fair queue; beyond, the worst class is shed",
    )  # fmt: skip
    tenancy.add_argument(
        "--queue-timeout", type=float, default=TenancyConfig.queue_timeout_s,
        help="seconds a request may wait in the fair queue",
    )  # fmt: skip
    tenancy.add_argument(
        "--guard-memory", type=float, default=TenancyConfig.guard_memory_s,
        help="seconds after a request of a priority class that a model's worse classes ask "
        "its engines to guard against that class (0: never)",
    )  # fmt: skip
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument(
        "--load-factor", type=float, default=RoutingConfig.load_factor,
        help="no replica takes a request that puts its in-flight count above this many times "
        "the mean (bounded load)",
    )  # fmt: skip
    parser.add_argument(
        "--hold-timeout", type=float, default=HoldConfig.timeout_s,
        help="seconds a request for a model with no ready replica (scaled to zero) is held",
    )  # fmt: skip
    parser.add_argument(
        "--max-held", type=int, default=HoldConfig.max_held_per_model,
        help="requests held per model; beyond, 503 with Retry-After",
    )  # fmt: skip
    parser.add_argument(
        "--retry-after", type=int, default=HoldConfig.retry_after_s,
        help="the Retry-After (seconds) of a 503 while a model has no ready replica",
    )  # fmt: skip
    parser.add_argument(
        "--dead-after", type=float, default=RouterConfig.dead_after_s,
        help="seconds a replica's event stream may be silent before it leaves the rotation",
    )  # fmt: skip
    parser.add_argument(
        "--engine-api-key-file",
        help="file holding the API key of engines whose InferenceService names no "
        "engine.apiKeySecret (--static backends; the others' keys are read from their Secrets; "
        "default: none)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"),
        help="log level",
    )  # fmt: skip
    return parser


def parse_args(argv: list[str]) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    namespaces = args.namespaces or [
        n for n in os.environ.get("KVPILOT_NAMESPACES", "").split(",") if n
    ]
    if args.all_namespaces:
        namespaces = [""]  # the API's paths without a namespace
    static = []
    for item in args.static:
        model, _, urls = item.partition("=")
        if not model or not urls:
            parser.error(f"--static {item!r}: expected MODEL=URL[,URL...]")
        static.append((model, tuple(u.rstrip("/") for u in urls.split(","))))
    static_adapters = []
    for item in args.static_adapters:
        model, _, names = item.partition("=")
        if not model or not names:
            parser.error(f"--static-adapters {item!r}: expected MODEL=NAME[,NAME...]")
        static_adapters.append((model, tuple(names.split(","))))
    shared_prefixes: dict[str, list[str]] = {}
    for item in args.static_shared_prefix:
        model, _, path = item.partition("=")
        if not model or not path:
            parser.error(f"--static-shared-prefix {item!r}: expected MODEL=FILE")
        with open(path) as f:
            shared_prefixes.setdefault(model, []).append(f.read())
    tenancy = None
    if args.tenancy or args.tenants_file:
        tenancy = TenancyConfig(
            quota_store_url=args.quota_store_url or os.environ.get("KVPILOT_QUOTA_STORE_URL"),
            tenants_file=args.tenants_file,
            replica_concurrency=args.replica_concurrency,
            max_queued_per_model=args.max_queued,
            queue_timeout_s=args.queue_timeout,
            guard_memory_s=args.guard_memory,
        )
    if not namespaces and not static:
        parser.error(
            "give --namespace (repeatable, or $KVPILOT_NAMESPACES), --all-namespaces or --static"
        )
    key = None
    if args.engine_api_key_file:
        with open(args.engine_api_key_file) as f:
            key = f.read().strip()
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return RouterConfig(
        namespaces=tuple(namespaces),
        host=args.host,
        port=args.port,
        routing=RoutingConfig(load_factor=args.load_factor),
        hold=HoldConfig(
            max_held_per_model=args.max_held,
            timeout_s=args.hold_timeout,
            retry_after_s=args.retry_after,
        ),
        dead_after_s=args.dead_after,
        engine_api_key=key,
        router_name=os.environ.get("POD_NAME", "kvpilot-router"),
        static_models=tuple(static),
        static_adapters=tuple(static_adapters),
        static_shared_prefixes=tuple((m, tuple(t)) for m, t in shared_prefixes.items()),
        tenancy=tenancy,
    )


def main(argv: list[str]) -> int:
    try:
        config = parse_args(argv)
    except ValueError as exc:
        print(f"kvpilot router: {exc}", file=sys.stderr)
        return 2
    from kvpilot.router.app import create_app
    from kvpilot.router.kube import kube_access
    from kvpilot.router.runtime import RouterRuntime

    runtime = RouterRuntime(config, None if config.static_models else kube_access())
    uvicorn.run(
        create_app(runtime),
        host=config.host,
        port=config.port,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        log_level=logging.getLevelName(logging.getLogger().level).lower(),
        # A line per request costs more than the router's own routing work: debug only, as the
        # engine does.
        access_log=logging.getLogger().level <= logging.DEBUG,
        timeout_graceful_shutdown=30,
    )
    return 0
