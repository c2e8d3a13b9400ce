"""The replies a replica claims at once, by lane, and how fast it finishes them.

Seats: up to `capacity` replies of any lane. When every seat is taken, paid work is still
claimed while fewer than `capacity` paid replies are in flight: the engine makes room for it by
preempting its newest lower-lane sequence (fairway/engine/scheduler.py), so a flood of free
replies delays a paid one by a step, not by a whole free reply. Free and background work beyond
the seats waits in the replica's queue, where the router sees it (ReplicaInfo.waiting).
Background work there ages as in the engine: once some has waited background_max_wait_s (by the
queue depths each heartbeat reads) the next free seat takes background work first.

Drain rate: replies that left their seat per second over the last DRAIN_WINDOW_S, what the
router divides the queue ahead of a request by to predict its wait (fairway/router/pressure.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

from fairway.domain import LANE_ORDER, Lane

DRAIN_WINDOW_S = 30.0  # long enough to hold a few long replies, short enough to follow a change


AGED_ORDER: tuple[Lane, ...] = (Lane.BACKGROUND, Lane.PAID, Lane.FREE)


class Seats:
    def __init__(self, capacity: int, background_max_wait_s: float | None = 30.0) -> None:
        self.capacity = capacity
        self.background_max_wait_s = background_max_wait_s
        self._background_since: float | None = None  # background work waits in the queue since
        self.taken: Counter[Lane] = Counter()
        self._freed = asyncio.Event()
        self._left: deque[float] = deque()  # monotonic times replies left their seats, oldest first
        self._since = time.monotonic()

    def open_lanes(self) -> tuple[Lane, ...]:
        """The lanes a claim may take from now, in claim order (none: wait for a seat)."""
        if sum(self.taken.values()) < self.capacity:
            bound, since = self.background_max_wait_s, self._background_since
            if bound is not None and since is not None and time.monotonic() - since > bound:
                return AGED_ORDER
            return LANE_ORDER
        if self.taken[Lane.PAID] < self.capacity:
            return (Lane.PAID,)
        return ()

    def waiting(self, depth: dict[Lane, int]) -> None:
        """The queue's depth per lane, as a heartbeat read it."""
        if not depth.get(Lane.BACKGROUND):
            self._background_since = None
        elif self._background_since is None:
            self._background_since = time.monotonic()

    def take(self, lane: Lane) -> None:
        self.taken[lane] += 1
        if lane == Lane.BACKGROUND and self._background_since is not None:
            self._background_since = time.monotonic()  # the next background job waits its own bound

    def give(self, lane: Lane) -> None:
        self.taken[lane] -= 1
        self._left.append(time.monotonic())
        self._freed.set()

    async def freed(self) -> None:
        """Until a seat is given back."""
        await self._freed.wait()
        self._freed.clear()

    def drain_rate(self, now: float | None = None) -> float | None:
        """Replies finished per second over the window (over the replica's life while it is
        younger); None before any has: nothing measured yet."""
        now = time.monotonic() if now is None else now
        while self._left and self._left[0] < now - DRAIN_WINDOW_S:
            self._left.popleft()
        if not self._left:
            return None
        return len(self._left) / max(1.0, min(DRAIN_WINDOW_S, now - self._since))
