"""The pure adapter sync (operator/adapters.py): the spec's adapters as the engine gets them,
the loads and unloads that bring each Ready replica to them, and the status they leave."""

from __future__ import annotations

from typing import Any

import pytest

from kvpilot.operator.adapters import (
    FAILED_RETRY_SECONDS,
    MAX_MESSAGE_CHARS,
    Load,
    Result,
    Unload,
    WantedAdapter,
    build_report,
    engine_path,
    format_time_s,
    parse_models,
    plan,
    previous_entries,
    wanted_adapters,
)
from kvpilot.operator.autoscaling.state import parse_time
from kvpilot.operator.spec import parse_spec

NOW = parse_time("2026-01-01T00:00:00Z")
SQL = WantedAdapter("sql", "hf://org/sql-lora", "hf://org/sql-lora")
CHAT = WantedAdapter("chat-v2", "file:///adapters/chat", "/adapters/chat")


def spec_with(adapters: list[dict[str, Any]], **model: Any) -> Any:
    return parse_spec({"model": {"uri": "hf://org/base", **model}, "adapters": adapters})


@pytest.mark.parametrize(
    ("uri", "path", "model"),
    [
        ("hf://org/sql-lora", "hf://org/sql-lora", {}),
        ("hf://org/sql-lora@v2", "hf://org/sql-lora@v2", {}),
        ("file:///adapters/sql", "/adapters/sql", {}),
        # pvc://: the claim is mounted at /models, as the model cache.
        ("pvc://cache/adapters/sql", "/models/adapters/sql", {"cache": {"claimName": "cache"}}),
    ],
)
def test_the_engine_gets_a_path_it_can_load(uri: str, path: str, model: dict[str, Any]) -> None:
    spec = spec_with([{"name": "sql", "uri": uri}], **model)
    assert engine_path(spec, spec.adapters[0]) == path
    assert wanted_adapters(spec) == (WantedAdapter("sql", uri, path),)


def test_a_pvc_adapter_on_the_pvc_models_own_claim_is_under_its_mount() -> None:
    spec = parse_spec(
        {
            "model": {"uri": "pvc://weights/llama"},
            "adapters": [{"name": "sql", "uri": "pvc://weights/loras/sql"}],
        }
    )
    assert wanted_adapters(spec)[0].path == "/models/loras/sql"


def test_models_listing_reads_adapters_by_their_parent() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "chat", "object": "model", "parent": None, "root": "/models/base"},
            {"id": "sql", "object": "model", "parent": "chat", "root": "hf://org/sql-lora"},
            {"id": "math", "object": "model", "parent": "chat", "root": "/adapters/math"},
        ],
    }
    assert parse_models(body) == {"sql": "hf://org/sql-lora", "math": "/adapters/math"}


@pytest.mark.parametrize("body", [[], {"data": "x"}, {"data": [{"object": "model"}]}, None])
def test_a_listing_of_another_shape_is_an_error(body: Any) -> None:
    with pytest.raises(ValueError, match="/v1/models"):
        parse_models(body)


def test_each_replica_gets_what_it_lacks_and_loses_what_is_not_wanted() -> None:
    listings = {
        "p0": {},
        "p1": {"sql": "hf://org/sql-lora", "old": "/adapters/old"},
        "p2": None,  # did not answer: nothing is done to it
    }
    assert plan([SQL, CHAT], listings, {}, NOW) == [
        Load("p0", "sql", "hf://org/sql-lora", replace=False),
        Load("p0", "chat-v2", "/adapters/chat", replace=False),
        Unload("p1", "old"),  # unloads first: the slot it frees serves the load
        Load("p1", "chat-v2", "/adapters/chat", replace=False),
    ]


def test_an_adapter_loaded_from_another_path_is_replaced_in_place() -> None:
    listings = {"p0": {"sql": "hf://org/sql-lora@v1"}}
    assert plan([SQL], listings, {}, NOW) == [Load("p0", "sql", "hf://org/sql-lora", replace=True)]
    # A trailing slash is the same directory.
    assert plan([CHAT], {"p0": {"chat-v2": "/adapters/chat/"}}, {}, NOW) == []


