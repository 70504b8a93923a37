"""LoRA adapters in the running replicas, as pure functions: the adapters the spec wants, what
each Ready replica reports loaded (its /v1/models), the loads and unloads that close the gap,
and the status (per adapter, per replica) and AdaptersReady condition they leave.

No I/O here: adapter_client.py talks to the engines, adapter_sync.py runs one round.

Rules:
- every Ready replica gets every wanted adapter; one loaded from another path (the spec's uri
  changed) is replaced in place;
- an adapter the spec no longer names is unloaded; the engine refusing while requests use it
  (409) leaves it Unloading, retried next round: nothing is dropped;
- the operator owns the replicas' adapter set: whatever else is loaded is unloaded too;
- a load the engine refused (400/404: bad files, no adapter there) is Failed with the engine's
  message, and retried only after FAILED_RETRY_SECONDS or when its uri changes;
- the base model is never touched: a bad adapter is a condition, never a restart.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvpilot.operator.autoscaling.state import parse_time
from kvpilot.operator.conditions import ADAPTERS_READY, Condition, format_time
from kvpilot.operator.modeluri import FileModel, HfModel
from kvpilot.operator.spec import AdapterSpec, InferenceServiceSpec

# A refused load is tried again this long after the last attempt: files on a claim or a Hub
# repo can be fixed without a spec change.
FAILED_RETRY_SECONDS = 300.0
# status.adapters stays small however long an engine's message is.
MAX_MESSAGE_CHARS = 300
# How many problems the condition's message spells out.
MAX_LISTED_PROBLEMS = 3

ReplicaState = Literal["Loaded", "Loading", "Failed", "Unloading", "Unknown"]


@dataclass(frozen=True)
class WantedAdapter:
    name: str
    uri: str  # as the spec writes it (status shows it)
    path: str  # the engine's lora_path inside the pod


def engine_path(spec: InferenceServiceSpec, adapter: AdapterSpec) -> str:
    """lora_path for the engine: hf:// as written (the engine fetches it when it loads it),
    pvc:// the path under the model-cache mount (check_adapters made sure the claim is the
    one mounted there), file:// the path in the image."""
    source = adapter.source
    if isinstance(source, HfModel):
        return adapter.uri
    if isinstance(source, FileModel):
        return source.path
    return source.local_dir


def wanted_adapters(spec: InferenceServiceSpec) -> tuple[WantedAdapter, ...]:
    return tuple(
        WantedAdapter(adapter.name, adapter.uri, engine_path(spec, adapter))
        for adapter in spec.adapters
    )


def parse_models(body: Any) -> dict[str, str]:
    """A /v1/models answer -> {adapter name: its root (lora_path)}. Adapters are the entries
    with a `parent` (the base model has none); ValueError for an answer of another shape."""
    items = body.get("data") if isinstance(body, dict) else None
    if not isinstance(items, list):
        raise ValueError("/v1/models answered without a `data` list")
    loaded: dict[str, str] = {}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
            raise ValueError("/v1/models listed an entry without a string `id`")
        if item.get("parent") is not None:
            root = item.get("root")
            loaded[item["id"]] = root if isinstance(root, str) else ""
    return loaded


@dataclass(frozen=True)
class Load:
    pod: str
    name: str
    path: str
    replace: bool  # loaded already from another path: replaced in place (load_inplace)


@dataclass(frozen=True)
class Unload:
    pod: str
    name: str


Action = Load | Unload


@dataclass(frozen=True)
class Result:
    """How the engine answered one action: its HTTP status (None: no answer) and message."""

    action: Action
    status: int | None
    message: str

    @property
    def is_done(self) -> bool:
        # An unload of a name the engine does not know (404) leaves what was wanted: gone.
        return self.status == 200 or (isinstance(self.action, Unload) and self.status == 404)

    @property
    def is_refused(self) -> bool:
        """The engine said the adapter cannot be loaded (not: busy, or no answer)."""
        return isinstance(self.action, Load) and self.status in (400, 404)


PreviousEntries = Mapping[tuple[str, str], Mapping[str, Any]]


