"""How long a replica takes to start: from the fleet asking for it to the backend reporting it
ready (its /ready answering, a pod's readiness), measured on the replicas the fleet adds.

The forecast must look at least that far ahead, or a replica asked for when the forecast first
needs it is live only after the load it was for has arrived. A fixed --lead is a guess made once;
the start-up time changes with the machine (a replica that loads while others serve on the same
cores takes longer than one that loads on an idle machine), so the fleet measures it.

The backend reports counts, not which replica got ready: each tick, the replicas still starting
are the desired ones that are not ready, and the asks beyond that many have ended, oldest first;
they were served when the ready count rose, else they ended otherwise (drained, reclaimed, or a
ready one left as one came up in the same tick) and are not counted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

KEEP = 4  # the latest start-ups the estimate is taken over


@dataclass
class StartupMeter:
    _asked: deque[float] = field(default_factory=deque)  # when each replica still starting was asked for
    _ready: int | None = None  # the backend's ready count at the last look
    _seconds: deque[float] = field(default_factory=lambda: deque(maxlen=KEEP))

    def asked(self, at: float, n: int) -> None:
        """n replicas asked for at this moment (any clock that only goes forward)."""
        self._asked.extend([at] * n)

    def seen(self, at: float, desired: int, ready: int) -> None:
        """The backend's counts at this moment."""
        rose = max(0, ready - self._ready) if self._ready is not None else 0
        self._ready = ready
        while len(self._asked) > max(0, desired - ready):
            asked_at = self._asked.popleft()
            if rose:
                rose -= 1
                self._seconds.append(at - asked_at)

    @property
    def seconds(self) -> float | None:
        """The longest of the latest start-ups (a replica starting now is likely as slow as the
        slowest of them); None before the first."""
        return max(self._seconds, default=None)
