"""A reply's predicted wait on a replica, and what a free request gets when its pool is full.

Predicted wait: the replies ahead of a new one in the replica's queue (waiting in its lane and
the lanes above it, plus what this gateway placed there since the replica's heartbeat) over the
replica's drain rate (replies finished per second, ReplicaInfo.drain_rate). With nothing
measured yet (no reply finished lately) there is no prediction: a replica is never called full
on missing data.

At capacity: even the pool's least predicted wait is over max_wait_s. Only free requests are
treated, as configured (free_at_capacity):
  shed     refused: 503 with Retry-After, the reply stored SHED;
  mini     served by the model's mini pool (replicas announcing mini_of the model);
  shorten  served with at most shorter_max_tokens (the response says how many).
Paid requests are never treated: they go ahead of free ones in every queue and engine (seats.py,
scheduler.py), so a full pool delays them by a step. Background waits behind both anyway.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from fairway.domain import LANE_ORDER, Lane
from fairway.replica.registry import ReplicaInfo

AtCapacity = Literal["shed", "mini", "shorten"]
AT_CAPACITY: tuple[AtCapacity, ...] = ("shed", "mini", "shorten")
MAX_RETRY_AFTER_S = 60


@dataclass
class PressureSettings:
    max_wait_s: float = 10.0  # a free request predicted to wait longer than this is at capacity
    free_at_capacity: AtCapacity = "shed"
    shorter_max_tokens: int = 128  # shorten: the most a free reply at capacity may generate
    # The user's token quota for the model spent: its mini pool serves instead of a 429, when one runs.
    mini_past_quota: bool = True

    def __post_init__(self) -> None:
        if self.free_at_capacity not in AT_CAPACITY:
            raise ValueError(f"free_at_capacity is one of {', '.join(AT_CAPACITY)}, not {self.free_at_capacity!r}")
        if self.max_wait_s < 0 or self.shorter_max_tokens < 1:
            raise ValueError("max_wait_s must be >= 0 and shorter_max_tokens >= 1")


def ahead(replica: ReplicaInfo, lane: Lane) -> int:
    """Replies waiting on the replica that a new one of this lane waits behind."""
    above = LANE_ORDER[:LANE_ORDER.index(lane) + 1]
    return sum(int(replica.waiting.get(str(lane_), 0)) for lane_ in above)


def predicted_wait(replica: ReplicaInfo, lane: Lane, placed: int = 0) -> float | None:
    """Seconds a new reply of this lane would wait to start there; None: nothing measured yet."""
    queue = ahead(replica, lane) + placed
    if queue == 0:
        return 0.0
    if not replica.drain_rate:
        return None
    return queue / replica.drain_rate


@dataclass(frozen=True)
class Pressure:
    """A pool's state for one lane: the least predicted wait of its replicas."""

    wait_s: float | None
    at_capacity: bool

    @property
    def retry_after_s(self) -> int:
        """What a shed request is told: about when a place may be free."""
        wait = self.wait_s if self.wait_s is not None else 1.0
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(wait)))


def pool_pressure(replicas: list[ReplicaInfo], lane: Lane, placed: Callable[[ReplicaInfo], int],
                  settings: PressureSettings) -> Pressure:
    waits = [w for r in replicas if (w := predicted_wait(r, lane, placed(r))) is not None]
    if len(waits) < len(replicas):  # one without a measurement: no verdict on the pool
        return Pressure(min(waits, default=None), False)
    least = min(waits, default=None)
    return Pressure(least, least is not None and least > settings.max_wait_s)


def under_limit(replicas: list[ReplicaInfo], lane: Lane, placed: Callable[[ReplicaInfo], int],
                settings: PressureSettings) -> list[ReplicaInfo]:
    """The replicas a free request may be placed on: those not predicted past the limit (all of
    them when every one is)."""
    if lane != Lane.FREE:
        return replicas
    ok = [r for r in replicas if (w := predicted_wait(r, lane, placed(r))) is None or w <= settings.max_wait_s]
    return ok or replicas
