"""Inboxes: queues whose items stay with the consumer that took them until it acknowledges them.

The job queue hands a job over once (a claim pops it). That suits jobs, but not the replicas'
reports: the gateway whose recorder took a reply's "finished" report may die before it has
saved the reply and its usage, and nobody else would ever see that report. So reports go
through an inbox: take() leaves each item pending with its consumer; ack() after the work is
done removes it; an item left unacknowledged for min_idle_s (its consumer died, hung, or its
work failed) is reclaim()ed by whichever consumer asks next, with its attempts counted. Delivery
is at least once: the consumer's work must be idempotent (the recorder's is: first writer wins,
usage is stored once per reply).

On Redis an inbox is a stream with one consumer group (XREADGROUP, XACK, XPENDING/XCLAIM), so
what a process had taken survives its death. In process it is the same bookkeeping in memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Delivery:
    id: str  # the backend's, for ack()
    item: dict[str, Any]
    attempts: int  # 1 when first taken; one more each time it is reclaimed


class Inbox(ABC):
    @abstractmethod
    async def post(self, inbox: str, item: dict[str, Any]) -> None:
        """Add a JSON-able item."""

    @abstractmethod
    async def take(self, inbox: str, consumer: str, *, max_count: int, timeout: float | None = 0.0,
                   acked: Sequence[Delivery] = ()) -> list[Delivery]:
        """Up to max_count items nobody has taken yet, oldest first, now pending with consumer.
        timeout as JobQueue.claim(): 0 = don't wait, None = until there is one, else seconds.
        acked: items of this inbox done with, acknowledged first (as ack(); with timeout 0 in the
        same round trip), so a consumer's batch and its next look cost one round trip."""

    @abstractmethod
    async def ack(self, inbox: str, deliveries: Sequence[Delivery]) -> None:
        """These items are done with: they are gone from the inbox."""

    @abstractmethod
    async def reclaim(self, inbox: str, consumer: str, *, min_idle_s: float,
                      max_count: int) -> list[Delivery]:
        """Up to max_count items taken at least min_idle_s ago and not acknowledged (by any
        consumer, this one included), now pending with consumer, their attempts counted."""

    async def close(self) -> None:  # noqa: B027  (only a Redis inbox holds connections)
        """Release connections."""
