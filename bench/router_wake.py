"""A 0->1 wake through `kvpilot router`, timed from the first request to its first token, with the
router's decision separated from the model load.

The Kubernetes API is a minimal stand-in served by this script (list and watch of
InferenceServices and pods, merge-patch of an InferenceService), and this script plays the
operator and the kubelet: when the router's wake annotation arrives it starts `kvpilot serve`
(the model load), and when that is ready it announces a Ready engine pod on the pod watch.

Timeline: t0 the client sends a streaming chat request for the model at zero replicas; t1 the
router's PATCH (wake annotation) reaches the API (decision latency t1 - t0); t2 the engine is
ready (process start + model load t2 - t1); t3 the Ready pod is announced; t4 the first token
reaches the client (router pick-up: event stream, routing, prefill; the tokenizer loads
meanwhile in the background: t4 - t3).

    python bench/router_wake.py --rounds 3
    python bench/router_wake.py --rounds 3 --fresh-node --engine-threads 2

--fresh-node starts each woken engine as a new pod on a node that never saw the model would: a new
HOME and an empty KVPILOT_CACHE_DIR holding only the converted model (`kvpilot prepare` into a
shared volume) and the kernels the image ships (bench/serve_startup.py's "fresh node"); without it
the engine uses this user's cache. --engine-threads: the engine's OMP_NUM_THREADS (a pod's CPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, StreamingResponse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_chat import Proc, serve
from serve_startup import VARIANTS, Prepared, prepare, start_env

NAMESPACE = "bench"
MODEL = "bench"


class FakeApi:
    """Just what the router calls: list + watch of two resources, and the wake patch."""

    def __init__(self) -> None:
        self.isvc = {
            "apiVersion": "kvpilot.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": MODEL, "namespace": NAMESPACE, "resourceVersion": "1"},
            "spec": {"model": {"servedName": MODEL}, "autoscaling": {"minReplicas": 0}},
        }
        self.pods: list[dict[str, Any]] = []
        self.pod_watchers: list[asyncio.Queue[dict[str, Any]]] = []
        self.patched = asyncio.Event()
        self.patched_at = 0.0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/apis/kvpilot.dev/v1alpha1/namespaces/{ns}/inferenceservices")
        async def services(request: Request) -> Any:
            if request.query_params.get("watch"):
                return StreamingResponse(self._idle(), media_type="application/json")
            return {"items": [self.isvc], "metadata": {"resourceVersion": "1"}}

        @app.patch("/apis/kvpilot.dev/v1alpha1/namespaces/{ns}/inferenceservices/{name}")
        async def patch(name: str, request: Request) -> Any:
            if not self.patched.is_set():
                self.patched_at = time.perf_counter()
                self.patched.set()
            body = await request.json()
            self.isvc["metadata"].setdefault("annotations", {}).update(
                body["metadata"]["annotations"]
            )
            return JSONResponse(self.isvc)

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def pods(request: Request) -> Any:
            if request.query_params.get("watch"):
                queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
                self.pod_watchers.append(queue)
                return StreamingResponse(self._events(queue), media_type="application/json")
            return {"items": self.pods, "metadata": {"resourceVersion": "1"}}

        return app

    async def _idle(self) -> Any:
        while True:
            await asyncio.sleep(3600)
            yield b""

    async def _events(self, queue: asyncio.Queue[dict[str, Any]]) -> Any:
        while True:
            event = await queue.get()
            yield (json.dumps(event) + "\n").encode()

    def add_pod(self, port: int) -> None:
        pod = {
            "metadata": {
                "name": f"{MODEL}-0",
                "namespace": NAMESPACE,
                "labels": {
                    "app.kubernetes.io/name": "kvpilot-engine",
                    "app.kubernetes.io/instance": MODEL,
                },
            },
            "spec": {
                "containers": [
                    {"name": "engine", "ports": [{"name": "http", "containerPort": port}]}
                ]
            },
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
        self.pods.append(pod)
        for queue in self.pod_watchers:
            queue.put_nowait({"type": "ADDED", "object": pod})


async def one_wake(
    router_url: str, api: FakeApi, logs: Path, index: int, engine_env: dict[str, str]
) -> dict[str, float]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello, who are you?"}],
        "max_tokens": 4,
        "stream": True,
    }
    first_token = asyncio.get_running_loop().create_future()

    async def client() -> None:
        async with (
            httpx.AsyncClient(timeout=600) as http,
            http.stream("POST", f"{router_url}/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    first_token.set_result(time.perf_counter())
                    break

    t0 = time.perf_counter()
    request = asyncio.create_task(client())
    await asyncio.wait_for(api.patched.wait(), 60)
    t1 = api.patched_at
    engine = await asyncio.to_thread(serve, 48, logs / f"wake-{index}.log", engine_env)
    try:
        await asyncio.to_thread(engine.wait_ready)
        t2 = time.perf_counter()
        assert engine.port is not None
        api.add_pod(engine.port)
        t3 = time.perf_counter()
        t4 = await asyncio.wait_for(first_token, 120)
        await request
    finally:
        engine.stop()
    return {
        "decision_s": t1 - t0,
        "engine_start_and_load_s": t2 - t1,
        "router_pickup_to_first_token_s": t4 - t3,
        "first_request_to_first_token_s": t4 - t0,
    }


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    logs = args.out.with_suffix("").with_name(args.out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    prepared = prepare(Path(tempfile.mkdtemp(prefix="router-wake-"))) if args.fresh_node else None
    for index in range(args.rounds):
        api = FakeApi()
        server = uvicorn.Server(
            uvicorn.Config(api.app(), host="127.0.0.1", port=0, log_level="warning")
        )
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        kubeconfig = Path(tempfile.mkdtemp()) / "kubeconfig"
        kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        router = Proc(
            [sys.executable, "-m", "kvpilot.cli", "router", "--namespace", NAMESPACE,
             "--host", "127.0.0.1", "--port", "0"],
            logs / f"router-{index}.log",
            env={"KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
        try:
            await asyncio.to_thread(router.wait_ready)
            result = await one_wake(router.url, api, logs, index, engine_env(args, prepared, index))
            print(result, flush=True)
            results.append(result)
        finally:
            router.stop()
            server.should_exit = True
            await serving
    return results


def engine_env(args: argparse.Namespace, prepared: Prepared | None, index: int) -> dict[str, str]:
    """The woken engine's environment: a fresh node's caches (--fresh-node), its threads."""
    env = {} if prepared is None else start_env(VARIANTS["fresh node"], prepared, index)
    return env | {"OMP_NUM_THREADS": str(args.engine_threads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/router_wake.json"))
    parser.add_argument("--fresh-node", action="store_true", help="a new pod's caches per wake")
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="the engine's OMP_NUM_THREADS"
    )
    args = parser.parse_args()
    results = asyncio.run(run(args))
    summary = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print("median", summary)
    setup = {"fresh_node": args.fresh_node, "engine_threads": args.engine_threads}
    report = {"command": " ".join(sys.argv), "setup": setup, "loadavg_end": os.getloadavg()}
    report |= {"rounds": results, "median": summary}
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
