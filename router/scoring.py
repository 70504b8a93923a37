"""Which replica takes a request: pure functions over what the router knows of each candidate.

1. Bounded load: a replica may take the request only if its in-flight count stays within
   load_factor x the mean (the new request counted), so one hot prefix (or adapter) cannot pile
   every request onto one replica. The least-loaded replica always qualifies. Where every
   replica within it would have to evict another adapter, those that would not (the adapter
   resident, or a free slot) may take up to lora_slack requests more: at low load the bound is
   tight (one request above the mean), and each eviction makes the evicted adapter's next
   request evict another.
2. Session affinity (`x-session-id`): the session's rendezvous-hash favourite among those allowed.
3. Otherwise the best score: prefix match (fraction of the prompt's blocks held) against queue
   (relative to the busiest candidate) and KV-cache utilization; for an adapter, plus what its
   slot state is worth (resident above a whole prefix match; a free slot; nothing where another
   adapter would be evicted), so adapter traffic stays where it is resident, new adapters take
   free slots instead of thrashing full ones, and the bound spreads a hot adapter. A replica
   that reports no slots scores as one that would evict: it may serve no adapters (a rollout
   that turns them on), or not have stepped yet (an engine reports its slots with its first
   step), so it is not excluded. Ties go
   to the rendezvous-hash favourite of the tie key (the request's first block, or its adapter),
   so routers that share no state send a new prefix (or adapter) to the same replica, where the
   next request with it will look.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.router.config import RoutingConfig

Reason = Literal["prefix", "adapter", "load", "affinity", "fallback"]
# A LoRA adapter on a replica: in one of its slots (`resident`), or not and a slot is free
# (`free`), or not and every slot is taken (`evict`: an idle one must make room, or the request
# waits for one), or the replica serves no adapters (`off`).
Slot = Literal["resident", "free", "evict", "off"]


@dataclass(frozen=True)
class Candidate:
    name: str
    matched_blocks: int
    in_flight: int  # this router's requests on it, not yet finished
    num_waiting: int  # the engine's queue, from its event stream
    kv_cache_usage: float
    slot: Slot | None = None  # the requested adapter's state there; None: a base-model request


@dataclass(frozen=True)
class Decision:
    name: str
    reason: Reason
    matched_blocks: int
    slot: Slot | None = None


def adapter_slot(adapter: str, resident: Sequence[str], max_loras: int) -> Slot:
    """The adapter's state on a replica that reports `resident` adapters in `max_loras` slots."""
    if adapter in resident:
        return "resident"
    if max_loras <= 0:
        return "off"
    return "free" if len(resident) < max_loras else "evict"


def rendezvous(key: str, name: str) -> int:
    """Highest-random-weight hashing: each key's ranking of names, stable as names come and go."""
    digest = hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def within_bound(
    candidates: Sequence[Candidate], load_factor: float, slack: int = 0
) -> list[Candidate]:
    total = sum(c.in_flight for c in candidates) + 1
    cap = math.ceil(load_factor * total / len(candidates)) + slack
    return [c for c in candidates if c.in_flight + 1 <= cap]


def slot_value(slot: Slot | None, config: RoutingConfig) -> float:
    if slot == "resident":
        return config.lora_resident_weight
    if slot == "free":
        return config.lora_free_slot_weight
    return 0.0


def choose(
    candidates: Sequence[Candidate],
    *,
    num_blocks: int,
    tie_key: str,
    session_id: str | None,
    config: RoutingConfig,
) -> Decision:
    """num_blocks: the request's full blocks (0 when it could not be tokenized: `fallback`)."""
    if not candidates:
        raise ValueError("no candidate replicas")
    allowed = within_bound(candidates, config.load_factor)
    if all(c.slot in ("evict", "off") for c in allowed):
        # Each replica within the bound would evict another adapter (whose next requests then
        # load it again somewhere, evicting in turn): a replica that holds this adapter, or has
        # a free slot, may take it up to lora_slack requests above the bound instead.
        allowed += [
            c
            for c in within_bound(candidates, config.load_factor, config.lora_slack)
            if c.slot in ("resident", "free")
        ]
    if session_id:
        pick = max(allowed, key=lambda c: rendezvous(session_id, c.name))
        return Decision(pick.name, "affinity", pick.matched_blocks, pick.slot)
    busiest = max(1, *(c.in_flight + c.num_waiting for c in allowed))
    if num_blocks == 0:
        # Without the prompt's blocks: by the adapter's slot and the queue alone.
        def by_load(c: Candidate) -> tuple[float, int, int]:
            queue = c.in_flight + c.num_waiting
            value = slot_value(c.slot, config) - config.queue_weight * queue / busiest
            return round(value, 9), -queue, rendezvous(tie_key, c.name)

        pick = max(allowed, key=by_load)
        return Decision(pick.name, "fallback", 0, pick.slot)

    def score(c: Candidate) -> tuple[float, int]:
        value = (
            config.prefix_weight * c.matched_blocks / num_blocks
            + slot_value(c.slot, config)
            - config.queue_weight * (c.in_flight + c.num_waiting) / busiest
            - config.kv_weight * c.kv_cache_usage
        )
        return round(value, 9), rendezvous(tie_key, c.name)

    pick = max(allowed, key=score)
    return Decision(pick.name, reason_for(pick, allowed), pick.matched_blocks, pick.slot)


def reason_for(pick: Candidate, allowed: Sequence[Candidate]) -> Reason:
    """`prefix` where the pick holds the longest prefix; else `adapter` where it was chosen over
    a replica without the adapter resident; else `load`."""
    if pick.matched_blocks > 0 and pick.matched_blocks == max(c.matched_blocks for c in allowed):
        return "prefix"
    if pick.slot == "resident" and any(c.slot != "resident" for c in allowed):
        return "adapter"
    return "load"
