"""What the e2e tests share: polling, the InferenceService's view, port-forwards."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .conftest import GROUP, PLURAL, ROOT, VERSION, E2ESettings
from .standin_cluster import is_standin, local_forward


def wait_for(
    check: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval: float = 2.0,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """Polls `check` until truthy; on timeout, `describe()` says what the cluster shows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(interval)
    seen = f": {describe()!r}" if describe is not None else ""
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}{seen}")


def get_isvc(apis: dict[str, Any], e2e: E2ESettings, name: str) -> dict[str, Any]:
    return apis["custom"].get_namespaced_custom_object(GROUP, VERSION, e2e.namespace, PLURAL, name)


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    for found in (obj.get("status") or {}).get("conditions") or []:
        if found["type"] == type_:
            return found
    return {}


def wait_ready(apis: dict[str, Any], e2e: E2ESettings, name: str) -> dict[str, Any]:
    """Waits for Ready=True (pulling the image and loading the model take a while)."""
    return wait_for(
        lambda: (
            (obj := get_isvc(apis, e2e, name))
            and condition(obj, "Ready").get("status") == "True"
            and obj
        ),
        e2e.timeout_s,
        f"{name} to be Ready",
        interval=5,
        describe=lambda: (get_isvc(apis, e2e, name).get("status") or {}).get("conditions"),
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def port_forward(namespace: str, target: str, remote_port: int) -> Iterator[int]:
    """A local port reaching `target` (svc/NAME, deploy/NAME, a pod) at `remote_port`."""
    if is_standin():
        with local_forward(namespace, target, remote_port) as port:
            yield port
        return
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is needed on PATH for the port-forward")
    port = free_port()
    process = subprocess.Popen(
        [kubectl, "-n", namespace, "port-forward", target, f"{port}:{remote_port}"],
        # Not a pipe: kubectl logs a line per connection, and a full pipe would stall it.
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _is_listening(port), 30, "the port-forward", interval=0.5)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def _is_listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def ask_routed(client: Any, model: str, system: str, question: str) -> tuple[str, str, int]:
    """One short chat through the router: (replica, route header, cached prompt tokens)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    usage = raw.parse().usage
    cached = usage.prompt_tokens_details.cached_tokens if usage else 0
    return raw.headers["x-kvpilot-replica"], raw.headers["x-kvpilot-route"], cached or 0


def example_isvc(e2e: E2ESettings, name: str) -> dict[str, Any]:
    """The bundled-model CPU example, renamed into the test namespace."""
    import yaml

    body = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": e2e.namespace}
    return body


def router_follows(base: str, model: str, count: int) -> bool:
    """Whether the router at `base` has `count` routable replicas of `model` (its index view)."""
    import httpx

    try:
        replicas = httpx.get(f"{base}/kvpilot/v1/router/index", timeout=5).json().get(model, {})
    except httpx.HTTPError:
        return False
    return sum(r["routable"] for r in replicas.values()) == count


def router_routes_to(base: str, model: str, pod: str) -> bool:
    """Whether the router at `base` may send `model`'s requests to `pod` (its index view; a
    router that does not answer counts as routing to it: nothing says otherwise)."""
    import httpx

    try:
        replicas = httpx.get(f"{base}/kvpilot/v1/router/index", timeout=5).json().get(model, {})
    except httpx.HTTPError:
        return True
    return bool((replicas.get(pod) or {}).get("routable"))


def router_pods(apis: dict[str, Any], namespace: str, service: str) -> dict[str, int]:
    """{pod: container port} of the Ready, not terminating pods behind router Service `service`:
    each router replica keeps a view of its own, and a Service spreads requests over all."""
    found = apis["core"].read_namespaced_service(service, namespace)
    labels = ",".join(f"{k}={v}" for k, v in found.spec.selector.items())
    (target,) = [p.target_port for p in found.spec.ports]
    pods: dict[str, int] = {}
    for pod in apis["core"].list_namespaced_pod(namespace, label_selector=labels).items:
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        if not ready or pod.metadata.deletion_timestamp is not None:
            continue
        ports = [p for c in pod.spec.containers for p in c.ports or []]
        pods[pod.metadata.name] = next(
            p.container_port for p in ports if target in (p.name, p.container_port)
        )
    return pods


def router_tokenizes(base: str, model: str) -> bool:
    """Whether the router at `base` holds `model`'s tokenizer (until it does, it routes by load
    alone: no prefix routes)."""
    import httpx

    try:
        cards = httpx.get(f"{base}/v1/models", timeout=5).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return any(
        card["id"] == model and (card.get("kvpilot") or {}).get("tokenizerLoaded") for card in cards
    )
