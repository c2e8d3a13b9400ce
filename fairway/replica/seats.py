"""The replies a replica claims at once, by lane, and how fast it finishes them.

Seats: up to `capacity` replies of any lane. When every seat is taken, paid work is still
claimed while fewer than `capacity` paid replies are in flight: the engine makes room for it by
preempting its newest lower-lane sequence (fairway/engine/scheduler.py), so a flood of free
replies delays a paid one by a step, not by a whole free reply. Free and background work beyond
the seats waits in the replica's queue, where the router sees it (ReplicaInfo.waiting).
Background work there ages as in the engine: once some has waited background_max_wait_s (by the
queue depths each heartbeat reads) the next free seat takes background work first.

Drain rate: how many replies a second the replica finishes when its seats are full: its seats
over the mean time its last DRAIN_SAMPLES replies held one (claim to end, engine wait included).
The router divides the queue ahead of a new request by it to predict its wait
(fairway/router/pressure.py). Measured over seat time, not wall time, so a replica that was idle
a minute ago is not taken for a slow one the moment a burst arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque

from fairway.domain import LANE_ORDER, Lane

DRAIN_SAMPLES = 64  # replies the drain rate is measured over: the latest ones


AGED_ORDER: tuple[Lane, ...] = (Lane.BACKGROUND, Lane.PAID, Lane.FREE)


class Seats:
    def __init__(self, capacity: int, background_max_wait_s: float | None = 30.0) -> None:
        self.capacity = capacity
        self.background_max_wait_s = background_max_wait_s
        self._background_since: float | None = None  # background work waits in the queue since
        self.taken: Counter[Lane] = Counter()
        self._freed = asyncio.Event()
        self._held: deque[float] = deque(maxlen=DRAIN_SAMPLES)  # seconds the latest replies held a seat

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

    def take(self, lane: Lane) -> float:
        """A seat for a reply of this lane; returns when it was taken (for give)."""
        self.taken[lane] += 1
        if lane == Lane.BACKGROUND and self._background_since is not None:
            self._background_since = time.monotonic()  # one background job per bound while work floods in
        return time.monotonic()

    def give(self, lane: Lane, taken_at: float) -> None:
        self.taken[lane] -= 1
        self._held.append(time.monotonic() - taken_at)
        self._freed.set()

    async def freed(self) -> None:
        """Until a seat is given back."""
        await self._freed.wait()
        self._freed.clear()

    def drain_rate(self) -> float | None:
        """Replies finished per second with every seat busy; None before any reply ended."""
        if not self._held:
            return None
        return self.capacity / max(sum(self._held) / len(self._held), 1e-3)
