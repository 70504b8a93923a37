"""The API process's mirror of the engine core's cached block hashes, served to subscribers as the
stream kvpilot.contract.kv_events describes (GET /kvpilot/v1/kv-events).

The output thread publishes each step's delta; event loops subscribe. The mirror is a set of the
hashes the core holds (at most its number of blocks) and a bounded log of recent deltas, so a
subscriber that fell behind further than the log reaches gets a fresh snapshot instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator

import msgspec

from kvpilot.contract.block_hash import HASH_SCHEME
from kvpilot.contract.kv_events import KvDelta, KvHeartbeat, KvMessage, KvSnapshot, KvUpdate, Load

_LOG_LENGTH = 4096
HEARTBEAT_S = 0.5


class KvEventHub:
    def __init__(
        self,
        model_name: str,
        block_size: int,
        *,
        log_length: int = _LOG_LENGTH,
        max_loras: int = 0,
        max_num_seqs: int = 0,
    ) -> None:
        """max_loras: the engine's adapter slots, and max_num_seqs, the sequences it runs at once,
        in the load from the first message on (a router tells a replica with free slots from one
        without adapters, and knows when a replica is saturated, before any step)."""
        self.model_name = model_name
        self.block_size = block_size
        self._lock = threading.Lock()
        self._hashes: set[int] = set()
        self._seq = 0
        self._log: deque[KvUpdate] = deque(maxlen=log_length)
        self._load = Load(max_loras=max_loras, max_num_seqs=max_num_seqs)
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    # ---- the output thread ----
    def publish(self, delta: KvDelta | None, load: Load) -> None:
        with self._lock:
            self._load = load
            if delta is None:
                return
            self._hashes.difference_update(delta.removed)
            self._hashes.update(delta.stored)
            self._seq += 1
            self._log.append(KvUpdate(self._seq, delta.stored, delta.removed, load))
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: its subscriber is gone
                loop.call_soon_threadsafe(event.set)

    # ---- readers (any thread) ----
    def snapshot(self) -> KvSnapshot:
        with self._lock:
            return KvSnapshot(
                self._seq,
                self.model_name,
                self.block_size,
                HASH_SCHEME,
                sorted(self._hashes),
                self._load,
            )

    def since(self, seq: int) -> list[KvUpdate] | None:
        """The deltas after `seq`, or None when the log no longer reaches back that far."""
        with self._lock:
            if seq == self._seq:
                return []
            if not self._log or self._log[0].seq > seq + 1:
                return None
            return [u for u in self._log if u.seq > seq]

    def heartbeat(self, seq: int) -> KvHeartbeat:
        """For a stream at `seq`: the hub may be ahead already (the output thread published while
        the stream's timer ran out), and the stream then sends that delta next, not before."""
        with self._lock:
            return KvHeartbeat(seq, self._load)

    async def subscribe(self, heartbeat_s: float = HEARTBEAT_S) -> AsyncIterator[KvMessage]:
        """A snapshot, then every delta in order (a snapshot again after falling too far behind),
        and a heartbeat whenever heartbeat_s passes without one."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._lock:
            self._waiters.add(waiter)
        try:
            snapshot = self.snapshot()
            seq = snapshot.seq
            yield snapshot
            while True:
                timed_out = False
                try:
                    await asyncio.wait_for(event.wait(), heartbeat_s)
                except asyncio.TimeoutError:
                    timed_out = True
                event.clear()
                updates = self.since(seq)
                if updates is None:
                    snapshot = self.snapshot()
                    seq = snapshot.seq
                    yield snapshot
                    continue
                for update in updates:
                    seq = update.seq
                    yield update
                if timed_out and not updates:
                    yield self.heartbeat(seq)
        finally:
            with self._lock:
                self._waiters.discard(waiter)


def encode_lines(messages: AsyncIterator[KvMessage]) -> AsyncIterator[bytes]:
    encoder = msgspec.json.Encoder()

    async def lines() -> AsyncIterator[bytes]:
        async for message in messages:
            yield encoder.encode(message) + b"\n"

    return lines()
