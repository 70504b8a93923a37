"""LoRA adapters in the router's pure parts, exactly: the adapter's slot state on a replica, the
scoring that keeps adapter traffic where it is resident (then prefix, then load) without
thrashing --max-loras slots, which InferenceService each `model` id goes to, and the block hashes
of an adapter request."""

from __future__ import annotations

import logging
import math
import random

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvpilot.contract.block_hash import chain_block_hashes
from kvpilot.router.cli import parse_args
from kvpilot.router.cluster import Adapter, ServiceInfo, service_info
from kvpilot.router.config import RouterConfig, RoutingConfig
from kvpilot.router.index import BlockIndex
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.model_ids import claim_model_ids
from kvpilot.router.prompts import block_chain
from kvpilot.router.registry import Registry
from kvpilot.router.runtime import static_objects
from kvpilot.router.scoring import (
    Candidate,
    Slot,
    adapter_slot,
    choose,
    rendezvous,
    within_bound,
)

CONFIG = RoutingConfig()
NO_AFFINITY = RoutingConfig(lora_resident_weight=0.0, lora_free_slot_weight=0.0, lora_slack=0)


def cand(
    name: str,
    slot: Slot | None,
    matched: int = 0,
    in_flight: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
) -> Candidate:
    return Candidate(name, matched, in_flight, waiting, kv, slot)


def pick(candidates: list[Candidate], *, num_blocks: int = 8, tie_key: str = "lora-a"):
    return choose(
        candidates, num_blocks=num_blocks, tie_key=tie_key, session_id=None, config=CONFIG
    )


# ---- an adapter's state on a replica ----


def test_adapter_slot_reads_the_replicas_resident_adapters_and_slots() -> None:
    assert adapter_slot("a", ["b", "a"], 2) == "resident"
    assert adapter_slot("a", ["b"], 2) == "free"
    assert adapter_slot("a", ["b", "c"], 2) == "evict"
    assert adapter_slot("a", [], 0) == "off"  # adapters off on that engine


# ---- scoring ----


def test_a_replica_with_the_adapter_resident_is_preferred_to_a_free_slot_and_to_an_eviction() -> (
    None
):
    decision = pick([cand("full", "evict"), cand("free", "free"), cand("has", "resident")])
    assert (decision.name, decision.reason, decision.slot) == ("has", "adapter", "resident")


def test_residency_comes_before_a_whole_prefix_match_at_equal_load() -> None:
    # The prefix was computed under the adapter on `cold`, whose slot went to another adapter.
    decision = pick([cand("cold", "free", matched=8), cand("has", "resident")])
    assert (decision.name, decision.reason, decision.matched_blocks) == ("has", "adapter", 0)


def test_among_resident_replicas_the_longest_prefix_then_the_load_decides() -> None:
    decision = pick([cand("x", "resident", 2), cand("y", "resident", 6), cand("z", "free", 8)])
    assert (decision.name, decision.reason, decision.matched_blocks) == ("y", "adapter", 6)
    among = pick([cand("x", "resident", 2), cand("y", "resident", 6), cand("z", "evict", 1)])
    assert (among.name, among.reason) == ("y", "prefix")
    busy = pick([cand("x", "resident", in_flight=1, waiting=3), cand("y", "resident")])
    assert (busy.name, busy.reason, busy.slot) == ("y", "load", "resident")


def test_a_new_adapter_takes_a_free_slot_rather_than_evict_another() -> None:
    decision = pick([cand("full", "evict"), cand("free", "free", in_flight=1, waiting=1)])
    assert (decision.name, decision.reason, decision.slot) == ("free", "load", "free")


def test_a_busy_resident_replica_yields_to_an_idle_one_with_a_free_slot() -> None:
    # Saturated against idle: resident 7 - queue 2 - kv 1.8 = 3.2 < free 3.5.
    decision = pick([cand("has", "resident", waiting=8, kv=0.9), cand("idle", "free")])
    assert (decision.name, decision.slot) == ("idle", "free")
    # Less than saturated, residency holds (the bound spreads it before that).
    decision = pick([cand("has", "resident", waiting=8, kv=0.6), cand("idle", "free")])
    assert (decision.name, decision.slot) == ("has", "resident")
    # A whole prefix on a replica that would evict does not outweigh a free slot.
    decision = pick([cand("full", "evict", matched=8), cand("idle", "free")])
    assert (decision.name, decision.slot) == ("idle", "free")