def previous_entries(status: Mapping[str, Any] | None) -> dict[tuple[str, str], dict[str, Any]]:
    """status.adapters -> {(adapter, pod): that replica's entry, with the adapter's uri}."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for adapter in (status or {}).get("adapters") or []:
        for replica in adapter.get("replicas") or []:
            found[(adapter["name"], replica["pod"])] = {**replica, "uri": adapter.get("uri")}
    return found


def _attempt_age(entry: Mapping[str, Any], now: float) -> float:
    when = entry.get("lastAttemptTime")
    return float("inf") if not when else now - parse_time(when)


def is_backing_off(entry: Mapping[str, Any] | None, wanted: WantedAdapter, now: float) -> bool:
    """A load the engine refused for this very uri, too recently to try again."""
    return (
        entry is not None
        and entry.get("state") == "Failed"
        and entry.get("uri") == wanted.uri
        and _attempt_age(entry, now) < FAILED_RETRY_SECONDS
    )


def holds(
    loaded: Mapping[str, str], adapter: WantedAdapter, entry: Mapping[str, Any] | None
) -> bool:
    """Whether a replica's listing holds `adapter` as the spec wants it: under its name, from
    its path, or loaded by us from its uri (whatever root the engine reports for it)."""
    if adapter.name not in loaded:
        return False
    is_ours = (
        entry is not None and entry.get("state") == "Loaded" and entry.get("uri") == adapter.uri
    )
    return is_ours or loaded[adapter.name].rstrip("/") == adapter.path.rstrip("/")


def plan(
    wanted: Sequence[WantedAdapter],
    listings: Mapping[str, Mapping[str, str] | None],
    previous: PreviousEntries,
    now: float,
) -> list[Action]:
    """The actions that bring each replica to `wanted`. `listings`: pod -> what it reports
    loaded (None: it did not answer, so nothing is done to it). Unloads come first on each pod,
    so that the slots they free serve the loads."""
    names = {adapter.name for adapter in wanted}
    actions: list[Action] = []
    for pod, loaded in listings.items():
        if loaded is None:
            continue
        actions += [Unload(pod, name) for name in sorted(loaded) if name not in names]
        for adapter in wanted:
            entry = previous.get((adapter.name, pod))
            if holds(loaded, adapter, entry) or is_backing_off(entry, adapter, now):
                continue
            actions.append(Load(pod, adapter.name, adapter.path, replace=adapter.name in loaded))
    return actions


@dataclass(frozen=True)
class AdapterReport:
    """What one round leaves: status.adapters, status.adapterSummary, the AdaptersReady
    condition (None: no adapter anywhere, the condition goes), and the new failures (each a
    Warning Event)."""

    adapters: list[dict[str, Any]]
    summary: str | None
    condition: Condition | None
    new_failures: list[tuple[str, str, str]]  # (adapter, pod, message)


def _short(message: str) -> str:
    message = " ".join(message.split())
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."


def replica_entry(
    adapter: WantedAdapter,
    pod: str,
    loaded: Mapping[str, str] | None,
    result: Result | None,
    error: str | None,
    previous: Mapping[str, Any] | None,
    now: float,
) -> dict[str, Any]:
    """One wanted adapter on one Ready replica, after this round's action on it (if any).
    `loaded` is the replica's listing after the actions (None with `error`: no answer)."""
    if loaded is None:
        return {"pod": pod, "state": "Unknown", "message": _short(f"no answer: {error}")}
    if result is None:
        if holds(loaded, adapter, previous):
            return {"pod": pod, "state": "Loaded"}
        if previous is not None and is_backing_off(previous, adapter, now):
            kept = {key: previous[key] for key in ("message", "lastAttemptTime") if key in previous}
            return {"pod": pod, "state": "Failed", **kept}
        return {"pod": pod, "state": "Loading"}
    is_fresh_load = isinstance(result.action, Load) and not result.action.replace
    if result.is_done or (is_fresh_load and adapter.name in loaded):
        # A refused fresh load that the engine lists anyway was an earlier call's, finishing.
        return {"pod": pod, "state": "Loaded"}
    if result.is_refused:
        return {
            "pod": pod,
            "state": "Failed",
            "message": _short(f"HTTP {result.status}: {result.message}"),
            "lastAttemptTime": format_time_s(now),
        }
    # No answer in time (a download can outlast the call), or the engine busy: the next round
    # sees it loaded, or asks again.
    return {"pod": pod, "state": "Loading", "message": _short(result.message)}


def format_time_s(now: float) -> str:
    return format_time(datetime.datetime.fromtimestamp(now, tz=datetime.timezone.utc))


