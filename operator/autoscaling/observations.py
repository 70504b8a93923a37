"""What one autoscaler tick sees: each Ready pod's engine metrics, and the pods on their way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PodMetrics:
    """The engine gauges the autoscaler reads from one pod's /metrics."""

    num_waiting: float
    kv_cache_usage: float  # fraction in [0, 1], like vLLM's kv_cache_usage_perc
    num_running: float | None = None  # reported in status only; not part of saturation


@dataclass(frozen=True)
class PodSample:
    """A Ready pod and what its scrape returned; metrics None means the scrape failed."""

    name: str
    metrics: PodMetrics | None


@dataclass(frozen=True)
class Observations:
    """Input of decide().

    current_replicas: the Deployment's spec.replicas now.
    ready_pods: every Ready, not terminating pod, reporting or not.
    num_starting: replicas on their way: pods created but not Ready yet (within the startup grace)
        plus replicas the ReplicaSet has not created yet. They count as capacity, not as load.
    num_held: requests kvpilot routers hold for this service (no routable replica yet): a queue
        no engine reports, so it adds to the queue-depth signal.
    router_in_flight: requests the routers have sent to its replicas and not seen finish; the
        engines count them already (running or waiting), so it is reported, never added.
        None when no router was scraped.
    """

    current_replicas: int
    ready_pods: tuple[PodSample, ...]
    num_starting: int = 0
    num_held: float = 0.0
    router_in_flight: float | None = None

    def __post_init__(self) -> None:
        if self.current_replicas < 0 or self.num_starting < 0:
            raise ValueError(
                f"replica counts must be >= 0, got current_replicas={self.current_replicas},"
                f" num_starting={self.num_starting}"
            )
        if self.num_held < 0:
            raise ValueError(f"num_held must be >= 0, got {self.num_held}")

    @property
    def num_ready(self) -> int:
        return len(self.ready_pods)

    @property
    def reporting(self) -> tuple[PodMetrics, ...]:
        return tuple(pod.metrics for pod in self.ready_pods if pod.metrics is not None)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(pod.name for pod in self.ready_pods if pod.metrics is None)
