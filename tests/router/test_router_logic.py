"""The router's pure parts, exactly: scoring with the bounded-load rule, the block index, the
event-stream bookkeeping of a replica, reading Kubernetes objects, the hold queue, and when a
loaded tokenizer is kept."""

from __future__ import annotations

import asyncio
import math
import random

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvpilot.contract.block_hash import HASH_SCHEME
from kvpilot.contract.kv_events import KvHeartbeat, KvSnapshot, KvUpdate, Load
from kvpilot.router.cluster import endpoint, service_info
from kvpilot.router.config import HoldConfig, RouterConfig, RoutingConfig
from kvpilot.router.hold import HoldFull, HoldQueue, HoldTimeout
from kvpilot.router.index import BlockIndex
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.registry import Registry
from kvpilot.router.replica import Replica, StreamGap
from kvpilot.router.scoring import Candidate, choose, rendezvous, within_bound

CONFIG = RoutingConfig()


def cand(name: str, matched: int = 0, in_flight: int = 0, waiting: int = 0, kv: float = 0.0):
    return Candidate(name, matched, in_flight, waiting, kv)


def test_the_longest_held_prefix_wins_when_load_is_even() -> None:
    decision = choose(
        [cand("a", 2), cand("b", 7), cand("c", 0)],
        num_blocks=8, tie_key="k", session_id=None, config=CONFIG,
    )  # fmt: skip
    assert (decision.name, decision.reason, decision.matched_blocks) == ("b", "prefix", 7)


def test_no_replica_exceeds_the_bound_whatever_each_holds() -> None:
    rng = random.Random(1)
    names = "abcd"
    in_flight = dict.fromkeys(names, 0)
    for _ in range(2000):
        if rng.random() < 0.45 and any(in_flight.values()):
            in_flight[rng.choice([n for n, v in in_flight.items() if v])] -= 1
            continue
        candidates = [
            cand(n, rng.randint(0, 8), v, rng.randint(0, 3), rng.random())
            for n, v in in_flight.items()
        ]
        total = sum(in_flight.values()) + 1
        picked = choose(candidates, num_blocks=8, tie_key="k", session_id=None, config=CONFIG)
        in_flight[picked.name] += 1
        assert in_flight[picked.name] <= math.ceil(1.25 * total / len(names))


def test_bounded_load_sends_a_hot_prefix_elsewhere() -> None:
    # b holds everything but already has more than 1.25x the mean in flight.
    candidates = [cand("a", 0, in_flight=1), cand("b", 8, in_flight=5), cand("c", 0, in_flight=1)]
    assert [c.name for c in within_bound(candidates, 1.25)] == ["a", "c"]
    decision = choose(candidates, num_blocks=8, tie_key="k", session_id=None, config=CONFIG)
    assert decision.name in ("a", "c") and decision.reason == "load"


def test_no_replica_ever_exceeds_the_bound_under_one_hot_prefix() -> None:
    rng = random.Random(0)
    in_flight = {"a": 0, "b": 0, "c": 0}
    for _ in range(2000):
        if rng.random() < 0.4 and any(in_flight.values()):
            busy = [n for n, v in in_flight.items() if v]
            in_flight[rng.choice(busy)] -= 1
            continue
        candidates = [cand(n, 8 if n == "b" else 0, v) for n, v in in_flight.items()]
        total = sum(in_flight.values()) + 1
        picked = choose(candidates, num_blocks=8, tie_key="k", session_id=None, config=CONFIG)
        in_flight[picked.name] += 1
        assert in_flight[picked.name] <= math.ceil(1.25 * total / 3)


def test_ties_follow_the_rendezvous_hash_of_the_first_block() -> None:
    candidates = [cand("a"), cand("b"), cand("c")]
    for key in ("1", "2", "3", "4"):
        expected = max("abc", key=lambda n: rendezvous(key, n))
        assert (
            choose(candidates, num_blocks=4, tie_key=key, session_id=None, config=CONFIG).name
            == expected
        )
    # Without a tokenized prompt: least loaded, `fallback`.
    fallback = choose(
        [cand("a", in_flight=2), cand("b", in_flight=1), cand("c", in_flight=2)],
        num_blocks=0, tie_key="", session_id=None, config=CONFIG,
    )  # fmt: skip
    assert (fallback.name, fallback.reason) == ("b", "fallback")


