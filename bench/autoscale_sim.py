"""Replays traffic traces through a queue model of replicas, driven by the real decide().

Not a test: a way to see (and tune) how the autoscaler behaves over minutes of traffic.

Model, one step per second: Poisson arrivals at rate load(t) join one queue spread evenly over the
Ready replicas (ideal load balancing); each replica runs up to MAX_BATCH requests at once, each
taking SERVICE_S seconds (so 4 req/s per replica flat out); KV-cache usage = running / MAX_BATCH.
At the default targets (queue 5, KV 80 %) one replica is "at target" at 3.2 req/s. A new replica
is Ready COLD_START_S after the decision; a removed one's running requests go back to the queue.
Every interval the autoscaler sees per-pod gauges (2 % of scrapes fail at random) and decides.

Run: python bench/autoscale_sim.py [--out bench/autoscale_sim.png]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import matplotlib
import numpy as np

matplotlib.use("Agg")  # before pyplot is imported: no display here
import matplotlib.pyplot as plt

from kvpilot.operator.autoscaling import (
    AutoscalerState,
    AutoscalingPolicy,
    Observations,
    PodMetrics,
    PodSample,
    decide,
)

MAX_BATCH = 16
SERVICE_S = 4.0
COLD_START_S = 60.0
SCRAPE_FAILURE_RATE = 0.02
MIN_REPLICAS, MAX_REPLICAS = 1, 12
SPIKE_AT_S = 300.0


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: int
    load: Callable[[float], float]  # offered load in requests/s at time t
    spike_at_s: float | None = None  # a step change, for the reaction-time figure


def burst(t: float) -> float:
    return 25.0 if SPIKE_AT_S <= t < SPIKE_AT_S + 300 else 5.0


def ramp(t: float) -> float:
    if t < 1200:
        return 2.0 + 28.0 * t / 1200
    if t < 1500:
        return 30.0
    return max(2.0, 30.0 - 28.0 * (t - 1500) / 600)


def daily_wave(t: float) -> float:
    # One "day" compressed into an hour: night trough 3 req/s, midday peak 25 req/s.
    return 3.0 + 22.0 * (1 - math.cos(2 * math.pi * t / 3600)) / 2


TRACES = (
    Trace("burst (5 -> 25 req/s for 5 min)", 1500, burst, spike_at_s=SPIKE_AT_S),
    Trace("ramp (2 -> 30 -> 2 req/s)", 2400, ramp),
    Trace("daily wave (3..25 req/s, 1 h period)", 3600, daily_wave),
)


@dataclass
class Run:
    times: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)
    replicas: list[int] = field(default_factory=list)  # the Deployment's replicas
    ready: list[int] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    saturation: list[float] = field(default_factory=list)  # mean over Ready pods
    decisions: list[tuple[float, int, int, str]] = field(default_factory=list)  # t, from, to, why
    arrived: float = 0.0


def simulate(trace: Trace, policy: AutoscalingPolicy, seed: int = 0) -> Run:
    rng = np.random.default_rng(seed)
    run = Run()
    # Start in steady state: as many Ready replicas as the initial load needs at target.
    per_replica = MAX_BATCH / SERVICE_S * policy.target_kv_cache_utilization
    ready_pods = replicas = max(MIN_REPLICAS, math.ceil(trace.load(0.0) / per_replica))
    starting: list[float] = []  # times at which starting replicas become Ready
    backlog = running = 0
    state = AutoscalerState()
    next_tick = policy.interval_s
    for second in range(trace.duration_s):
        t = float(second)
        arrivals = int(rng.poisson(trace.load(t)))
        run.arrived += arrivals
        newly_ready = [s for s in starting if s <= t]
        starting = [s for s in starting if s > t]
        ready_pods += len(newly_ready)
        # Serve for one second: each running request finishes with probability 1/SERVICE_S
        # (exponential-like lengths, as chat traffic has), then the queue refills the batch.
        running -= int(rng.binomial(running, 1 / SERVICE_S))
        backlog += arrivals
        capacity = MAX_BATCH * ready_pods
        admitted = min(backlog, max(0, capacity - running))
        running += admitted
        backlog -= admitted
        if running > capacity:  # replicas went away: their requests queue again
            backlog += running - capacity
            running = capacity

        per_pod_waiting = _split(rng, backlog, ready_pods)
        per_pod_running = _split(rng, running, ready_pods)
        saturations = [
            policy.saturation(w, min(r / MAX_BATCH, 1.0))
            for w, r in zip(per_pod_waiting, per_pod_running, strict=True)
        ]
        if t >= next_tick:
            next_tick += policy.interval_s
            pods = tuple(
                PodSample(
                    f"pod-{i}",
                    None
                    if rng.random() < SCRAPE_FAILURE_RATE
                    else PodMetrics(w, min(r / MAX_BATCH, 1.0), r),
                )
                for i, (w, r) in enumerate(zip(per_pod_waiting, per_pod_running, strict=True))
            )
            observations = Observations(replicas, pods, num_starting=len(starting))
            decision = decide(policy, observations, state, now=t)
            state = decision.state
            if decision.replicas > replicas:
                starting += [t + COLD_START_S] * (decision.replicas - replicas)
            elif decision.replicas < replicas:
                for _ in range(replicas - decision.replicas):
                    if starting:
                        starting.pop()  # the ReplicaSet removes not-yet-Ready pods first
                    else:
                        ready_pods -= 1
            if decision.replicas != replicas:
                run.decisions.append((t, replicas, decision.replicas, decision.reason))
            replicas = decision.replicas

        run.times.append(t)
        run.offered.append(trace.load(t))
        run.replicas.append(replicas)
        run.ready.append(ready_pods)
        run.waiting.append(backlog)
        run.saturation.append(sum(saturations) / len(saturations) if saturations else 0.0)
    return run


def _split(rng: np.random.Generator, total: float, num_pods: int) -> list[float]:
    """Spreads a total over pods with a little imbalance, as a real load balancer would."""
    if num_pods == 0:
        return []
    shares = rng.dirichlet(np.full(num_pods, 50.0))
    return [float(total * share) for share in shares]


@dataclass(frozen=True)
class Figures:
    reaction_s: list[float]  # from each capacity shortfall (or the spike) to the scale-up decision
    num_direction_changes: int
    num_scale_decisions: int
    over_target_s: float
    mean_queue_delay_s: float
    max_waiting: float
    replica_hours: float


def figures(trace: Trace, run: Run, policy: AutoscalingPolicy) -> Figures:
    ups = [t for t, before, after, _ in run.decisions if after > before]
    reaction: list[float] = []
    if trace.spike_at_s is not None:
        reaction = [min(t for t in ups if t >= trace.spike_at_s) - trace.spike_at_s]
    else:
        # A shortfall starts when the offered load needs more replicas than are provisioned
        # (beyond the tolerance band); it ends with the next scale-up decision.
        per_replica = MAX_BATCH / SERVICE_S * policy.target_kv_cache_utilization
        short_since: float | None = None
        for t, offered, replicas in zip(run.times, run.offered, run.replicas, strict=True):
            is_short = offered > replicas * per_replica * (1 + policy.tolerance)
            if is_short and short_since is None:
                short_since = t
            if short_since is not None and t in ups:
                reaction.append(t - short_since)
                short_since = None
    directions = [1 if after > before else -1 for _, before, after, _ in run.decisions]
    changes = sum(1 for a, b in itertools.pairwise(directions) if a != b)
    over = sum(1 for s in run.saturation if s > 1 + policy.tolerance)
    return Figures(
        reaction_s=reaction,
        num_direction_changes=changes,
        num_scale_decisions=len(run.decisions),
        over_target_s=float(over),
        mean_queue_delay_s=sum(run.waiting) / max(run.arrived, 1.0),
        max_waiting=max(run.waiting),
        replica_hours=sum(run.replicas) / 3600,
    )


def plot(results: list[tuple[Trace, Run]], out: str) -> None:
    fig, axes = plt.subplots(3, len(results), figsize=(6 * len(results), 9), sharex="col")
    for column, (trace, run) in enumerate(results):
        minutes = [t / 60 for t in run.times]
        ax_load, ax_replicas, ax_queue = axes[0][column], axes[1][column], axes[2][column]
        ax_load.plot(minutes, run.offered, color="tab:blue", label="offered load")
        per_replica = MAX_BATCH / SERVICE_S * 0.8
        ax_load.plot(
            minutes,
            [r * per_replica for r in run.ready],
            color="tab:green",
            linestyle="--",
            label="Ready capacity at target",
        )
        ax_load.set_title(trace.name)
        ax_load.set_ylabel("requests / s")
        ax_load.legend(loc="best", fontsize=8)
        ax_replicas.step(minutes, run.replicas, where="post", color="tab:orange", label="replicas")
        ax_replicas.step(minutes, run.ready, where="post", color="tab:green", label="Ready")
        ax_replicas.set_ylabel("replicas")
        ax_replicas.set_ylim(0, MAX_REPLICAS + 1)
        ax_replicas.legend(loc="best", fontsize=8)
        (waiting_line,) = ax_queue.plot(
            minutes, run.waiting, color="tab:red", label="waiting requests"
        )
        ax_queue.set_ylabel("waiting requests")
        ax_queue.set_xlabel("minutes")
        ax_sat = ax_queue.twinx()
        (saturation_line,) = ax_sat.plot(
            minutes, run.saturation, color="gray", linewidth=0.6, label="mean saturation"
        )
        ax_sat.axhline(1.0, color="gray", linestyle=":")
        ax_sat.set_ylabel("mean saturation (1 = target)", color="gray")
        ax_sat.set_ylim(0, max(3.0, min(max(run.saturation), 20.0)))
        ax_queue.legend(handles=[waiting_line, saturation_line], loc="upper right", fontsize=8)
    fig.suptitle(
        f"kvpilot autoscaler, default policy (interval 5 s, cold start {COLD_START_S:g} s,"
        f" {MAX_BATCH / SERVICE_S:g} req/s per replica flat out, 3.2 at target; seed 0)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/autoscale_sim.png")
    parser.add_argument("--seeds", type=int, default=8, help="runs per trace (plot: seed 0)")
    parser.add_argument("--stable-window", type=float, default=None, help="override, seconds")
    args = parser.parse_args()
    extra = {} if args.stable_window is None else {"stable_window_s": args.stable_window}
    policy = AutoscalingPolicy(min_replicas=MIN_REPLICAS, max_replicas=MAX_REPLICAS, **extra)
    print(f"policy: {policy}")
    print(
        f"model: {MAX_BATCH / SERVICE_S:g} req/s per replica flat out, cold start"
        f" {COLD_START_S:g} s, {100 * SCRAPE_FAILURE_RATE:g} % failed scrapes;"
        f" {args.seeds} seeds per trace"
    )
    plotted = []
    for trace in TRACES:
        runs = [simulate(trace, policy, seed) for seed in range(args.seeds)]
        found = [figures(trace, run, policy) for run in runs]
        plotted.append((trace, runs[0]))
        reactions = [r for f in found for r in f.reaction_s]
        changes = [f.num_direction_changes for f in found]
        print(f"\n{trace.name}")
        if reactions:
            print(
                "  reaction, shortfall -> scale-up decision:"
                f" median {statistics.median(reactions):.0f} s, max {max(reactions):.0f} s"
                f" ({len(reactions)} shortfalls)"
            )
        else:
            print("  reaction: no capacity shortfall at all")
        num_decisions = statistics.mean(f.num_scale_decisions for f in found)
        print(
            f"  direction changes per run: mean {statistics.mean(changes):.1f}, max {max(changes)}"
            f" (scale decisions per run: {num_decisions:.1f})"
        )
        over = statistics.mean(100 * f.over_target_s / trace.duration_s for f in found)
        print(f"  time over target (mean saturation > {1 + policy.tolerance:g}): {over:.1f} %")
        print(
            f"  mean queueing delay {statistics.mean(f.mean_queue_delay_s for f in found):.2f} s,"
            f" max waiting {max(f.max_waiting for f in found):.0f},"
            f" replica-hours {statistics.mean(f.replica_hours for f in found):.2f}"
        )
        print(
            "  seed 0 decisions: "
            + ", ".join(f"{t / 60:.1f}m {a}->{b}" for t, a, b, _ in runs[0].decisions)
        )
    plot(plotted, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
