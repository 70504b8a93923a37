"""The kubelet stand-in's container runtime for the chart's and the operator's pods: a container
of the kvpilot image becomes a local `python -m kvpilot.cli` process with the container's own
command line, environment and ServiceAccount.

What the image would give, this gives with local means:
- the command: the container's `command` (the image has no ENTRYPOINT) then its `args`; the
  image's one program is `kvpilot`, run here from this checkout. Anything else is a container
  that cannot start (as `exec: "router": executable file not found` would be on a node).
- the network: a pod has a network namespace of its own, these processes share the host's. Each
  listens on its pod IP instead: `0.0.0.0` in the args becomes the pod IP, and a `kvpilot router`
  without `--host` gets `--host POD_IP`.
- the volumes: each emptyDir is a directory of the pod's own; the engines' model-cache volume
  is one directory for all pods (as a claim shared by the pods is), so a model is converted and
  its kernels compiled once. Paths under a mount, in args and env, are moved there.
- the env: values, fieldRef (name, namespace, pod IP, node, service account) and secretKeyRef
  (read as a kubelet reads them); never the test's own KUBECONFIG or admin credentials.
- the ServiceAccount: a token from the TokenRequest API, bound to the pod (it dies with it), in a
  kubeconfig of its own (in place of the kube-api-access volume a kubelet would mount) that
  points at the recording proxy (api_recorder.ApiRecorder), so every call the process makes is
  authorised by the chart's RBAC alone, and recorded.
- CPU: torch gets as many threads as the container's CPU limit (else request) rounds up to.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvpilot.operator.constants import MODEL_CACHE_VOLUME

from .api_recorder import ApiRecorder
from .kubelet_standin import ContainerError, LocalContainer

IMAGE_PROGRAM = "kvpilot"
TOKEN_SECONDS = 3600
# Inherited from the test's environment, never passed on: the pod has its own identity.
_PRIVATE_ENV = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")


@dataclass
class ImageRuntime:
    """Turns a pod's container into a LocalContainer (see module)."""

    core: Any  # kubernetes.client.CoreV1Api with the test's (admin) credentials: the kubelet's
    recorder: ApiRecorder
    scratch: Path  # per-pod directories go here
    model_cache: Path  # the engines' shared model-cache volume

    def __call__(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], ip: str
    ) -> LocalContainer:
        name = pod["metadata"]["name"]
        root = self.scratch / name
        root.mkdir(parents=True, exist_ok=True)
        mounts = self._mounts(pod, container, root)
        argv = list(container.get("command") or []) + list(container.get("args") or [])
        if not argv or argv[0] != IMAGE_PROGRAM:
            raise ContainerError(
                "RunContainerError",
                f'exec: "{argv[0] if argv else ""}": executable file not found in $PATH '
                f"(the image has no ENTRYPOINT; its program is {IMAGE_PROGRAM})",
            )
        args = [_moved(arg.replace("0.0.0.0", ip), mounts) for arg in argv[1:]]
        if args[:1] == ["router"] and not any(a.startswith("--host") for a in args):
            args.append(f"--host={ip}")
        env = {k: v for k, v in os.environ.items() if k not in _PRIVATE_ENV}
        env.update(self._env(pod, container, ip, mounts))
        env["OMP_NUM_THREADS"] = str(_cpu_threads(container))
        kubeconfig = self._service_account(pod, root)
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        return LocalContainer(
            argv=[sys.executable, "-m", "kvpilot.cli", *args],
            env=env,
            ready_url=_ready_url(container, ip),
            cwd=str(root),
        )

    def _mounts(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], root: Path
    ) -> dict[str, str]:
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: dict[str, str] = {}
        for mount in container.get("volumeMounts") or []:
            path = mount["mountPath"]
            if path == "/dev/shm":
                continue  # the host's own
            volume = volumes.get(mount["name"], {})
            if "projected" in volume:
                continue  # the ServiceAccount token's: the kubeconfig carries that token
            if mount["name"] == MODEL_CACHE_VOLUME:
                local = self.model_cache
            elif "emptyDir" in volume:
                local = root / mount["name"]
            else:
                raise ContainerError(
                    "CreateContainerConfigError",
                    f"volume {mount['name']} is neither an emptyDir nor the model cache",
                )
            local.mkdir(parents=True, exist_ok=True)
            mounts[path] = str(local)
        return mounts

    def _env(
        self, pod: Mapping[str, Any], container: Mapping[str, Any], ip: str, mounts: dict[str, str]
    ) -> dict[str, str]:
        fields = {
            "metadata.name": pod["metadata"]["name"],
            "metadata.namespace": pod["metadata"]["namespace"],
            "status.podIP": ip,
            "spec.nodeName": pod["spec"].get("nodeName", ""),
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        }
        env: dict[str, str] = {}
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = _moved(var["value"], mounts)
                continue
            source = var.get("valueFrom") or {}
            if "fieldRef" in source:
                env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in source:
                value = self._secret_key(pod["metadata"]["namespace"], source["secretKeyRef"])
                if value is not None:
                    env[var["name"]] = value
            else:
                raise ContainerError(
                    "CreateContainerConfigError", f"env {var['name']}: unsupported {source}"
                )
        return env

    def _secret_key(self, namespace: str, ref: Mapping[str, Any]) -> str | None:
        import base64

        from kubernetes.client.exceptions import ApiException

        try:
            secret = self.core.read_namespaced_secret(ref["name"], namespace)
        except ApiException as error:
            if error.status == 404 and ref.get("optional"):
                return None
            raise ContainerError(
                "CreateContainerConfigError", f'secret "{ref["name"]}" not found'
            ) from error
        data = secret.data or {}
        if ref["key"] not in data:
            if ref.get("optional"):
                return None
            raise ContainerError(
                "CreateContainerConfigError",
                f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}",
            )
        return base64.b64decode(data[ref["key"]]).decode()

    def _service_account(self, pod: Mapping[str, Any], root: Path) -> Path | None:
        spec = pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        account = spec.get("serviceAccountName") or "default"
        namespace = pod["metadata"]["namespace"]
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": TOKEN_SECONDS,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            },
        }
        answer = self.core.create_namespaced_service_account_token(account, namespace, request)
        token = answer.status.token
        self.recorder.identify(token, f"{namespace}/{account}")
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "standin", "cluster": {"server": self.recorder.url}}],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [
                {
                    "name": "standin",
                    "context": {"cluster": "standin", "user": account, "namespace": namespace},
                }
            ],
            "current-context": "standin",
        }
        path = root / "kubeconfig"
        path.touch(mode=0o600)
        path.write_text(yaml.safe_dump(config))
        return path


def _moved(value: str, mounts: Mapping[str, str]) -> str:
    """`value` with a leading mount path replaced by its local directory."""
    for path, local in mounts.items():
        if value == path or value.startswith(path + "/"):
            return local + value[len(path) :]
        for prefix in ("=",):  # --flag=/models/x
            flag, sep, rest = value.partition(prefix)
            if sep and (rest == path or rest.startswith(path + "/")):
                return f"{flag}={local}{rest[len(path) :]}"
    return value


def _cpu_threads(container: Mapping[str, Any]) -> int:
    resources = container.get("resources") or {}
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
    if cpu is None:
        return 1
    cores = float(cpu[:-1]) / 1000 if str(cpu).endswith("m") else float(cpu)
    return max(1, math.ceil(cores))


def _ready_url(container: Mapping[str, Any], ip: str) -> str | None:
    """The readinessProbe's URL on the pod IP; None: Ready once started (no probe)."""
    probe = (container.get("readinessProbe") or {}).get("httpGet")
    if probe is None:
        return None
    port = probe["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in container.get("ports") or [] if p["name"] == port]
    return f"http://{ip}:{port}{probe.get('path', '/')}"
