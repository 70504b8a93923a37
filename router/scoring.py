"""Which replica takes a request: pure functions over what the router knows of each candidate.

1. Bounded load: a replica may take the request only if its in-flight count stays within
   load_factor x the mean (the new request counted), so one hot prefix cannot pile every request
   onto one replica. The least-loaded replica always qualifies.
2. Session affinity (`x-session-id`): the session's rendezvous-hash favourite among those allowed.
3. Otherwise the best score: prefix match (fraction of the prompt's blocks held) against queue
   (relative to the busiest candidate) and KV-cache utilization. Ties go to the rendezvous-hash
   favourite of the request's first block, so routers that share no state send a new prefix to the
   same replica, where the next request with it will look.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvpilot.router.config import RoutingConfig

Reason = Literal["prefix", "load", "affinity", "fallback"]


@dataclass(frozen=True)
class Candidate:
    name: str
    matched_blocks: int
    in_flight: int  # this router's requests on it, not yet finished
    num_waiting: int  # the engine's queue, from its event stream
    kv_cache_usage: float


@dataclass(frozen=True)
class Decision:
    name: str
    reason: Reason
    matched_blocks: int


def rendezvous(key: str, name: str) -> int:
    """Highest-random-weight hashing: each key's ranking of names, stable as names come and go."""
    digest = hashlib.blake2b(f"{key}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def within_bound(candidates: Sequence[Candidate], load_factor: float) -> list[Candidate]:
    total = sum(c.in_flight for c in candidates) + 1
    cap = math.ceil(load_factor * total / len(candidates))
    return [c for c in candidates if c.in_flight + 1 <= cap]


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
    if session_id:
        pick = max(allowed, key=lambda c: rendezvous(session_id, c.name))
        return Decision(pick.name, "affinity", pick.matched_blocks)
    if num_blocks == 0:
        pick = min(
            allowed, key=lambda c: (c.in_flight + c.num_waiting, -rendezvous(tie_key, c.name))
        )
        return Decision(pick.name, "fallback", 0)
    busiest = max(1, *(c.in_flight + c.num_waiting for c in allowed))

    def score(c: Candidate) -> tuple[float, int]:
        value = (
            config.prefix_weight * c.matched_blocks / num_blocks
            - config.queue_weight * (c.in_flight + c.num_waiting) / busiest
            - config.kv_weight * c.kv_cache_usage
        )
        return round(value, 9), rendezvous(tie_key, c.name)

    pick = max(allowed, key=score)
    best_match = max(c.matched_blocks for c in allowed)
    reason: Reason = (
        "prefix" if pick.matched_blocks > 0 and pick.matched_blocks == best_match else "load"
    )
    return Decision(pick.name, reason, pick.matched_blocks)
