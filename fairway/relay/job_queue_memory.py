"""InProcessJobQueue: the embedded job queue (one process), a deque per lane."""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fairway.domain import LANE_ORDER, Lane
from fairway.relay.arrivals import Arrivals
from fairway.relay.job_queue import DEFAULT_QUEUE, ClaimedJob, JobQueue, decode_job, encode_job


@dataclass
class _Queue(Arrivals):
    lanes: dict[Lane, deque[str]] = field(default_factory=lambda: {lane: deque() for lane in LANE_ORDER})


class InProcessJobQueue(JobQueue):
    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}

    async def submit(self, job: dict[str, Any], lane: Lane | str = Lane.FREE, *, queue: str = DEFAULT_QUEUE,
                     front: bool = False) -> str:
        lane = Lane(lane)
        job_id = uuid.uuid4().hex
        raw = encode_job(job_id, job)  # JSON round trip: same semantics (and failures) as Redis
        q = self._queues.setdefault(queue, _Queue())
        (q.lanes[lane].appendleft if front else q.lanes[lane].append)(raw)
        q.notify()
        return job_id

    async def claim_many(self, *, queue: str = DEFAULT_QUEUE, max_count: int,
                         timeout: float | None = 0.0) -> list[ClaimedJob]:
        q = self._queues.setdefault(queue, _Queue())
        if not await q.wait_until(lambda: any(q.lanes.values()), timeout):
            return []
        lane = next(lane for lane in LANE_ORDER if q.lanes[lane])
        waiting = q.lanes[lane]
        return [decode_job(waiting.popleft(), lane) for _ in range(min(max_count, len(waiting)))]

    async def depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        q = self._queues.get(queue) or _Queue()
        return {lane: len(q.lanes[lane]) for lane in LANE_ORDER}
