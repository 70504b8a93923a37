"""Reads engine pods for the problems a user must act on: no GPU to schedule on, a crash loop,
an image that cannot be pulled, an OOM kill, a failed model download.

Pure: pods (as the API returns them) in, the most pressing problem out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.operator.constants import MODEL_FETCH_CONTAINER

MAX_MESSAGE_CHARS = 900
# Waiting reasons the kubelet will not get past on its own.
IMAGE_PULL_REASONS = {"ErrImagePull": "ImagePullBackOff", "ImagePullBackOff": "ImagePullBackOff"}
FATAL_WAITING_REASONS = (
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
# Most pressing first: a root cause (OOM, failed download) beats its symptom (a crash loop).
SEVERITY = (
    "OOMKilled",
    "ModelDownloadFailed",
    "CrashLoopBackOff",
    "ImagePullBackOff",
    *FATAL_WAITING_REASONS,
    "Unschedulable",
    "PodFailed",
)


@dataclass(frozen=True)
class PodProblem:
    pod: str
    reason: str  # CamelCase, one of SEVERITY
    message: str


def diagnose_pod(pod: dict[str, Any]) -> PodProblem | None:
    metadata, status = pod.get("metadata", {}), pod.get("status") or {}
    name = metadata.get("name", "?")
    if metadata.get("deletionTimestamp"):
        return None  # going away: its crash is not the current state
    if status.get("phase") == "Failed":
        reason = status.get("reason") or "PodFailed"
        message = status.get("message") or "the pod failed"
        return PodProblem(name, "PodFailed", _clip(f"pod {name} failed ({reason}): {message}"))
    for container in status.get("initContainerStatuses") or []:
        problem = _diagnose_container(name, container, is_init=True)
        if problem is not None:
            return problem
    for container in status.get("containerStatuses") or []:
        problem = _diagnose_container(name, container, is_init=False)
        if problem is not None:
            return problem
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            message = condition.get("message") or "no node fits the pod"
            return PodProblem(
                name, "Unschedulable", _clip(f"pod {name} is unschedulable: {message}")
            )
    return None


def _diagnose_container(pod: str, container: dict[str, Any], *, is_init: bool) -> PodProblem | None:
    cname = container.get("name", "?")
    state = container.get("state") or {}
    last = (container.get("lastState") or {}).get("terminated") or {}
    waiting = state.get("waiting") or {}
    terminated = state.get("terminated") or {}
    restarts = container.get("restartCount", 0)
    where = f"pod {pod} container {cname}"

    if "OOMKilled" in (last.get("reason"), terminated.get("reason")):
        return PodProblem(
            pod,
            "OOMKilled",
            _clip(
                f"{where} was OOMKilled (restarts: {restarts}): raise "
                "spec.resources.limits.memory or lower maxNumSeqs / maxModelLen"
            ),
        )
    waiting_reason = waiting.get("reason")
    if waiting_reason in IMAGE_PULL_REASONS:
        return PodProblem(
            pod,
            IMAGE_PULL_REASONS[waiting_reason],
            _clip(f"{where} cannot pull its image: {waiting.get('message') or waiting_reason}"),
        )
    if waiting_reason in FATAL_WAITING_REASONS:
        return PodProblem(
            pod,
            waiting_reason,
            _clip(f"{where}: {waiting.get('message') or waiting_reason}"),
        )
    failed_now = terminated and terminated.get("exitCode", 0) != 0
    if waiting_reason == "CrashLoopBackOff" or failed_now:
        crash = last or terminated
        detail = _termination_detail(crash)
        if is_init and cname == MODEL_FETCH_CONTAINER:
            return PodProblem(
                pod, "ModelDownloadFailed", _clip(f"model download failed in pod {pod}{detail}")
            )
        return PodProblem(
            pod,
            "CrashLoopBackOff",
            _clip(f"{where} keeps crashing (restarts: {restarts}){detail}"),
        )
    return None


def _termination_detail(terminated: dict[str, Any]) -> str:
    if not terminated:
        return ""
    parts = [f"exit code {terminated.get('exitCode', '?')}"]
    if terminated.get("reason"):
        parts.append(str(terminated["reason"]))
    detail = ", ".join(parts)
    message = (terminated.get("message") or "").strip()
    if message:
        # The tail of the log (FallbackToLogsOnError) is where the error is.
        detail += ": " + message[-(MAX_MESSAGE_CHARS // 2) :]
    return f" ({detail})" if not message else f": {detail}"


def _clip(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


def most_pressing(pods: list[dict[str, Any]]) -> PodProblem | None:
    """The worst problem among the pods, its message noting how many more pods have one."""
    problems = [p for p in (diagnose_pod(pod) for pod in pods) if p is not None]
    if not problems:
        return None
    problems.sort(key=lambda p: (SEVERITY.index(p.reason), p.pod))
    worst = problems[0]
    if len(problems) > 1:
        others = len(problems) - 1
        noun = "pod has" if others == 1 else "pods have"
        return PodProblem(
            worst.pod, worst.reason, f"{worst.message} ({others} more {noun} problems)"
        )
    return worst
