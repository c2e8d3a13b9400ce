"""The job queue: gateways submit generation jobs, replica workers claim them, paid lane first.

A queue is named by its consumer (a replica id, or a model pool the router chose); inside a
queue there is one lane per tier (fairway.domain.Lane). claim() always drains paid before free
before background, so a free burst can delay background work but never a paid request.

Delivery is at least once: a claimed job stays in its queue, with its consumer, until ack()
(the worker acks when the reply has ended). So a replica that dies takes nothing with it: its
queue's unfinished() jobs, claimed or still waiting, are what a failover hands elsewhere, and a
job may therefore run twice; the token log's numbering makes the second producer of a reply fail
at its first append (TokenLog.append), so a client never sees one reply twice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from fairway.domain import LANE_ORDER, Lane

DEFAULT_QUEUE = "default"


Part = Literal["all", "claimed", "waiting"]  # which of a queue's unfinished jobs (JobQueue.unfinished)


@dataclass(frozen=True)
class ClaimedJob:
    id: str
    lane: Lane
    job: dict[str, Any]
    receipt: str = field(default="", compare=False)  # the backend's, for ack()


def encode_job(job_id: str, job: dict[str, Any]) -> str:
    # JSON so the same payload crosses process boundaries unchanged in the Redis backend.
    return orjson.dumps({"id": job_id, "job": job}, option=orjson.OPT_NON_STR_KEYS).decode()


def decode_job(raw: str, lane: Lane, receipt: str = "") -> ClaimedJob:
    data = orjson.loads(raw)
    return ClaimedJob(data["id"], lane, data["job"], receipt)


class JobQueue(ABC):
    """Work submission between gateways (producers of jobs) and replicas (consumers)."""

    @abstractmethod
    async def submit(self, job: dict[str, Any], lane: Lane | str = Lane.FREE, *, queue: str = DEFAULT_QUEUE,
                     front: bool = False) -> str:
        """Queue a JSON-able job; returns its id. front=True puts it at the head of its lane
        (failover continuations go there so the client's pause stays short)."""

    async def claim(self, *, queue: str = DEFAULT_QUEUE, timeout: float | None = 0.0,
                    lanes: Sequence[Lane] = LANE_ORDER) -> ClaimedJob | None:
        """Take the next job, paid before free before background. timeout: 0 = don't wait,
        None = wait until one arrives, else seconds; returns None when it runs out. lanes: only
        these, in this order (a replica whose seats are full still takes paid work)."""
        claimed = await self.claim_many(queue=queue, max_count=1, timeout=timeout, lanes=lanes)
        return claimed[0] if claimed else None

    @abstractmethod
    async def claim_many(self, *, queue: str = DEFAULT_QUEUE, max_count: int,
                         timeout: float | None = 0.0, lanes: Sequence[Lane] = LANE_ORDER) -> list[ClaimedJob]:
        """Take up to max_count jobs waiting in the first of these lanes that has any (paid
        before free before background), waiting as claim() does for there to be one; [] when the
        wait ran out."""

    @abstractmethod
    async def ack(self, claimed: Sequence[ClaimedJob], *, queue: str = DEFAULT_QUEUE) -> None:
        """These claimed jobs are done with (their replies ended, or were handed elsewhere):
        gone from the queue."""

    @abstractmethod
    async def unfinished(self, *, queue: str = DEFAULT_QUEUE, part: Part = "all") -> list[ClaimedJob]:
        """Every job of the queue not acknowledged: those claimed first, then those waiting, in
        the order they would be claimed (part: only the claimed ones, or only the waiting ones).
        For handing a dead or draining consumer's work elsewhere (each then acked here), and for a
        consumer restarted under its id to find what it had claimed; claims nothing."""

    @abstractmethod
    async def delete(self, *, queue: str = DEFAULT_QUEUE) -> None:
        """Drop the queue and whatever is left in it (its consumer is gone for good)."""

    @abstractmethod
    async def depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        """Jobs waiting per lane, not yet claimed (for shedding free work at capacity, and for
        metrics)."""

    async def close(self) -> None:  # noqa: B027  (only a Redis queue holds connections)
        """Release connections."""