def test_a_replica_reporting_no_slots_scores_as_one_that_would_evict() -> None:
    # Adapters off, or no step yet: below a free slot, not excluded.
    assert pick([cand("off", "off"), cand("free", "free", waiting=3)]).name == "free"
    tie = [cand("off", "off"), cand("full", "evict")]
    assert pick(tie, tie_key="k").name == max(["off", "full"], key=lambda n: rendezvous("k", n))
    assert pick([cand("off", "off"), cand("full", "evict", waiting=3)]).name == "off"
    # Within the bound only it and evicting replicas: the resident one may take the slack.
    assert pick([cand("off", "off"), cand("has", "resident", in_flight=2)]).name == "has"


def test_without_a_tokenized_prompt_an_adapter_still_goes_where_it_is_resident() -> None:
    decision = pick([cand("free", "free"), cand("has", "resident", in_flight=1)], num_blocks=0)
    assert (decision.name, decision.reason, decision.slot) == ("has", "fallback", "resident")


def test_a_base_model_request_scores_as_before() -> None:
    decision = pick([cand("a", None, 2), cand("b", None, 7)])
    assert (decision.name, decision.reason, decision.slot) == ("b", "prefix", None)


def test_an_adapter_request_may_exceed_the_bound_by_the_slack_only_to_avoid_an_eviction() -> None:
    # `has` is one request above the bound; the others would evict: `has` takes it.
    candidates = [cand("has", "resident", in_flight=2), cand("x", "evict"), cand("y", "evict")]
    assert [c.name for c in within_bound(candidates, 1.25)] == ["x", "y"]
    assert pick(candidates).name == "has"
    # With a free slot within the bound there is no eviction to avoid: the bound holds.
    candidates[1] = cand("x", "free")
    assert pick(candidates).name == "x"
    # Beyond the slack (4 above the bound) the bound holds whatever it costs.
    far = [cand("has", "resident", in_flight=9), cand("x", "evict"), cand("y", "evict")]
    assert pick(far).slot == "evict"


def test_weights_and_slack_are_validated() -> None:
    with pytest.raises(ValueError, match="lora_free_slot_weight"):
        RoutingConfig(lora_resident_weight=1.0, lora_free_slot_weight=2.0)
    with pytest.raises(ValueError, match="lora_slack"):
        RoutingConfig(lora_slack=-1)
    with pytest.raises(ValueError, match=">= 0"):
        RoutingConfig(lora_resident_weight=-1.0, lora_free_slot_weight=-2.0)


def simulate(
    config: RoutingConfig,
    *,
    weights: list[float],
    finish: float,
    slots: int = 2,
    steps: int = 2000,
) -> tuple[int, int, float]:
    """Adapter requests (adapter i drawn with weights[i]) to 3 replicas of `slots` slots, each
    loading a missing adapter into its least recently used slot, while requests finish at
    random. Returns the evictions, the most the bound-plus-slack was ever exceeded by (must stay
    <= 0), and the time-averaged max/mean in-flight ratio."""
    rng = random.Random(7)
    adapters = [f"a{i}" for i in range(len(weights))]
    resident: dict[str, list[str]] = {n: [] for n in ("r0", "r1", "r2")}
    in_flight = dict.fromkeys(resident, 0)
    evictions, worst, imbalance = 0, -math.inf, 0.0
    for _ in range(steps):
        while rng.random() < finish and any(in_flight.values()):
            in_flight[rng.choice([n for n, v in in_flight.items() if v])] -= 1
        adapter = rng.choices(adapters, weights)[0]
        candidates = [
            cand(n, adapter_slot(adapter, resident[n], slots), in_flight=in_flight[n])
            for n in resident
        ]
        cap = math.ceil(config.load_factor * (sum(in_flight.values()) + 1) / 3)
        decision = choose(candidates, num_blocks=4, tie_key=adapter, session_id=None, config=config)
        held = resident[decision.name]
        if adapter in held:
            held.remove(adapter)
        elif len(held) == slots:
            held.pop(0)
            evictions += 1
        held.append(adapter)
        in_flight[decision.name] += 1
        worst = max(worst, in_flight[decision.name] - cap - config.lora_slack)
        imbalance += max(in_flight.values()) / (sum(in_flight.values()) / 3)
    return evictions, int(worst), imbalance / steps


