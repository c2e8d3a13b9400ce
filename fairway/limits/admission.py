"""Admission queue for the thundering herd: a bounded number of generations in flight, a bounded
waiting room in front of them, and a bounded wait in it. Past any bound: Overloaded(retry_after),
which the gateway turns into 503 + Retry-After. Memory is O(max_in_flight + max_waiting), never
more, however many clients reconnect at once.

In process only, on purpose: what it protects is this gateway process (its event loop, sockets,
buffers), and each gateway bounding itself bounds the fleet at N x max_in_flight. GPU capacity is
guarded downstream (tier lanes, shedding, the engines' own admission), and quotas are the shared
Redis part. A Redis semaphore would add a round trip to every request and leak the slots of a
gateway that dies mid-stream; nothing here can outlive its process.

Waiters are served first come, first served: a released slot is handed straight to the oldest
waiter, so a newcomer can never overtake someone who has been waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

from fairway.limits.errors import Overloaded


@dataclass
class Slot:
    """One admitted generation. release() is idempotent, so error paths may call it freely."""

    _admission: Admission = field(repr=False)
    _started: float = field(default_factory=time.monotonic)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(time.monotonic() - self._started)


class Admission:
    def __init__(self, max_in_flight: int = 256, max_waiting: int = 1024, timeout_s: float = 5.0) -> None:
        if max_in_flight < 1 or max_waiting < 0:
            raise ValueError("max_in_flight must be >= 1 and max_waiting >= 0")
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._hold_s = 1.0  # moving average of how long a slot is held: sizes Retry-After

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        # Only pending futures are queued: handed-over ones are popped, abandoned ones removed.
        return len(self._waiters)

    def retry_after(self) -> float:
        """About when a slot would be free for a newcomer: the queue ahead, drained max_in_flight at
        a time, one average hold each. At least 1 s, at most a minute."""
        rounds = (self.waiting + 1) / self.max_in_flight
        return min(60.0, max(1.0, self._hold_s * rounds))

    async def acquire(self, timeout: float | None = None) -> Slot:
        """A slot, or Overloaded: at once when the waiting room is full, else after `timeout`
        seconds (default timeout_s; 0 = do not wait)."""
        if self._in_flight < self.max_in_flight and not self.waiting:
            self._in_flight += 1
            return Slot(self)
        timeout = self.timeout_s if timeout is None else timeout
        if self.waiting >= self.max_waiting:
            raise Overloaded(self.retry_after(), "queue_full")
        if timeout <= 0:
            raise Overloaded(self.retry_after(), "timeout")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return Slot(self)  # handed a slot in the same instant the wait ran out: keep it
            self._forget(waiter)
            raise Overloaded(self.retry_after(), "timeout") from None
        except BaseException:  # cancelled (client gone): never take a slot with us
            if waiter.done() and not waiter.cancelled():
                self._release(None)
            else:
                self._forget(waiter)
            raise
        return Slot(self)  # the releaser handed its slot over: _in_flight already counts it

    @asynccontextmanager
    async def slot(self, timeout: float | None = None) -> AsyncIterator[Slot]:
        held = await self.acquire(timeout)
        try:
            yield held
        finally:
            held.release()

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        waiter.cancel()
        with suppress(ValueError):
            self._waiters.remove(waiter)

    def _release(self, held_s: float | None) -> None:
        if held_s is not None:
            self._hold_s = 0.8 * self._hold_s + 0.2 * held_s
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands; _in_flight stays the same
                return
        self._in_flight -= 1
