"""The e2e tests on a control plane without nodes (a real kube-apiserver and
kube-controller-manager, ../shared/k8s-local/): kubelet stand-ins run the chart's and the
operator's pods as local processes (kubelet_standin, pod_runtime), under the chart's own
ServiceAccounts through a recording proxy (api_recorder), and `kubectl port-forward`, which
needs a kubelet, becomes a local TCP forward to the pod's loopback address.

Opt in with KVPILOT_E2E_KUBELET=standin (e2e/run-real-apiserver.sh sets it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .api_recorder import ApiRecorder
from .kubelet_standin import KubeletStandIn
from .pod_runtime import ImageRuntime

STANDIN_ENV = "KVPILOT_E2E_KUBELET"
MODEL_CACHE_ENV = "KVPILOT_E2E_MODEL_CACHE"
# Loopback subnets of their own: other processes on this machine use 127.0.0.1.
FIRST_SUBNET = 41


def is_standin() -> bool:
    """Whether the tests run their pods themselves (KVPILOT_E2E_KUBELET=standin)."""
    return os.environ.get(STANDIN_ENV) == "standin"


@dataclass
class StandinCluster:
    """The stand-ins (one Node per namespace) and the recorder of the pods' API calls."""

    recorder: ApiRecorder
    kubelets: dict[str, KubeletStandIn] = field(default_factory=dict)  # by namespace

    def pod_log(self, namespace: str, pod: str) -> str:
        running = self.kubelets[namespace].running(pod)
        if running is None:
            raise LookupError(f"no pod {namespace}/{pod} runs here")
        return running.log_path.read_text(errors="replace")

    def errors(self) -> list[str]:
        return [error for kubelet in self.kubelets.values() for error in kubelet.errors]


@contextlib.contextmanager
def standin_cluster(
    core: Any, namespaces: list[str], work: Path, ready_timeout_s: float
) -> Iterator[StandinCluster]:
    """Starts the recorder and a stand-in per namespace; stops them all afterwards."""
    configuration = core.api_client.configuration
    recorder = ApiRecorder(
        upstream=configuration.host.rstrip("/"), ca_file=configuration.ssl_ca_cert
    )
    recorder.start()
    cache = Path(os.environ.get(MODEL_CACHE_ENV) or work / "model-cache")
    runtime = ImageRuntime(core, recorder, work / "pods", cache)
    cluster = StandinCluster(recorder)
    try:
        for index, namespace in enumerate(namespaces):
            log_dir = work / "logs" / namespace
            log_dir.mkdir(parents=True, exist_ok=True)
            kubelet = KubeletStandIn(
                core=core,
                namespace=namespace,
                node_name=f"standin-{namespace}",
                runtime=runtime,
                log_dir=log_dir,
                ip_prefix=f"127.0.{FIRST_SUBNET + index}.",
                ready_timeout_s=ready_timeout_s,
            )
            kubelet.start()
            cluster.kubelets[namespace] = kubelet
        yield cluster
    finally:
        for kubelet in cluster.kubelets.values():
            kubelet.stop()
        recorder.stop()


def pod_address(core: Any, apps: Any, namespace: str, target: str, port: int) -> tuple[str, int]:
    """(pod IP, container port) that `kubectl port-forward TARGET PORT` would reach: a Ready
    pod of the Service's or Deployment's selector, or the named pod."""
    kind, _, name = target.rpartition("/")
    if kind in ("svc", "service"):
        service = core.read_namespaced_service(name, namespace)
        (entry,) = [p for p in service.spec.ports if p.port == port]
        selector, target_port = service.spec.selector, entry.target_port
    elif kind in ("deploy", "deployment"):
        deployment = apps.read_namespaced_deployment(name, namespace)
        selector, target_port = deployment.spec.selector.match_labels, port
    else:
        pod = core.read_namespaced_pod(name, namespace)
        return pod.status.pod_ip, port
    labels = ",".join(f"{k}={v}" for k, v in selector.items())
    for pod in core.list_namespaced_pod(namespace, label_selector=labels).items:
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        if ready and pod.metadata.deletion_timestamp is None and pod.status.pod_ip:
            if isinstance(target_port, str):
                (target_port,) = [
                    p.container_port
                    for c in pod.spec.containers
                    for p in c.ports or []
                    if p.name == target_port
                ]
            return pod.status.pod_ip, int(target_port)
    raise LookupError(f"no Ready pod behind {namespace}/{target}")


@dataclass
class TcpForward:
    """127.0.0.1:<port> forwarded to (host, remote_port) while started, one connection each
    way per client connection; stopping drops every connection (as a port-forward's end does)."""

    host: str
    remote_port: int
    port: int = 0
    _listener: socket.socket | None = None
    _sockets: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        threading.Thread(target=self._accept, name="tcp-forward", daemon=True).start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection((self.host, self.remote_port), timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(source, sink), daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def local_forward(namespace: str, target: str, remote_port: int) -> Iterator[int]:
    """What `kubectl port-forward` gives, for a pod the stand-in runs: a local port."""
    from kubernetes import client, config

    api = config.new_client_from_config(config_file=os.environ["KUBECONFIG"])
    try:
        host, port = pod_address(
            client.CoreV1Api(api), client.AppsV1Api(api), namespace, target, remote_port
        )
    finally:
        api.close()
    forward = TcpForward(host, port)
    forward.start()
    try:
        yield forward.port
    finally:
        forward.stop()
