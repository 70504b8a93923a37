"""One engine replica as the router sees it, and the task that follows its block-event stream
(GET /kvpilot/v1/kv-events, see kvpilot.contract.kv_events).

A replica is routable while its stream is synced (a snapshot, then every delta in order) and has
been heard from within dead_after_s. Any gap in the numbering, a broken connection or silence
clears its index and takes it out of rotation until a fresh snapshot arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import msgspec

from kvpilot.contract.block_hash import HASH_SCHEME
from kvpilot.contract.kv_events import KV_EVENTS_PATH, KvMessage, KvSnapshot, KvUpdate, Load
from kvpilot.contract.tenancy import PRIORITY_CLASSES
from kvpilot.router.engine_keys import bearer
from kvpilot.router.index import BlockIndex

log = logging.getLogger("kvpilot.router")

_RETRY_S = (0.1, 0.25, 0.5, 1.0)


class StreamGap(RuntimeError):
    """The stream skipped a delta: the index can no longer be trusted."""


class Unauthorized(RuntimeError):
    """The replica refused the router's key (or its lack of one) for its event stream."""


@dataclass
class Replica:
    name: str  # the pod's name
    url: str  # http://ip:port
    index: BlockIndex
    block_size: int | None = None
    load: Load = field(default_factory=Load)
    in_flight: int = 0
    # The tenants' requests in flight here by priority rank (contract.tenancy.priority_rank).
    in_flight_by_rank: list[int] = field(default_factory=lambda: [0] * len(PRIORITY_CLASSES))
    seq: int | None = None  # the last delta applied; None while not synced
    last_heard: float = 0.0
    # When a request last could not reach it (set by the proxy; cleared by the next snapshot):
    # out of rotation for dead_after_s, by when its stream has told whether it is gone.
    failed_at: float = float("-inf")
    # The API key its engine accepted for the event stream (None: it asked for none); the proxy
    # sends the same. Out of repr: a replica may be logged, its key never.
    engine_key: str | None = field(default=None, repr=False)

    def is_routable(self, now: float, dead_after_s: float) -> bool:
        return (
            self.seq is not None
            and now - self.failed_at >= dead_after_s
            and now - self.last_heard < dead_after_s
        )

    def has_room(self, rank: int, concurrency: int | None, default_concurrency: int) -> bool:
        """Whether a request of this priority rank fits: fewer requests of its rank or a better
        one in flight here than the engine runs at once (its max_num_seqs; the default where it
        does not say) and, below the best class, than `concurrency` too. Worse ranks do not
        count: the engine preempts them for it. The best class is bounded by the engine alone,
        so its own requests never hold it back while the engine can take them."""
        capacity = self.load.max_num_seqs or default_concurrency
        limit = capacity if rank == 0 or concurrency is None else concurrency
        return sum(self.in_flight_by_rank[: rank + 1]) < limit

    def desync(self) -> None:
        self.seq = None
        self.index.reset()

    def apply(self, message: KvMessage, now: float) -> None:
        """Raises StreamGap when a delta is missing (the caller reconnects)."""
        if isinstance(message, KvSnapshot):
            if message.hash_scheme != HASH_SCHEME:
                raise ValueError(
                    f"{self.name} hashes blocks with {message.hash_scheme}, this router with "
                    f"{HASH_SCHEME}: upgrade one of them"
                )
            self.index.reset(message.hashes)
            self.block_size = message.block_size
            self.seq = message.seq
            self.failed_at = float("-inf")
        elif self.seq is None:
            raise StreamGap(f"{self.name}: a delta before any snapshot")
        elif message.seq != self.seq + (1 if isinstance(message, KvUpdate) else 0):
            raise StreamGap(f"{self.name}: expected seq {self.seq + 1}, got {message.seq}")
        elif isinstance(message, KvUpdate):
            self.index.remove(message.removed)
            self.index.store(message.stored)
            self.seq = message.seq
        self.load = message.load
        self.last_heard = now


async def follow(
    replica: Replica,
    session: aiohttp.ClientSession,
    *,
    dead_after_s: float,
    on_synced: Callable[[], None] | None = None,
    candidate_keys: Callable[[], tuple[str | None, ...]] | None = None,
    on_unauthorized: Callable[[], None] | None = None,
) -> None:
    """Keep the replica's index current until cancelled; reconnect (with a fresh snapshot) after
    any failure. candidate_keys: asked at each connection (a rotated key is tried at the next
    one); after a 401 the next connection tries the next candidate, and the key accepted is kept
    in replica.engine_key. on_unauthorized: called at each 401, the first of a run also logged."""
    decoder = msgspec.json.Decoder(KvMessage)
    attempt = 0
    refusals = 0  # consecutive 401s
    while True:
        try:
            candidates = candidate_keys() if candidate_keys is not None else (None,)
            key = key_to_try(candidates, replica.engine_key, refusals)
            async with session.get(
                replica.url + KV_EVENTS_PATH,
                headers=bearer(key),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=dead_after_s),
            ) as response:
                if response.status == 401:
                    raise Unauthorized(
                        f"replica {replica.name} refused the router's API key for its block "
                        "events (401): it is out of rotation until the key is right"
                    )
                response.raise_for_status()
                replica.engine_key = key
                refusals = 0
                # Lines as each read brings them: a heartbeat costs one read and one decode.
                pending = bytearray()
                async for chunk in response.content.iter_any():
                    pending += chunk
                    if b"\n" not in chunk:  # part of a long line (a big snapshot)
                        continue
                    end = pending.rindex(b"\n")
                    lines = bytes(pending[:end]).split(b"\n")
                    del pending[: end + 1]
                    for line in lines:
                        if not line:
                            continue
                        was_routable = replica.seq is not None
                        replica.apply(decoder.decode(line), time.monotonic())
                        attempt = 0
                        if not was_routable and on_synced is not None:
                            on_synced()
            raise StreamGap(f"{replica.name}: the event stream ended")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, Unauthorized):
                if not refusals:  # once per run of refusals; each one is counted
                    log.warning("%s", exc)
                refusals += 1
                if on_unauthorized is not None:
                    on_unauthorized()
            elif replica.seq is not None:
                log.info("replica %s out of rotation: %s", replica.name, exc)
            replica.desync()
            delay = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
            attempt += 1
            await asyncio.sleep(delay)


def key_to_try(
    candidates: tuple[str | None, ...], accepted: str | None, refusals: int
) -> str | None:
    """The key for the next connection: the one the engine accepted last while it is still a
    candidate, then the others in turn, one more for each consecutive 401."""
    order = candidates
    if accepted in candidates:
        order = (accepted, *(k for k in candidates if k != accepted))
    return order[refusals % len(order)]


def stop(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        with contextlib.suppress(RuntimeError):
            task.cancel()