def build_report(
    wanted: Sequence[WantedAdapter],
    ready_pods: Sequence[str],
    listings: Mapping[str, Mapping[str, str] | None],
    errors: Mapping[str, str],
    results: Iterable[Result],
    previous: PreviousEntries,
    now: float,
) -> AdapterReport:
    """The status a round leaves. `listings` are the replicas' listings after the actions,
    `errors` why a replica's listing is None."""
    by_key = {(r.action.name, r.action.pod): r for r in results}
    adapters: list[dict[str, Any]] = []
    new_failures: list[tuple[str, str, str]] = []
    for adapter in wanted:
        replicas = []
        for pod in ready_pods:
            key = (adapter.name, pod)
            entry = replica_entry(
                adapter,
                pod,
                listings.get(pod),
                by_key.get(key),
                errors.get(pod),
                previous.get(key),
                now,
            )
            replicas.append(entry)
            before = previous.get(key) or {}
            was_failed = before.get("state") == "Failed" and before.get("uri") == adapter.uri
            if entry["state"] == "Failed" and not was_failed:
                new_failures.append((adapter.name, pod, entry.get("message", "")))
        adapters.append(
            {
                "name": adapter.name,
                "uri": adapter.uri,
                "state": _summary_state([entry["state"] for entry in replicas]),
                "loadedReplicas": sum(entry["state"] == "Loaded" for entry in replicas),
                "replicas": replicas,
            }
        )
    adapters += _leftovers(wanted, ready_pods, listings, by_key)
    condition = _condition(wanted, ready_pods, adapters)
    total = len(wanted) * len(ready_pods)
    loaded = sum(adapter["loadedReplicas"] for adapter in adapters[: len(wanted)])
    summary = None if condition is None else f"{loaded}/{total}"
    return AdapterReport(adapters, summary, condition, new_failures)


def _leftovers(
    wanted: Sequence[WantedAdapter],
    ready_pods: Sequence[str],
    listings: Mapping[str, Mapping[str, str] | None],
    by_key: Mapping[tuple[str, str], Result],
) -> list[dict[str, Any]]:
    """Adapters no longer wanted that some replica still holds (its unload refused or
    unanswered): Unloading there, until a round unloads them."""
    names = {adapter.name for adapter in wanted}
    holders: dict[str, list[dict[str, Any]]] = {}
    for pod in ready_pods:
        for name in sorted((listings.get(pod) or {}).keys() - names):
            result = by_key.get((name, pod))
            if result is not None and result.is_done:
                continue
            entry: dict[str, Any] = {"pod": pod, "state": "Unloading"}
            if result is not None:
                entry["message"] = _short(
                    f"HTTP {result.status}: {result.message}" if result.status else result.message
                )
            holders.setdefault(name, []).append(entry)
    return [
        {"name": name, "state": "Unloading", "loadedReplicas": len(held), "replicas": held}
        for name, held in sorted(holders.items())
    ]


def _summary_state(states: Sequence[str]) -> str:
    if not states:
        return "Pending"  # no Ready replica yet
    for state in ("Failed", "Unknown", "Loading"):
        if state in states:
            return state
    return "Loaded"


def _condition(
    wanted: Sequence[WantedAdapter], ready_pods: Sequence[str], adapters: Sequence[dict[str, Any]]
) -> Condition | None:
    if not adapters:
        return None
    failed = [
        f"{adapter['name']} on {entry['pod']}: {entry.get('message', 'refused')}"
        for adapter in adapters
        for entry in adapter["replicas"]
        if entry["state"] == "Failed"
    ]
    if failed:
        listed = "; ".join(failed[:MAX_LISTED_PROBLEMS])
        more = len(failed) - MAX_LISTED_PROBLEMS
        extra = f" (and {more} more)" if more > 0 else ""
        return Condition(
            ADAPTERS_READY,
            False,
            "AdapterFailed",
            f"the engine refused {len(failed)} load(s), the base model still serves: "
            f"{listed}{extra}",
        )
    if wanted and not ready_pods:
        return Condition(
            ADAPTERS_READY,
            False,
            "WaitingForReplicas",
            "no replica is Ready: adapters are loaded into each one once it is",
        )
    pending = [
        f"{adapter['name']} {entry['state']} on {entry['pod']}"
        for adapter in adapters
        for entry in adapter["replicas"]
        if entry["state"] != "Loaded"
    ]
    if pending:
        more = len(pending) - MAX_LISTED_PROBLEMS
        extra = f" (and {more} more)" if more > 0 else ""
        return Condition(
            ADAPTERS_READY,
            False,
            "AdaptersLoading",
            f"{'; '.join(pending[:MAX_LISTED_PROBLEMS])}{extra}",
        )
    return Condition(
        ADAPTERS_READY,
        True,
        "AdaptersLoaded",
        f"{len(wanted)} adapter(s) loaded on {len(ready_pods)} replica(s)",
    )


def needs_sync(spec: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Whether an object has adapters to load, or adapter state left to clear."""
    return bool(spec.get("adapters")) or bool(status.get("adapters"))
