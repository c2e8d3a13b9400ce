"""InProcessInbox: the embedded inbox (one process), the same bookkeeping as Redis's in memory."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from fairway.relay.arrivals import Arrivals
from fairway.relay.inbox import Delivery, Inbox


@dataclass
class _Pending:
    raw: bytes
    consumer: str
    taken_at: float  # monotonic
    attempts: int


@dataclass
class _Box(Arrivals):
    waiting: deque[tuple[str, bytes]] = field(default_factory=deque)  # (id, JSON), oldest first
    pending: dict[str, _Pending] = field(default_factory=dict)  # taken, not acknowledged
    next_id: int = 0


class InProcessInbox(Inbox):
    def __init__(self) -> None:
        self._boxes: dict[str, _Box] = {}

    async def post(self, inbox: str, item: dict[str, Any]) -> None:
        box = self._boxes.setdefault(inbox, _Box())
        box.next_id += 1
        # JSON: the same values as on Redis
        box.waiting.append((str(box.next_id), orjson.dumps(item, option=orjson.OPT_NON_STR_KEYS)))
        box.notify()

    async def take(self, inbox: str, consumer: str, *, max_count: int, timeout: float | None = 0.0,
                   acked: Sequence[Delivery] = ()) -> list[Delivery]:
        await self.ack(inbox, acked)
        box = self._boxes.setdefault(inbox, _Box())
        if not await box.wait_until(lambda: bool(box.waiting), timeout):
            return []
        taken = []
        for _ in range(min(max_count, len(box.waiting))):
            item_id, raw = box.waiting.popleft()
            box.pending[item_id] = _Pending(raw, consumer, time.monotonic(), 1)
            taken.append(Delivery(item_id, orjson.loads(raw), 1))
        return taken

    async def ack(self, inbox: str, deliveries: Sequence[Delivery]) -> None:
        box = self._boxes.get(inbox)
        if box is None:
            return
        for delivery in deliveries:
            box.pending.pop(delivery.id, None)

    async def reclaim(self, inbox: str, consumer: str, *, min_idle_s: float,
                      max_count: int) -> list[Delivery]:
        box = self._boxes.get(inbox)
        if box is None:
            return []
        now = time.monotonic()
        idle = [(i, p) for i, p in box.pending.items() if now - p.taken_at >= min_idle_s]
        reclaimed = []
        for item_id, pending in idle[:max_count]:
            pending.consumer, pending.taken_at, pending.attempts = consumer, now, pending.attempts + 1
            reclaimed.append(Delivery(item_id, orjson.loads(pending.raw), pending.attempts))
        return reclaimed