def test_session_affinity_is_stable_and_yields_to_the_bound() -> None:
    candidates = [cand("a"), cand("b"), cand("c")]
    favourite = max("abc", key=lambda n: rendezvous("sess", n))
    decision = choose(candidates, num_blocks=4, tie_key="k", session_id="sess", config=CONFIG)
    assert (decision.name, decision.reason) == (favourite, "affinity")
    loaded = [cand(n, in_flight=6 if n == favourite else 0) for n in "abc"]
    assert (
        choose(loaded, num_blocks=4, tie_key="k", session_id="sess", config=CONFIG).name
        != favourite
    )


def test_block_index_matches_only_a_leading_run_and_is_bounded() -> None:
    index = BlockIndex(max_blocks=3)
    index.reset([10, 11, 13])
    assert index.matched_blocks([10, 11, 12, 13]) == 2
    assert index.matched_blocks([12, 10]) == 0
    index.store([14])
    assert index.is_truncated and len(index) == 3
    index.remove([10])
    assert index.matched_blocks([10, 11]) == 0
    other = BlockIndex(10)
    other.reset([13, 11])
    assert BlockIndex(10).digest() != other.digest()
    twin = BlockIndex(10)
    twin.reset([11, 13])
    assert twin.digest() == other.digest()


def test_replica_applies_a_snapshot_then_only_consecutive_deltas() -> None:
    replica = Replica("p", "http://x", BlockIndex(100))
    with pytest.raises(StreamGap):
        replica.apply(KvUpdate(1, [1], [], Load()), now=1.0)
    replica.apply(KvSnapshot(4, "m", 16, HASH_SCHEME, [1, 2], Load(1, 2, 0.5)), now=1.0)
    assert replica.is_routable(now=1.5, dead_after_s=2.0)
    replica.apply(KvUpdate(5, [3], [1], Load(0, 1, 0.1)), now=2.0)
    replica.apply(KvHeartbeat(5, Load(0, 0, 0.1)), now=3.0)
    assert replica.index.hashes == {2, 3} and replica.load == Load(0, 0, 0.1)
    assert not replica.is_routable(now=5.5, dead_after_s=2.0)  # silent for too long
    with pytest.raises(StreamGap):
        replica.apply(KvUpdate(7, [9], [], Load()), now=4.0)  # 6 is missing
    with pytest.raises(StreamGap):
        replica.apply(KvHeartbeat(6, Load()), now=4.0)  # a delta passed us by
    replica.desync()
    assert replica.index.hashes == set() and not replica.is_routable(4.0, 2.0)
    # A request that could not reach it takes it out of rotation for dead_after_s (by then its
    # stream has told whether it is gone), or until a fresh snapshot.
    replica.apply(KvSnapshot(9, "m", 16, HASH_SCHEME, [], Load()), now=10.0)
    replica.failed_at = 10.5
    assert not replica.is_routable(now=11.0, dead_after_s=2.0)
    replica.apply(KvHeartbeat(9, Load()), now=12.4)
    assert replica.is_routable(now=12.5, dead_after_s=2.0)
    replica.failed_at = 12.6
    replica.apply(KvSnapshot(1, "m", 16, HASH_SCHEME, [], Load()), now=12.7)
    assert replica.is_routable(now=12.8, dead_after_s=2.0)
    with pytest.raises(ValueError, match="hashes blocks with"):
        replica.apply(KvSnapshot(1, "m", 16, "python-hash", [], Load()), now=1.0)


def pod(ready: str = "True", deleting: bool = False, ip: str | None = "10.0.0.7") -> dict:
    meta: dict = {
        "name": "isvc-abc",
        "namespace": "ns",
        "labels": {
            "app.kubernetes.io/name": "kvpilot-engine",
            "app.kubernetes.io/instance": "isvc",
        },
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 9000}]}]
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]},
    }