@pytest.mark.parametrize("finish", [0.45, 0.7], ids=["loaded", "near-idle"])
def test_adapter_traffic_does_not_thrash_the_slots(finish: float) -> None:
    """Six adapters on 3 replicas of 2 slots: they fit, so once placed they stay. Without the
    affinity nearly every request evicts one; with it, a few percent at most."""
    for weights, ratio in (([1.0] * 6, 20), ([1 / (i + 1) for i in range(6)], 3)):
        evictions, worst, imbalance = simulate(CONFIG, weights=weights, finish=finish)
        baseline, _, _ = simulate(NO_AFFINITY, weights=weights, finish=finish)
        assert baseline > 500
        assert evictions * ratio < baseline, (weights, evictions, baseline)
        assert worst <= 0  # never beyond the bound plus the slack
        if finish < 0.5:  # loaded: the bound keeps it near balance (near idle, 2 of 3 is 2x)
            assert imbalance < 1.4


def test_one_hot_adapter_spreads_over_the_replicas_when_they_are_loaded() -> None:
    """Resident on one replica of three; every request is for it."""
    rng = random.Random(3)
    resident = {"r0": ["hot"], "r1": [], "r2": []}
    in_flight = dict.fromkeys(resident, 0)
    # Idle (each request finishes before the next): it stays where it is resident.
    for _ in range(50):
        candidates = [
            cand(n, adapter_slot("hot", resident[n], 2), in_flight=0, waiting=0) for n in resident
        ]
        assert pick(candidates, tie_key="hot").name == "r0"
    # Loaded: requests pile up, the others take it into free slots and share the traffic.
    taken = dict.fromkeys(resident, 0)
    for _ in range(600):
        if rng.random() < 0.3 and any(in_flight.values()):
            in_flight[rng.choice([n for n, v in in_flight.items() if v])] -= 1
        candidates = [cand(n, adapter_slot("hot", resident[n], 2), in_flight=in_flight[n])
                      for n in resident]  # fmt: skip
        name = pick(candidates, tie_key="hot").name
        if "hot" not in resident[name]:
            resident[name].append("hot")
        in_flight[name] += 1
        taken[name] += 1
    assert all(resident[n] == ["hot"] for n in resident)
    assert min(taken.values()) > 600 / 3 * 0.8, taken


# ---- which service a model id goes to ----


def isvc(name: str, served: str, adapters: list, *, created: str, namespace: str = "ns") -> dict:
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": {"model": {"servedName": served, "uri": "hf://org/base"}, "adapters": adapters},
    }


def test_service_info_reads_spec_adapters_and_drops_what_cannot_be_a_model_id() -> None:
    info = service_info(
        isvc(
            "chat", "base",
            [
                {"name": "sql", "uri": "hf://org/sql"},
                {"name": "-bad-", "uri": "x"},  # not a NAME_PATTERN name
                {"name": "base", "uri": "x"},  # the served model's own name
                {"name": "sql", "uri": "hf://org/other"},  # the first one wins
                "junk",
                {"uri": "hf://org/nameless"},
                {"name": "chat.v2", "uri": "s3://b/chat"},
            ],
            created="t",
        )
    )  # fmt: skip
    assert info.adapters == (Adapter("sql", "hf://org/sql"), Adapter("chat.v2", "s3://b/chat"))
    assert service_info(isvc("x", "y", None, created="t")).adapters == ()  # type: ignore[arg-type]


def info(name: str, model: str, adapters: tuple[str, ...], created: str) -> ServiceInfo:
    return ServiceInfo(
        "ns", name, model, False, created, adapters=tuple(Adapter(a, "") for a in adapters)
    )


