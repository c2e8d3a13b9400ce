"""What this gateway placed on each replica that the replica's last heartbeat does not count yet.

A heartbeat's load is measured every 0.5 s; a burst of requests arrives within milliseconds. Each
gateway adds what it placed on a replica after that replica measured its load (its announcement's
measured_at), so the burst's second request already sees the first, and the next heartbeat (which
counts them in its queue or as claimed) takes over. Wall clocks are compared across processes:
on one machine or NTP-synced ones the skew is far below a heartbeat, and a skewed clock only
miscounts a burst for that long.
"""

from __future__ import annotations

import time
from collections import deque

from fairway.replica.registry import ReplicaInfo


class Placed:
    def __init__(self) -> None:
        self._at: dict[str, deque[float]] = {}  # replica id -> wall times of placements, oldest first

    def add(self, replica_id: str, at: float | None = None) -> None:
        self._at.setdefault(replica_id, deque()).append(time.time() if at is None else at)

    def since_heartbeat(self, replica: ReplicaInfo) -> int:
        times = self._at.get(replica.id)
        if not times:
            return 0
        while times and times[0] <= replica.measured_at:  # counted by the heartbeat now
            times.popleft()
        return len(times)

    def forget_except(self, replica_ids: set[str]) -> None:
        """Drop replicas that left the registry."""
        for gone in self._at.keys() - replica_ids:
            del self._at[gone]
