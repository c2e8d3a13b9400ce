"""InProcessJobQueue: the embedded job queue (one process), a deque per lane, and the claimed
jobs kept until they are acknowledged."""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fairway.domain import LANE_ORDER, Lane
from fairway.relay.arrivals import Arrivals
from fairway.relay.job_queue import DEFAULT_QUEUE, ClaimedJob, JobQueue, Part, decode_job, encode_job


@dataclass
class _Queue(Arrivals):
    # Each job as (id, its JSON): a JSON round trip gives the same semantics (and failures) as Redis.
    lanes: dict[Lane, deque[tuple[str, str]]] = field(default_factory=lambda: {lane: deque() for lane in LANE_ORDER})
    claimed: dict[str, ClaimedJob] = field(default_factory=dict)  # by id, in claim order


class InProcessJobQueue(JobQueue):
    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}

    async def submit(self, job: dict[str, Any], lane: Lane | str = Lane.FREE, *, queue: str = DEFAULT_QUEUE,
                     front: bool = False) -> str:
        lane = Lane(lane)
        job_id = uuid.uuid4().hex
        q = self._queues.setdefault(queue, _Queue())
        (q.lanes[lane].appendleft if front else q.lanes[lane].append)((job_id, encode_job(job_id, job)))
        q.notify()
        return job_id

    async def claim_many(self, *, queue: str = DEFAULT_QUEUE, max_count: int,
                         timeout: float | None = 0.0, lanes: Sequence[Lane] = LANE_ORDER) -> list[ClaimedJob]:
        q = self._queues.setdefault(queue, _Queue())
        if not await q.wait_until(lambda: any(q.lanes[lane] for lane in lanes), timeout):
            return []
        lane = next(lane for lane in lanes if q.lanes[lane])
        waiting = q.lanes[lane]
        claimed = [decode_job(waiting.popleft()[1], lane) for _ in range(min(max_count, len(waiting)))]
        q.claimed.update((c.id, c) for c in claimed)
        return claimed

    async def ack(self, claimed: Sequence[ClaimedJob], *, queue: str = DEFAULT_QUEUE) -> None:
        q = self._queues.get(queue)
        if q is None:
            return
        done = {c.id for c in claimed}
        for job_id in done:
            q.claimed.pop(job_id, None)
        for lane in LANE_ORDER:  # waiting ones too: unfinished() hands those over unclaimed
            if any(job_id in done for job_id, _ in q.lanes[lane]):
                q.lanes[lane] = deque(item for item in q.lanes[lane] if item[0] not in done)

    async def unfinished(self, *, queue: str = DEFAULT_QUEUE, part: Part = "all") -> list[ClaimedJob]:
        q = self._queues.get(queue) or _Queue()
        waiting = [decode_job(raw, lane) for lane in LANE_ORDER for _, raw in q.lanes[lane]]
        return {"all": [*q.claimed.values(), *waiting], "claimed": list(q.claimed.values()), "waiting": waiting}[part]

    async def delete(self, *, queue: str = DEFAULT_QUEUE) -> None:
        self._queues.pop(queue, None)

    async def depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        q = self._queues.get(queue) or _Queue()
        return {lane: len(q.lanes[lane]) for lane in LANE_ORDER}