def test_a_contested_model_id_goes_to_one_service_whatever_the_order_of_the_listing() -> None:
    services = [
        info("old", "base-a", ("shared", "only-old"), "2026-01-01T00:00:00Z"),
        info("new", "base-b", ("shared", "base-a"), "2026-02-01T00:00:00Z"),
        # Newer than `old` and serving its adapter's name: served names are claimed first.
        info("late", "only-old", ("late-lora",), "2026-03-01T00:00:00Z"),
        # Loses its served model name: serves nothing, not its adapters either.
        info("twin", "base-b", ("twin-lora",), "2026-04-01T00:00:00Z"),
    ]
    for order in (services, services[::-1]):
        claims = claim_model_ids(order)
        assert {m: s.name for m, s in claims.models.items()} == {
            "base-a": "old", "base-b": "new", "only-old": "late",
        }  # fmt: skip
        assert {a: s.name for a, (s, _) in claims.adapters.items()} == {
            "shared": "old", "late-lora": "late",
        }  # fmt: skip
        assert claims.conflicts == {
            ("shared", ("ns", "old"), ("ns", "new")),
            ("base-a", ("ns", "old"), ("ns", "new")),
            ("only-old", ("ns", "late"), ("ns", "old")),
            ("base-b", ("ns", "new"), ("ns", "twin")),
        }


async def test_the_registry_routes_adapters_to_their_service_and_logs_a_conflict_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with httpx.AsyncClient() as client:
        registry = Registry(
            RouterConfig(namespaces=("ns",)), client, RouterMetrics(CollectorRegistry())
        )
    old = isvc("old", "base-a", [{"name": "sql", "uri": "hf://o/sql"}], created="t1")
    new = isvc("new", "base-b", [{"name": "sql", "uri": "hf://n/sql"}], created="t2")
    with caplog.at_level(logging.WARNING, logger="kvpilot.router"):
        registry.services_listed("ns", [new, old])
        registry.service_event("MODIFIED", new)  # the same conflict: not logged again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["model 'sql' is claimed by both ns/old and ns/new: routing it to ns/old"]
    route = registry.resolve("sql")
    assert route is not None and route.pool is registry.pools["base-a"]
    assert route.adapter == Adapter("sql", "hf://o/sql")
    base = registry.resolve("base-b")
    assert base is not None and base.pool is registry.pools["base-b"] and base.adapter is None
    assert registry.resolve("nope") is None
    # The winner goes: the other service has it from the next event on.
    registry.service_event("DELETED", old)
    moved = registry.resolve("sql")
    assert moved is not None and moved.pool is registry.pools["base-b"]
    assert moved.adapter == Adapter("sql", "hf://n/sql")
    assert registry.resolve("base-a") is None
    # Removed from the spec: gone at once.
    registry.service_event("MODIFIED", isvc("new", "base-b", [], created="t2"))
    assert registry.resolve("sql") is None and set(registry.routes) == {"base-b"}


# ---- the hashes of an adapter request ----


def test_an_adapter_request_hashes_its_blocks_with_the_adapter_and_a_base_request_without() -> None:
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks of 4 before the last token
    base = block_chain(prompt, 4, None)
    sql = block_chain(prompt, 4, None, "sql")
    assert base == chain_block_hashes(prompt[:40], 4, None, lora_name=None) and len(base) == 10
    assert sql == chain_block_hashes(prompt[:40], 4, None, lora_name="sql")
    chat = block_chain(prompt, 4, "salt", "chat")
    assert chat == chain_block_hashes(prompt[:40], 4, "salt", lora_name="chat")
    # No block is shared between the base model and an adapter, or between two adapters.
    assert not (set(base) & set(sql)) and not (set(sql) & set(block_chain(prompt, 4, None, "x")))
    # So a replica holding the base model's blocks of this prompt holds none of the adapter's.
    index = BlockIndex(1 << 10)
    index.reset(base)
    assert (index.matched_blocks(base), index.matched_blocks(sql)) == (10, 0)


def test_static_models_take_their_adapters_from_the_command_line() -> None:
    config = parse_args(["--static", "m=http://10.0.0.7:8000", "--static-adapters", "m=sql,chat"])
    assert config.static_adapters == (("m", ("sql", "chat")),)
    services, _ = static_objects(config.static_models, dict(config.static_adapters))
    assert service_info(services[0]).adapters == (Adapter("sql", ""), Adapter("chat", ""))
    with pytest.raises(ValueError, match="adapter name '-x'"):
        parse_args(["--static", "m=http://10.0.0.7:8000", "--static-adapters", "m=-x"])
    with pytest.raises(ValueError, match="not a static model"):
        parse_args(["--static", "m=http://10.0.0.7:8000", "--static-adapters", "n=sql"])