def test_pods_and_services_as_the_router_reads_them() -> None:
    found = endpoint(pod())
    assert found is not None
    assert (found.service, found.url, found.is_ready) == ("isvc", "http://10.0.0.7:9000", True)
    assert endpoint(pod(ready="False")).is_ready is False  # type: ignore[union-attr]
    # Being deleted: out of rotation before its engine drains, though still Ready.
    assert endpoint(pod(deleting=True)).is_ready is False  # type: ignore[union-attr]
    assert endpoint(pod(ip=None)) is None
    assert endpoint({"metadata": {"name": "x", "labels": {}}}) is None
    service = service_info(
        {
            "metadata": {
                "name": "chat", "namespace": "ns",
                "annotations": {"kvpilot.dev/hold-timeout-seconds": "600"},
            },
            "spec": {"model": {"servedName": "org/chat"}, "autoscaling": {"minReplicas": 0}},
        }
    )  # fmt: skip
    assert (service.model, service.may_scale_to_zero, service.hold_timeout_s) == (
        "org/chat",
        True,
        600.0,
    )
    plain = service_info(
        {
            "metadata": {"name": "chat", "annotations": {"kvpilot.dev/hold-timeout-seconds": "x"}},
            "spec": {},
        }
    )
    assert (plain.model, plain.may_scale_to_zero, plain.hold_timeout_s) == ("chat", False, None)


async def test_hold_queue_releases_in_order_bounds_and_times_out() -> None:
    queue = HoldQueue(HoldConfig(max_held_per_model=3, timeout_s=5))
    order: list[int] = []

    async def held(i: int) -> None:
        await queue.wait()
        order.append(i)

    tasks = [asyncio.create_task(held(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert len(queue) == 3
    with pytest.raises(HoldFull):
        await queue.wait()
    queue.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and len(queue) == 0
    with pytest.raises(HoldTimeout):
        await queue.wait(timeout_s=0.05)
    assert len(queue) == 0


async def test_a_tokenizer_is_kept_while_the_weights_stay_and_dropped_when_they_change() -> None:
    def isvc(uri: str, max_replicas: int = 2) -> dict:
        return {
            "metadata": {"name": "chat", "namespace": "ns", "creationTimestamp": "t"},
            "spec": {
                "model": {"uri": uri},
                "autoscaling": {"minReplicas": 0, "maxReplicas": max_replicas},
            },
        }

    async with httpx.AsyncClient() as client:
        registry = Registry(
            RouterConfig(namespaces=("ns",)), client, RouterMetrics(CollectorRegistry())
        )
    registry.services_listed("ns", [isvc("hf://org/a")])
    pool = registry.pools["chat"]
    tokenizer = object()  # what a load left there
    pool.tokenizer, pool.tokenizer_uri = tokenizer, "hf://org/a"
    # At zero replicas and after an unrelated spec change: kept.
    registry.service_event("MODIFIED", isvc("hf://org/a", max_replicas=4))
    assert registry.pools["chat"] is pool and pool.tokenizer is tokenizer
    # Other weights: loaded afresh from the next replica.
    registry.service_event("MODIFIED", isvc("hf://org/b"))
    assert pool.tokenizer is None and pool.tokenizer_uri == "hf://org/b"


def test_decisions_are_counted_per_model_and_reason() -> None:
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    for reason, tokens in (("prefix", 224), ("prefix", 32), ("load", 0)):
        metrics.decided("m", reason, tokens)
    metrics.decided("other", "prefix", 16)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvpilot_router_decisions_total", model="m", reason="prefix") == 2
    assert value("kvpilot_router_decisions_total", model="m", reason="load") == 1
    assert value("kvpilot_router_decisions_total", model="other", reason="prefix") == 1
    assert value("kvpilot_router_prefix_match_tokens_count", model="m") == 3
    assert value("kvpilot_router_prefix_match_tokens_sum", model="m") == 256
    assert value("kvpilot_router_prefix_match_tokens_bucket", model="m", le="16.0") == 1
