"""Stands in for a kubelet (and the scheduler) on a control plane that has neither: a real
kube-apiserver and kube-controller-manager on loopback, with no node agent.

What a kubelet does for a pod, this does with local processes: it binds each new pod of its
namespace to a Node object of its own (a Binding, as the scheduler would), runs the pod's one
container as a process on a loopback address of its own (127.0.0.N), probes the container's
readinessProbe path and then reports the pod Running and Ready with that podIP. It renews its
Node's Ready heartbeat as a kubelet does (without it, the controller-manager's node lifecycle
controller marks the node's pods NotReady after 40 s). A pod being
deleted has its process stopped (SIGTERM, then SIGKILL) and is removed (grace period 0, as a
kubelet confirms a deletion). How a container becomes a local command is the caller's:
a `Runtime` turns the container spec and the pod's address into a process.

Only what the tests here need: one container per pod, no init containers, volumes or restarts.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

POLL_S = 0.2
STOP_GRACE_S = 10.0
# The node lifecycle controller marks every pod of a node NotReady once the node's heartbeat
# is older than its grace period (40 s by default): the heartbeat is renewed well within it.
HEARTBEAT_S = 5.0


@dataclass(frozen=True)
class LocalContainer:
    """How to run one container here: its command, environment and readiness URL."""

    argv: list[str]
    env: dict[str, str]
    ready_url: str


# (the pod, its container spec, the loopback address it gets) -> how to run it
Runtime = Callable[[Mapping[str, Any], Mapping[str, Any], str], LocalContainer]


@dataclass
class RunningPod:
    name: str
    uid: str
    ip: str
    process: subprocess.Popen[bytes]
    log_path: Path
    is_ready: bool = False

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-lines:])
        return ""


@dataclass
class KubeletStandIn:
    """Runs the pods of `namespace` on a Node named `node_name` while started (see module)."""

    core: Any  # kubernetes.client.CoreV1Api
    namespace: str
    node_name: str
    runtime: Runtime
    log_dir: Path
    first_ip: int = 2  # pods get 127.0.0.<first_ip>, <first_ip + 1>, ...
    ready_timeout_s: float = 240.0
    pods: dict[str, RunningPod] = field(default_factory=dict)  # by pod uid
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _next_ip: int = 0
    _last_heartbeat: float = 0.0

    def start(self) -> None:
        from kubernetes import client

        self._next_ip = self.first_ip
        node = client.V1Node(
            metadata=client.V1ObjectMeta(
                name=self.node_name, labels={"kubernetes.io/hostname": self.node_name}
            )
        )
        self.core.create_node(node)
        self._report_node_ready()
        self._thread = threading.Thread(target=self._loop, name="kubelet-standin", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops every process it started, removes its pods that are left, and its Node."""
        from kubernetes.client.exceptions import ApiException

        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for running in list(self.pods.values()):
            self._kill(running)
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(
                    running.name, self.namespace, grace_period_seconds=0
                )
        self.pods.clear()
        with contextlib.suppress(ApiException):
            self.core.delete_node(self.node_name)

    def running(self, pod_name: str) -> RunningPod | None:
        return next((p for p in self.pods.values() if p.name == pod_name), None)

    def _report_node_ready(self) -> None:
        now = _now()
        status = {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "a test's kubelet stand-in",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
        }
        self.core.patch_node_status(self.node_name, {"status": status})
        self._last_heartbeat = time.monotonic()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._sync()
            except Exception as error:  # one bad round is logged, the next one tries again
                logger.exception("kubelet stand-in round failed")
                self.errors.append(repr(error))
            self._stop.wait(POLL_S)

    def _sync(self) -> None:
        if time.monotonic() - self._last_heartbeat > HEARTBEAT_S:
            self._report_node_ready()
        pods = self.core.list_namespaced_pod(self.namespace).items
        seen = set()
        for pod in pods:
            uid = pod.metadata.uid
            seen.add(uid)
            if pod.metadata.deletion_timestamp is not None:
                self._delete(pod)
            elif pod.spec.node_name is None:
                self._bind(pod)
            elif pod.spec.node_name == self.node_name and uid not in self.pods:
                self._run(pod)
            elif uid in self.pods:
                self._check(pod, self.pods[uid])
        for uid in set(self.pods) - seen:
            self._kill(self.pods.pop(uid))

    def _bind(self, pod: Any) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": pod.metadata.name},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name},
        }
        # The client cannot read a Binding back (its `target` is required in the model): the
        # answer is left raw.
        self.core.create_namespaced_pod_binding(
            pod.metadata.name, self.namespace, body, _preload_content=False
        )

    def _run(self, pod: Any) -> None:
        from kubernetes import client

        raw = client.ApiClient().sanitize_for_serialization(pod)
        (container,) = raw["spec"]["containers"]
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        local = self.runtime(raw, container, ip)
        log_path = self.log_dir / f"{pod.metadata.name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                local.argv,
                env=local.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        running = RunningPod(pod.metadata.name, pod.metadata.uid, ip, process, log_path)
        self.pods[pod.metadata.uid] = running
        logger.info("pod %s runs as pid %d on %s", running.name, process.pid, ip)
        threading.Thread(target=self._probe, args=(running, local.ready_url), daemon=True).start()

    def _probe(self, running: RunningPod, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if running.process.poll() is not None:
                self.errors.append(f"{running.name} exited: {running.log_tail()}")
                return
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url, timeout=2).status_code == 200:
                    self._report_ready(running)
                    return
            time.sleep(0.2)
        if not self._stop.is_set():
            self.errors.append(f"{running.name} not ready in time: {running.log_tail()}")

    def _report_ready(self, running: RunningPod) -> None:
        now = _now()
        conditions = [
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ]
        status = {
            "phase": "Running",
            "hostIP": "127.0.0.1",
            "podIP": running.ip,
            "podIPs": [{"ip": running.ip}],
            "startTime": now,
            "conditions": conditions,
        }
        self.core.patch_namespaced_pod_status(running.name, self.namespace, {"status": status})
        running.is_ready = True

    def _check(self, pod: Any, running: RunningPod) -> None:
        if running.process.poll() is not None and running.is_ready:
            running.is_ready = False
            self.errors.append(f"{running.name} exited: {running.log_tail()}")
            status = {"phase": "Failed", "conditions": [{"type": "Ready", "status": "False"}]}
            self.core.patch_namespaced_pod_status(
                pod.metadata.name, self.namespace, {"status": status}
            )

    def _delete(self, pod: Any) -> None:
        running = self.pods.pop(pod.metadata.uid, None)
        if running is not None:
            self._kill(running)
        if pod.spec.node_name in (None, self.node_name):
            from kubernetes.client.exceptions import ApiException

            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(
                    pod.metadata.name, self.namespace, grace_period_seconds=0
                )

    def _kill(self, running: RunningPod) -> None:
        process = running.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        logger.info("pod %s stopped (pid %d)", running.name, process.pid)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