def test_our_own_load_stands_whatever_root_the_engine_reports() -> None:
    """An engine that reports where it put an hf:// download is not asked again each round."""
    previous = previous_entries(
        {"adapters": [{"name": "sql", "uri": SQL.uri, "replicas": [
            {"pod": "p0", "state": "Loaded"}]}]}
    )  # fmt: skip
    listings = {"p0": {"sql": "/models/.kvpilot-cache/hf/org/sql-lora"}}
    assert plan([SQL], listings, previous, NOW) == []


def failed_before(seconds_ago: float, uri: str = SQL.uri) -> dict[tuple[str, str], Any]:
    stamp = format_time_s(NOW - seconds_ago)
    replica = {"pod": "p0", "state": "Failed", "message": "HTTP 400: bad", "lastAttemptTime": stamp}
    return previous_entries({"adapters": [{"name": "sql", "uri": uri, "replicas": [replica]}]})


def test_a_refused_adapter_is_tried_again_after_a_while_or_once_its_uri_changes() -> None:
    listings: dict[str, dict[str, str] | None] = {"p0": {}}
    load = Load("p0", "sql", SQL.path, replace=False)
    assert plan([SQL], listings, failed_before(60), NOW) == []
    assert plan([SQL], listings, failed_before(FAILED_RETRY_SECONDS), NOW) == [load]
    assert plan([SQL], listings, failed_before(60, uri="hf://org/sql-lora@v0"), NOW) == [load]


def results(*items: tuple[Any, int | None, str]) -> list[Result]:
    return [Result(action, status, message) for action, status, message in items]


def test_status_says_per_replica_what_happened() -> None:
    done = results(
        (Load("p0", "sql", SQL.path, False), 200, "Success"),
        (Load("p0", "chat-v2", CHAT.path, False), 400, "adapter_config.json: r is missing"),
        (Load("p1", "chat-v2", CHAT.path, False), None, "no answer in 120s"),
    )
    listings = {"p0": {"sql": SQL.path}, "p1": {"sql": SQL.path}, "p2": None}
    report = build_report(
        [SQL, CHAT], ["p0", "p1", "p2"], listings, {"p2": "timed out"}, done, {}, NOW
    )
    by_name = {adapter["name"]: adapter for adapter in report.adapters}
    assert by_name["sql"]["replicas"] == [
        {"pod": "p0", "state": "Loaded"},
        {"pod": "p1", "state": "Loaded"},
        {"pod": "p2", "state": "Unknown", "message": "no answer: timed out"},
    ]
    assert (by_name["sql"]["state"], by_name["sql"]["loadedReplicas"]) == ("Unknown", 2)
    assert by_name["chat-v2"]["replicas"] == [
        {
            "pod": "p0",
            "state": "Failed",
            "message": "HTTP 400: adapter_config.json: r is missing",
            "lastAttemptTime": "2026-01-01T00:00:00Z",
        },
        {"pod": "p1", "state": "Loading", "message": "no answer in 120s"},
        {"pod": "p2", "state": "Unknown", "message": "no answer: timed out"},
    ]
    assert by_name["chat-v2"]["state"] == "Failed"
    assert report.summary == "2/6"
    condition = report.condition
    assert condition is not None
    assert (condition.status, condition.reason) == (False, "AdapterFailed")
    assert condition.message == (
        "the engine refused 1 load(s), the base model still serves: chat-v2 on p0: "
        "HTTP 400: adapter_config.json: r is missing"
    )
    assert report.new_failures == [("chat-v2", "p0", "HTTP 400: adapter_config.json: r is missing")]


