"""What the fleet manager sees, read from the replicas' heartbeats (fairway/replica/registry.py):
one FleetSample per tick, and the arrivals per second between two samples (ArrivalMeter)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fairway.domain import Lane
from fairway.replica.registry import ReplicaInfo, ReplicaRegistry


@dataclass
class FleetSample:
    at: float  # monotonic
    replicas: list[ReplicaInfo] = field(default_factory=list)

    @property
    def serving(self) -> list[ReplicaInfo]:
        return [r for r in self.replicas if not r.draining]

    @property
    def draining(self) -> list[str]:
        return [r.id for r in self.replicas if r.draining]

    def per_lane(self, what: str) -> dict[Lane, int]:
        """Replies running or waiting (what: "running" / "waiting") per lane, over the fleet."""
        totals = dict.fromkeys(Lane, 0)
        for replica in self.replicas:
            for lane, n in getattr(replica, what).items():
                if lane in totals:
                    totals[Lane(lane)] += n
        return totals

    @property
    def waiting(self) -> int:
        return sum(self.per_lane("waiting").values())

    @property
    def kv_used(self) -> float:
        """The share of the serving replicas' KV blocks in use (0 with none)."""
        total = sum(r.kv_blocks for r in self.serving)
        return 1.0 - sum(r.free_kv_blocks for r in self.serving) / total if total else 0.0

    @property
    def ttft_p99_s(self) -> float | None:
        """The worst of the serving replicas' TTFT p99 over their recent replies."""
        known = [r.ttft_p99_s for r in self.serving if r.ttft_p99_s is not None]
        return max(known, default=None)


async def read_sample(registry: ReplicaRegistry) -> FleetSample:
    """The live replicas now; raises what the registry raises when it cannot be read."""
    return FleetSample(time.monotonic(), await registry.live())


@dataclass
class ArrivalMeter:
    """Arrivals per second over the fleet from the replicas' `arrived` counts: the sum of their
    changes over a window of at least window_s, over replicas at both ends of it (one that
    appeared has no baseline yet), never below zero. A job a failover moves counts once: it
    leaves one replica's queue and joins another's, and claimed as a continuation it is not
    counted again. A second's window at least: shorter ones are mostly Poisson noise at low
    rates, and the forecast's trend would amplify it."""

    window_s: float = 1.0
    _start: FleetSample | None = None

    def rate(self, sample: FleetSample) -> tuple[float, float] | None:
        """(arrivals per second, the window's seconds) once a window has passed, else None."""
        if self._start is None:
            self._start = sample
            return None
        dt = sample.at - self._start.at
        if dt < self.window_s:
            return None
        before = {r.id: r.arrived for r in self._start.replicas}
        grown = sum(r.arrived - before[r.id] for r in sample.replicas if r.id in before)
        self._start = sample
        return max(0, grown) / dt, dt
