from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.diagnose import diagnose_pod, most_pressing


def pod(name: str = "chat-1", **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"phase": "Pending", **status}}


def container(name: str = "engine", **fields: Any) -> dict[str, Any]:
    return {"name": name, "restartCount": 0, **fields}


UNSCHEDULABLE = pod(
    conditions=[
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        }
    ]
)
CRASH_LOOP = pod(
    phase="Running",
    containerStatuses=[
        container(
            restartCount=4,
            state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s"}},
            lastState={
                "terminated": {
                    "exitCode": 1,
                    "reason": "Error",
                    "message": "ValueError: model_type 'gpt2' is not supported",
                }
            },
        )
    ],
)
OOM = pod(
    phase="Running",
    containerStatuses=[
        container(
            restartCount=2,
            state={"waiting": {"reason": "CrashLoopBackOff"}},
            lastState={"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        )
    ],
)
IMAGE_PULL = pod(
    containerStatuses=[
        container(
            state={"waiting": {"reason": "ImagePullBackOff", "message": 'pull "nope:1" failed'}}
        )
    ]
)
DOWNLOAD_FAILED = pod(
    initContainerStatuses=[
        container(
            "model-fetch",
            restartCount=3,
            state={"waiting": {"reason": "CrashLoopBackOff"}},
            lastState={
                "terminated": {
                    "exitCode": 1,
                    "reason": "Error",
                    "message": "meta-llama/Llama-3.1-8B is gated: accept its terms",
                }
            },
        )
    ]
)
HEALTHY = pod(
    phase="Running",
    containerStatuses=[container(ready=True, state={"running": {"startedAt": "x"}})],
)
EVICTED = {
    "metadata": {"name": "chat-9"},
    "status": {"phase": "Failed", "reason": "Evicted", "message": "node was low on memory"},
}


@pytest.mark.parametrize(
    ("raw", "reason", "in_message"),
    [
        (UNSCHEDULABLE, "Unschedulable", "Insufficient nvidia.com/gpu"),
        (CRASH_LOOP, "CrashLoopBackOff", "model_type 'gpt2' is not supported"),
        (OOM, "OOMKilled", "raise spec.resources.limits.memory"),
        (IMAGE_PULL, "ImagePullBackOff", 'pull "nope:1" failed'),
        (DOWNLOAD_FAILED, "ModelDownloadFailed", "is gated"),
        (EVICTED, "PodFailed", "node was low on memory"),
        (
            pod(containerStatuses=[container(state={"waiting": {"reason": "ErrImagePull"}})]),
            "ImagePullBackOff",
            "cannot pull its image",
        ),
        (
            pod(
                containerStatuses=[
                    container(
                        state={
                            "waiting": {
                                "reason": "CreateContainerConfigError",
                                "message": 'secret "hf" not found',
                            }
                        }
                    )
                ]
            ),
            "CreateContainerConfigError",
            'secret "hf" not found',
        ),
    ],
)
def test_reads_the_problem_a_user_must_act_on(
    raw: dict[str, Any], reason: str, in_message: str
) -> None:
    problem = diagnose_pod(raw)
    assert problem is not None
    assert problem.reason == reason
    assert in_message in problem.message
    assert problem.pod == raw["metadata"]["name"]


@pytest.mark.parametrize(
    "raw",
    [
        HEALTHY,
        pod(),  # just created, nothing known yet
        pod(containerStatuses=[container(state={"waiting": {"reason": "ContainerCreating"}})]),
        {**CRASH_LOOP, "metadata": {"name": "old", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
    ],
)
def test_no_problem_where_there_is_none(raw: dict[str, Any]) -> None:
    assert diagnose_pod(raw) is None


def test_most_pressing_prefers_root_causes_and_counts_the_rest() -> None:
    pods = [
        {**CRASH_LOOP, "metadata": {"name": "a"}},
        {**OOM, "metadata": {"name": "b"}},
        HEALTHY,
        {**UNSCHEDULABLE, "metadata": {"name": "c"}},
    ]
    problem = most_pressing(pods)
    assert problem is not None
    assert (problem.reason, problem.pod) == ("OOMKilled", "b")
    assert problem.message.endswith("(2 more pods have problems)")
    assert most_pressing([HEALTHY]) is None


def test_long_crash_logs_are_clipped() -> None:
    noisy = pod(
        containerStatuses=[
            container(
                state={"waiting": {"reason": "CrashLoopBackOff"}},
                lastState={"terminated": {"exitCode": 1, "message": "x" * 5000 + "THE END"}},
            )
        ]
    )
    problem = diagnose_pod(noisy)
    assert problem is not None
    assert len(problem.message) <= 900
    assert "THE END" in problem.message  # the tail of the log is the part that matters
