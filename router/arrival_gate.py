"""The order in which arrivals get the router's CPU: best priority class first, one at a time.

What a request costs the router before it waits anywhere (its body read and parsed, its prompt
tokenized, its quota charged and its place in the fair queue taken) runs on the event loop
without a pause. A burst of a hundred arrivals would run that work back to back, in arrival
order, and a better-class request arriving a moment later would wait for all of it: ~1 ms each
on a shared CPU, enough to be the largest part of a premium chat's time to first token. Through
the gate each arrival waits for its turn, turns are given one per pass of the event loop (so the
loop polls its sockets between two arrivals' work and sees new ones), and the best class
waiting, then the earliest, takes the next.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools


class ArrivalGate:
    def __init__(self) -> None:
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._giving = False  # a _give_next is scheduled
        self._given_this_pass = False

    @property
    def num_waiting(self) -> int:
        return sum(1 for _, _, turn in self._waiting if not turn.done())

    async def turn(self, rank: int) -> None:
        """Returns when this arrival may do its work (lower rank first, then arrival order).
        Without contention at once, with no pass of the loop lost; a cancelled waiter gives
        its turn to the next."""
        loop = asyncio.get_running_loop()
        if not self._waiting and not self._given_this_pass:
            self._given(loop)
            return
        turn: asyncio.Future[None] = loop.create_future()
        heapq.heappush(self._waiting, (rank, next(self._order), turn))
        if not self._giving:
            self._giving = True
            loop.call_soon(self._give_next)
        await turn

    def _given(self, loop: asyncio.AbstractEventLoop) -> None:
        self._given_this_pass = True
        loop.call_soon(self._next_pass)

    def _next_pass(self) -> None:
        self._given_this_pass = False

    def _give_next(self) -> None:
        loop = asyncio.get_running_loop()
        if self._given_this_pass:  # one turn a pass: try again on the next
            loop.call_soon(self._give_next)
            return
        while self._waiting:
            _, _, turn = heapq.heappop(self._waiting)
            if turn.done():  # cancelled while waiting
                continue
            turn.set_result(None)
            self._given(loop)
            # The next turn on a later pass: this one's work runs first, then the loop polls.
            loop.call_soon(self._give_next)
            return
        self._giving = False
