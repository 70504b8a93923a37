"""Requests waiting for a model to get a routable replica (scale from zero, or all replicas
restarting): a bounded FIFO per model. Released in arrival order when a replica comes."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from kvpilot.router.config import HoldConfig


class HoldFull(RuntimeError):
    """The model's hold queue is at its bound."""


class HoldTimeout(RuntimeError):
    """No replica came within the hold timeout."""


class HoldQueue:
    def __init__(self, config: HoldConfig) -> None:
        self.config = config
        self._waiters: deque[asyncio.Future[None]] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, timeout_s: float | None = None) -> float:
        """Wait for release(); returns the seconds held. HoldFull at once when the queue is at
        its bound, HoldTimeout after timeout_s (default: the configured hold timeout)."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        if len(self._waiters) >= self.config.max_held_per_model:
            raise HoldFull(f"{len(self._waiters)} requests are already waiting")
        started = time.monotonic()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except asyncio.TimeoutError:
            raise HoldTimeout(f"no replica became ready in {timeout_s:g} s") from None
        finally:
            if not waiter.done():
                waiter.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        return time.monotonic() - started

    def release(self) -> None:
        """Wake every waiter, oldest first (they resume in this order)."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
