"""RedisJobQueue: a List per lane, {prefix}bus:{<queue>}:<lane>; (B)LMPOP takes the first
non-empty lane of a queue, paid, free, background in order. The queue's hash tag keeps its lanes
in one Redis Cluster slot, which LMPOP needs."""

from __future__ import annotations

import uuid
from typing import Any

from fairway.domain import LANE_ORDER, Lane
from fairway.redis_client import Command, RedisClient
from fairway.relay.job_queue import DEFAULT_QUEUE, ClaimedJob, JobQueue, decode_job, encode_job
from fairway.relay.redis_guard import guard


class RedisJobQueue(JobQueue):
    def __init__(self, client: RedisClient, *, prefix: str = "fairway:") -> None:
        self._client = client
        self._prefix = prefix

    def _lane_key(self, queue: str, lane: Lane) -> str:
        return f"{self._prefix}bus:{{{queue}}}:{lane}"

    def submit_command(self, job: dict[str, Any], lane: Lane | str, queue: str,
                       front: bool = False) -> tuple[str, Command]:
        """A new job's id and the command that queues it (for a caller that pipelines it)."""
        job_id = uuid.uuid4().hex
        return job_id, ["LPUSH" if front else "RPUSH", self._lane_key(queue, Lane(lane)), encode_job(job_id, job)]

    async def submit(self, job: dict[str, Any], lane: Lane | str = Lane.FREE, *, queue: str = DEFAULT_QUEUE,
                     front: bool = False) -> str:
        job_id, command = self.submit_command(job, lane, queue, front)
        with guard():
            await self._client.execute(*command)
        return job_id

    async def claim_many(self, *, queue: str = DEFAULT_QUEUE, max_count: int,
                         timeout: float | None = 0.0) -> list[ClaimedJob]:
        keys = [self._lane_key(queue, lane) for lane in LANE_ORDER]
        lanes = dict(zip(keys, LANE_ORDER, strict=True))

        def claimed(popped: Any) -> list[ClaimedJob]:
            if not popped:
                return []
            key, items = popped
            return [decode_job(item, lanes[key]) for item in items]

        with guard():
            if timeout is not None and timeout <= 0:
                return claimed(await self._client.execute("LMPOP", len(keys), *keys, "LEFT", "COUNT", max_count))
            return claimed(await self._client.blocking(
                lambda wait: ["BLMPOP", wait, len(keys), *keys, "LEFT", "COUNT", max_count], timeout))

    async def depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        with guard():
            depths = await self._client.batch([["LLEN", self._lane_key(queue, lane)] for lane in LANE_ORDER])
        return {lane: int(d) for lane, d in zip(LANE_ORDER, depths, strict=True)}
