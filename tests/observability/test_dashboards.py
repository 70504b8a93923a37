"""Dashboards and alerts read only metrics that exist: every metric name in every panel of the
chart's Grafana dashboard, in vLLM's own dashboard and in the chart's PrometheusRule is found in a
live scrape of a real `kvpilot serve` (bundled SmolLM2, small KV cache), of the operator's
/metrics served by its own HTTP server after a real autoscaler tick against that engine, or of a
real `kvpilot router` in front of that engine (first held until the engine's address answers,
and of a model whose replica is down)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.autoscaling import AutoscalingPolicy, MetricsScraper, autoscale_tick
from kvpilot.operator.autoscaling.metrics import OperatorMetrics
from kvpilot.operator.cli import serving_metrics
from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.kube import KubeError
from kvpilot.operator.reconcile import Reconciler

from ..operator.autoscaling_helpers import pod_dict
from ..operator.chart import CHART, of_kind, render
from ..operator.conftest import free_port, free_ports
from ..operator.test_autoscaler import MemoryApi, isvc
from ..server.serve_process import ServeProcess, launch_serve
from .promql import metric_names

HERE = Path(__file__).parent
DASHBOARD = CHART / "files" / "dashboards" / "kvpilot.json"
VLLM_EXPRS = json.loads((HERE / "vllm_grafana_exprs.json").read_text())["exprs"]
MONITORING = {
    "monitoring": {
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
    }
}
SERVE_ARGS = ("--max-model-len", "512", "--kv-cache-gib", "0.05", "--max-num-seqs", "4")
pytestmark = pytest.mark.slow


def sample_names(text: str) -> set[str]:
    """Names of the samples an exposition holds (`x_bucket`, `x_total` ...), not just families."""
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def panel_exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found


@contextlib.contextmanager
def launch_router(*static: str, extra: tuple[str, ...] = ()) -> Iterator[ServeProcess]:
    """`kvpilot router --static ...` (no Kubernetes API: the replicas are given)."""
    cmd = [sys.executable, "-m", "kvpilot.cli", "router", "--host", "127.0.0.1", "--port", "0"]
    # Room for the held request to find its replica once it answers, on a CPU shared with
    # another test; the request for the replica that stays down waits this long for its 503.
    cmd += ["--hold-timeout", "5", *(arg for item in static for arg in ("--static", item))]
    cmd += extra
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    router = ServeProcess(proc)
    threading.Thread(target=router.read_log, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while router.port is None or not _ready(router.url):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(router.log)
            time.sleep(0.1)
        yield router
    finally:
        proc.kill()
        proc.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def forwarding(listen_port: int, target_port: int) -> Iterator[None]:
    """A TCP forwarder 127.0.0.1:listen_port -> 127.0.0.1:target_port: an engine's address that
    answers only from now on (as a pod that just became Ready)."""
    server = socket.create_server(("127.0.0.1", listen_port))

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", target_port))
            for pair in ((client, upstream), (upstream, client)):
                threading.Thread(target=pipe, args=pair, daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield
    finally:
        server.close()


def load_router(router_url: str, model: str, opening: contextlib.ExitStack, opens: Any) -> None:
    """Requests that give the router's series samples: one held until its replica's address
    answers (`opens`), then routed (twice: a prefix hit), and one for a model whose only replica
    is down (held, then 503 at the hold timeout)."""
    with httpx.Client(base_url=router_url, timeout=120) as http:
        chat = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(http.post, "/v1/chat/completions", json=chat)
            time.sleep(0.5)
            assert not first.done()  # held: no routable replica yet
            opening.enter_context(opens())
            assert first.result().status_code == 200
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        held = http.post("/v1/chat/completions", json={**chat, "model": "asleep"})
        assert held.status_code == 503, held.text


TENANTS = """
kind: Tenant
metadata: {name: team-a, namespace: teams}
spec: {apiKeys: [{name: team-a-keys}], models: ["*"], quota: {tokensPerMinute: 100000}}
---
kind: Secret
metadata: {name: team-a-keys, namespace: teams}
stringData: {key: sk-team-a}
"""


def load_tenant_router(router_url: str, model: str) -> None:
    """A tenant's request (served: its tokens, its queue time) and a stranger's (401)."""
    with httpx.Client(base_url=router_url, timeout=120) as http:
        chat = {"model": model, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        served = http.post(
            "/v1/chat/completions", json=chat, headers={"Authorization": "Bearer sk-team-a"}
        )
        assert served.status_code == 200, served.text
        assert http.post("/v1/chat/completions", json=chat).status_code == 401


def load_engine(serve_url: str) -> None:
    """Requests that give every engine histogram a sample: n=2 choices, a stream, a 400."""
    with httpx.Client(base_url=serve_url, timeout=120) as http:
        (model,) = http.get("/v1/models").json()["data"]
        chat = {
            "model": model["id"],
            "messages": [{"role": "user", "content": "Name a color."}],
            "max_tokens": 6,
            "n": 2,
        }
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
        stream = {"model": chat["model"], "prompt": "Once upon a time", "max_tokens": 6}
        with http.stream("POST", "/v1/completions", json={**stream, "stream": True}) as response:
            assert response.status_code == 200
            response.read()
        assert http.post("/v1/completions", json={**stream, "max_tokens": -1}).status_code == 400


async def tick_against(engine_port: int, metrics: OperatorMetrics) -> None:
    """One real autoscaler tick: a Ready pod on the live engine, another nobody answers for."""
    policy = AutoscalingPolicy(min_replicas=2, max_replicas=4)  # 1 replica: scales up to 2
    pods = [
        pod_dict("chat-0", "127.0.0.1", created=time.time() - 60),
        pod_dict("chat-1", "127.0.0.2", created=time.time() - 60),  # the engine is on .1 only
    ]
    scraper = MetricsScraper(timeout_s=5)
    try:
        body = isvc()
        result = await autoscale_tick(
            body,
            policy,
            pods,
            1,
            now=time.time(),
            scrape=scraper,
            metrics=metrics,
            metrics_port=engine_port,
        )
    finally:
        await scraper.aclose()
    assert result.replicas == 2
    assert result.status_patch["autoscaling"]["metrics"]["reportingPods"] == 1


def reconcile_into(metrics: OperatorMetrics) -> None:
    """A reconcile of an invalid spec (Degraded) and one that meets an API error."""
    broken = isvc(2, panicWindowSeconds=30)
    api = MemoryApi(broken, None)
    reconciler = Reconciler(api, OperatorConfig(), lambda *_: None, metrics=metrics)  # type: ignore[arg-type]
    assert reconciler.reconcile(broken).invalid is not None
    api.fail_on = "get_inferenceservice"
    with contextlib.suppress(KubeError):
        reconciler.reconcile(broken)


@pytest.fixture(scope="module")
def scrapes() -> Iterator[dict[str, set[str]]]:
    with launch_serve(*SERVE_ARGS) as serve:
        load_engine(serve.url)
        engine_text = httpx.get(f"{serve.url}/metrics", timeout=30).text
        model = httpx.get(f"{serve.url}/v1/models", timeout=30).json()["data"][0]["id"]
        assert serve.port is not None
        dead_port, late = free_ports(2)
        dead = f"http://127.0.0.1:{dead_port}"
        with (
            contextlib.ExitStack() as opening,
            launch_router(f"{model}=http://127.0.0.1:{late}", f"asleep={dead}") as router,
        ):
            load_router(router.url, model, opening, lambda: forwarding(late, serve.port))
            router_text = httpx.get(f"{router.url}/metrics", timeout=30).text
        tenants = Path(tempfile.mkdtemp(prefix="kvpilot-tenants-")) / "tenants.yaml"
        tenants.write_text(TENANTS)
        with launch_router(f"{model}={serve.url}", extra=("--tenants-file", str(tenants))) as tr:
            load_tenant_router(tr.url, model)
            router_text += httpx.get(f"{tr.url}/metrics", timeout=30).text
        metrics = OperatorMetrics(CollectorRegistry())
        asyncio.run(tick_against(serve.port, metrics))
    reconcile_into(metrics)
    port = free_port()
    with serving_metrics(port, metrics.registry):
        operator_text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    yield {
        "engine": sample_names(engine_text),
        "operator": sample_names(operator_text),
        "router": sample_names(router_text),
    }


def test_the_live_scrapes_hold_what_the_requests_and_the_tick_produced(
    scrapes: dict[str, set[str]],
) -> None:
    assert "vllm:request_prompt_tokens_bucket" in scrapes["engine"]
    assert "kvpilot:iteration_tokens_total_count" in scrapes["engine"]
    assert "kvpilot_operator_scrape_errors_total" in scrapes["operator"]  # the silent pod
    assert "kvpilot_operator_degraded" in scrapes["operator"]
    assert "kvpilot_router_prefix_match_tokens_bucket" in scrapes["router"]
    assert "kvpilot_router_hold_rejections_total" in scrapes["router"]  # the model asleep


def test_every_panel_of_the_charts_dashboard_reads_exported_metrics(
    scrapes: dict[str, set[str]],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = scrapes["engine"] | scrapes["operator"] | scrapes["router"]
    exprs = panel_exprs(dashboard)
    assert len(exprs) >= 20
    titles = {title for title, _ in exprs}
    # What the issue asks the dashboard to show.
    for wanted in ("Token throughput", "Time to first token", "Inter-token latency", "Queue",
                   "KV-cache usage", "Prefix-cache hit rate", "Preemptions",
                   "Replicas: desired, current, max", "Saturation", "Scale decisions",
                   "Routing decisions", "Prefix match at the chosen replica", "Held requests",
                   "Hold time"):  # fmt: skip
        assert wanted in titles, wanted
    for title, expr in exprs:
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no metric"
        missing = names - exported
        assert not missing, f"panel {title!r} reads metrics nobody exports: {sorted(missing)}"


def test_vllms_own_dashboard_reads_only_metrics_kvpilot_serve_exports(
    scrapes: dict[str, set[str]],
) -> None:
    names = set().union(*(metric_names(expr) for expr in VLLM_EXPRS))
    assert len(names) >= 15
    missing = names - scrapes["engine"]
    assert not missing, f"vLLM's dashboard reads what kvpilot serve lacks: {sorted(missing)}"


def test_alert_rules_parse_and_read_exported_metrics(scrapes: dict[str, set[str]]) -> None:
    (rule,) = of_kind(render(MONITORING), "PrometheusRule")
    rules = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert {r["alert"] for r in rules} >= {
        "KvpilotQueueGrowingAtMaxReplicas",
        "KvpilotKVCacheFull",
        "KvpilotPodsCrashLooping",
        "KvpilotReconcileErrors",
    }
    exported = scrapes["engine"] | scrapes["operator"]
    for r in rules:
        names = metric_names(r["expr"])
        assert names and not names - exported, (r["alert"], sorted(names - exported))
        assert "{{ $labels." in r["annotations"]["summary"]  # Helm left Prometheus' templates


def test_the_dashboard_ships_as_a_sidecar_configmap_only_when_asked() -> None:
    assert not of_kind(render(), "ConfigMap")
    values = {"monitoring": {"grafanaDashboard": {"enabled": True, "namespace": "grafana"}}}
    (config_map,) = of_kind(render(values), "ConfigMap")
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["kvpilot.json"]) == json.loads(DASHBOARD.read_text())


def test_the_engine_podmonitor_labels_series_with_their_inferenceservice() -> None:
    docs = render({**MONITORING, "watchNamespaces": ["serving"]})
    engines, operator, router = of_kind(docs, "PodMonitor")
    assert engines["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "kvpilot-engine"
    assert engines["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    (endpoint,) = engines["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http"
    assert {"targetLabel": "inferenceservice"}.items() <= endpoint["relabelings"][0].items()
    assert operator["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    assert router["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert router["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    # Without the operator's metrics port there is nothing to monitor on it.
    no_metrics = of_kind(render({**MONITORING, "metricsPort": 0}), "PodMonitor")
    assert [m["metadata"]["name"] for m in no_metrics] == ["kvpilot-engines", "kvpilot-router"]
    no_router = of_kind(render({**MONITORING, "router": {"enabled": False}}), "PodMonitor")
    assert [m["metadata"]["name"] for m in no_router] == ["kvpilot-engines", "kvpilot-operator"]