def test_a_failure_is_announced_once_and_kept_while_backing_off() -> None:
    previous = failed_before(60)
    report = build_report([SQL], ["p0"], {"p0": {}}, {}, [], previous, NOW)
    (entry,) = report.adapters[0]["replicas"]
    assert entry == {
        "pod": "p0",
        "state": "Failed",
        "message": "HTTP 400: bad",
        "lastAttemptTime": previous["sql", "p0"]["lastAttemptTime"],
    }
    assert report.new_failures == []


def test_a_refused_fresh_load_the_engine_lists_anyway_is_loaded() -> None:
    """An earlier call's load (it outlasted its timeout) finished: 400 'already loaded'."""
    done = results((Load("p0", "sql", SQL.path, False), 400, "adapter sql already loaded"))
    report = build_report([SQL], ["p0"], {"p0": {"sql": SQL.path}}, {}, done, {}, NOW)
    assert report.adapters[0]["replicas"] == [{"pod": "p0", "state": "Loaded"}]
    assert report.condition is not None and report.condition.reason == "AdaptersLoaded"


def test_a_refused_replacement_is_failed_though_the_old_one_serves() -> None:
    done = results((Load("p0", "sql", SQL.path, True), 404, "no adapter at hf://org/sql-lora"))
    report = build_report([SQL], ["p0"], {"p0": {"sql": "/adapters/old"}}, {}, done, {}, NOW)
    assert report.adapters[0]["replicas"][0]["state"] == "Failed"


def test_an_unload_refused_in_use_is_unloading_until_a_round_succeeds() -> None:
    in_use = "adapter old is in use by 3 requests"
    busy = results((Unload("p0", "old"), 409, in_use))
    report = build_report([SQL], ["p0"], {"p0": {"sql": SQL.path, "old": "/a"}}, {}, busy, {}, NOW)
    assert report.adapters[1] == {
        "name": "old",
        "state": "Unloading",
        "loadedReplicas": 1,
        "replicas": [{"pod": "p0", "state": "Unloading", "message": f"HTTP 409: {in_use}"}],
    }
    assert report.condition is not None
    assert (report.condition.status, report.condition.reason) == (False, "AdaptersLoading")
    assert report.summary == "1/1"
    # Once unloaded, the removed adapter leaves the status.
    gone = results((Unload("p0", "old"), 200, "Success"))
    report = build_report([SQL], ["p0"], {"p0": {"sql": SQL.path}}, {}, gone, {}, NOW)
    assert [adapter["name"] for adapter in report.adapters] == ["sql"]
    assert report.condition is not None and report.condition.status


def test_conditions_without_replicas_and_without_adapters() -> None:
    waiting = build_report([SQL], [], {}, {}, [], {}, NOW)
    assert waiting.adapters[0]["state"] == "Pending"
    assert waiting.condition is not None and waiting.condition.reason == "WaitingForReplicas"
    assert waiting.summary == "0/0"
    nothing = build_report([], ["p0"], {"p0": {}}, {}, [], {}, NOW)
    assert (nothing.adapters, nothing.summary, nothing.condition) == ([], None, None)


def test_all_loaded_is_ready_and_long_messages_are_cut() -> None:
    listings = {"p0": {"sql": SQL.path, "chat-v2": CHAT.path}, "p1": {"sql": SQL.path}}
    long = "x" * 2000
    done = results((Load("p1", "chat-v2", CHAT.path, False), 400, long))
    report = build_report([SQL, CHAT], ["p0", "p1"], listings, {}, done, {}, NOW)
    message = report.adapters[1]["replicas"][1]["message"]
    assert len(message) == MAX_MESSAGE_CHARS and message.endswith("...")
    fixed = build_report(
        [SQL, CHAT], ["p0", "p1"], {**listings, "p1": listings["p0"]}, {}, [], {}, NOW
    )
    assert fixed.condition is not None
    assert (fixed.condition.status, fixed.condition.reason) == (True, "AdaptersLoaded")
    assert fixed.condition.message == "2 adapter(s) loaded on 2 replica(s)"
    assert fixed.summary == "4/4"
