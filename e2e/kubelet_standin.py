"""Stands in for a kubelet (and the scheduler) on a control plane that has neither: a real
kube-apiserver and kube-controller-manager on loopback, with no node agent.

What a kubelet does for a pod, this does with local processes: it binds each new pod of its
namespace to a Node object of its own (a Binding, as the scheduler would), runs the pod's one
container as a process on a loopback address of its own (127.0.0.N), probes the container's
readinessProbe path and then reports the pod Running and Ready with that podIP. It renews its
Node's Ready heartbeat as a kubelet does (without it, the controller-manager's node lifecycle
controller marks the node's pods NotReady after 40 s). How a container becomes a local command
is the caller's: a `Runtime` turns the container spec and the pod's address into a process.

As the scheduler, it binds a pod only where its resource requests fit in what the Node offers
(`capacity`) less what the pods bound there already request; a pod that does not fit stays
Pending with PodScheduled=False (Unschedulable). A pod being deleted has its preStop exec hook
run as a local command, then SIGTERM, then SIGKILL after its grace period, and is then removed.
A container the runtime cannot start (ContainerError) stays Waiting with the runtime's reason and
message, as a kubelet reports CreateContainerConfigError or RunContainerError.

Only what the tests here need: one container per pod, no init containers or restarts.
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
    """How to run one container here: its command, environment, working directory and
    readiness URL (None: Ready once started, as a container without a readinessProbe is)."""

    argv: list[str]
    env: dict[str, str]
    ready_url: str | None
    cwd: str | None = None


class ContainerError(Exception):
    """A container that cannot start: `reason` as a kubelet gives it (CreateContainerConfigError,
    RunContainerError), and a message."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


# (the pod, its container spec, the loopback address it gets) -> how to run it
Runtime = Callable[[Mapping[str, Any], Mapping[str, Any], str], LocalContainer]

# What the Node offers pods (the scheduler's fit check): a small node.
DEFAULT_CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110"}


@dataclass
class RunningPod:
    name: str
    uid: str
    ip: str
    process: subprocess.Popen[bytes]
    log_path: Path
    local: LocalContainer
    is_ready: bool = False
    is_terminating: bool = False

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
    first_ip: int = 2  # pods get <ip_prefix><first_ip>, <first_ip + 1>, ...
    ip_prefix: str = "127.0.0."
    ready_timeout_s: float = 240.0
    capacity: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_CAPACITY))
    pods: dict[str, RunningPod] = field(default_factory=dict)  # by pod uid
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _next_ip: int = 0
    _last_heartbeat: float = 0.0
    _failed: set[str] = field(default_factory=set)  # uids of pods whose container cannot start
    _unschedulable: set[str] = field(default_factory=set)  # uids reported Unschedulable

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
            self._kill(running, STOP_GRACE_S)
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
            "capacity": self.capacity,
            "allocatable": self.capacity,
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
                self._schedule(pod, pods)
            elif pod.spec.node_name == self.node_name and uid not in self.pods:
                if uid not in self._failed:
                    self._run(pod)
            elif uid in self.pods:
                self._check(pod, self.pods[uid])
        for uid in set(self.pods) - seen:
            self._kill(self.pods.pop(uid), STOP_GRACE_S)

    def _schedule(self, pod: Any, pods: list[Any]) -> None:
        """Binds `pod` to the Node where its requests fit (the scheduler's fit check)."""
        bound = [
            p
            for p in pods
            if p.spec.node_name == self.node_name
            and p.metadata.deletion_timestamp is None
            and p.status.phase not in ("Succeeded", "Failed")
        ]
        for resource in ("cpu", "memory"):
            offered = _quantity(self.capacity[resource])
            wanted = sum(_requests(p, resource) for p in bound) + _requests(pod, resource)
            if wanted > offered:
                self._report_unschedulable(pod, resource)
                return
        self._bind(pod)

    def _report_unschedulable(self, pod: Any, resource: str) -> None:
        if pod.metadata.uid in self._unschedulable:
            return
        self._unschedulable.add(pod.metadata.uid)
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": f"0/1 nodes are available: 1 Insufficient {resource}.",
            "lastTransitionTime": _now(),
        }
        status = {"phase": "Pending", "conditions": [condition]}
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, {"status": status})

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
        ip = f"{self.ip_prefix}{self._next_ip}"
        try:
            local = self.runtime(raw, container, ip)
        except ContainerError as error:
            self._failed.add(pod.metadata.uid)
            self.errors.append(f"{pod.metadata.name}: {error}")
            self._report_waiting(pod, container["name"], error)
            return
        self._next_ip += 1
        log_path = self.log_dir / f"{pod.metadata.name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                local.argv,
                env=local.env,
                cwd=local.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        running = RunningPod(pod.metadata.name, pod.metadata.uid, ip, process, log_path, local)
        self.pods[pod.metadata.uid] = running
        logger.info("pod %s runs as pid %d on %s", running.name, process.pid, ip)
        if local.ready_url is None:
            self._report_ready(running)
        else:
            threading.Thread(
                target=self._probe, args=(running, local.ready_url), daemon=True
            ).start()

    def _report_waiting(self, pod: Any, container: str, error: ContainerError) -> None:
        waiting = {"reason": error.reason, "message": error.message}
        status = {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": container,
                    "image": pod.spec.containers[0].image,
                    "imageID": "",
                    "ready": False,
                    "restartCount": 0,
                    "started": False,
                    "state": {"waiting": waiting},
                }
            ],
        }
        self.core.patch_namespaced_pod_status(pod.metadata.name, self.namespace, {"status": status})

    def _probe(self, running: RunningPod, url: str) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            if running.is_terminating:
                return
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
        running = self.pods.get(pod.metadata.uid)
        if running is None:
            if pod.spec.node_name in (None, self.node_name):
                self._remove(pod.metadata.name)
            return
        if running.is_terminating:
            return
        running.is_terminating = True
        grace = pod.metadata.deletion_grace_period_seconds
        container = pod.spec.containers[0]
        hook = container.lifecycle.pre_stop if container.lifecycle else None
        command = hook._exec.command if hook is not None and hook._exec is not None else None
        threading.Thread(
            target=self._terminate, args=(running, command, grace), daemon=True
        ).start()

    def _terminate(
        self, running: RunningPod, pre_stop: list[str] | None, grace: int | None
    ) -> None:
        """As a kubelet: the preStop hook, SIGTERM, SIGKILL once the grace period is over; then
        the pod is removed."""
        deadline = time.monotonic() + (grace if grace is not None else 30)
        if pre_stop and running.process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run(
                    pre_stop,
                    env=running.local.env,
                    timeout=max(0.0, deadline - time.monotonic()),
                    check=False,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
        self._kill(running, max(1.0, deadline - time.monotonic()))
        self.pods.pop(running.uid, None)
        self._remove(running.name)

    def _remove(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)

    def _kill(self, running: RunningPod, grace_s: float) -> None:
        process = running.process
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        logger.info("pod %s stopped (pid %d)", running.name, process.pid)


def _quantity(text: str) -> float:
    """A Kubernetes quantity (cpu or memory) as a number: 500m, 2, 3Gi, 768Mi."""
    from kubernetes.utils import parse_quantity

    return float(parse_quantity(text))


def _requests(pod: Any, resource: str) -> float:
    total = 0.0
    for container in pod.spec.containers:
        requests = (container.resources.requests if container.resources else None) or {}
        if resource in requests:
            total += _quantity(requests[resource])
    return total


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
