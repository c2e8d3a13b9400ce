"""The scaling policy: given what the fleet is and the forecast, add replicas, drain one, or hold.

Plain numbers in, a Decision out, its own clock passed in: the fleet manager and the fleet
simulation (bench/fleet_sim.py) run the same code. In order:

1. replace: the backend has fewer replicas than the target (a spot replica reclaimed, one that
   died): add them back at once, before anything else and without a cool-down;
2. add: the forecast needs more replicas than the target (each serves replica_rps within the
   TTFT target, planned at `headroom` of it), or the fleet is under pressure now (TTFT p99 near
   its target, or more waiting replies than queue_per_replica per serving replica): add up to
   `step`, never past max_replicas, at most once per cool-down;
3. drain: the forecast fits in one replica fewer, and has for idle_s while every replica serves
   (none still starting: the one drained could be the only one serving): drain one, never below
   min_replicas, at most once per cool-down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class FleetConfigError(ValueError):
    """Scaling settings that cannot work; the message says which and why."""


@dataclass(frozen=True)
class ScalingBounds:
    min_replicas: int = 1
    max_replicas: int = 8
    step: int = 1  # replicas added by one decision at most
    cooldown_s: float = 30.0  # between two scaling actions (a replacement waits for none)
    idle_s: float = 120.0  # over-provisioned this long before one replica drains

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise FleetConfigError(f"min replicas must be at least 1, got {self.min_replicas}: the fleet never "
                                   "scales to zero")
        if self.max_replicas < self.min_replicas:
            raise FleetConfigError(f"max replicas ({self.max_replicas}) is below min replicas ({self.min_replicas})")
        if self.step < 1:
            raise FleetConfigError(f"the scaling step must be at least 1 replica, got {self.step}")
        if self.cooldown_s < 0 or self.idle_s < 0:
            raise FleetConfigError(f"the cool-down and idle times must not be negative, got {self.cooldown_s} s "
                                   f"and {self.idle_s} s")


@dataclass(frozen=True)
class ScalingTarget:
    replica_rps: float  # replies per second one replica serves within the TTFT target (measured)
    ttft_target_s: float = 2.0  # the TTFT p99 the fleet is sized for
    headroom: float = 0.8  # plan each replica at this share of replica_rps
    lead_s: float = 60.0  # forecast this far ahead: about a replica's start-up time
    queue_per_replica: float = 8.0  # waiting replies per serving replica that add one, forecast or not
    pressure: float = 0.8  # TTFT p99 above this share of its target adds one, forecast or not

    def __post_init__(self) -> None:
        if not self.replica_rps > 0:
            raise FleetConfigError(f"replies per second per replica must be above 0, got {self.replica_rps}")
        if not self.ttft_target_s > 0:
            raise FleetConfigError(f"the TTFT target must be above 0 s, got {self.ttft_target_s}")
        if not 0 < self.headroom <= 1 or not 0 < self.pressure <= 1:
            raise FleetConfigError(f"headroom and pressure are shares in (0, 1], got {self.headroom} and "
                                   f"{self.pressure}")
        if self.lead_s < 0 or self.queue_per_replica <= 0:
            raise FleetConfigError(f"the forecast lead must not be negative and the queue bound must be above 0, "
                                   f"got {self.lead_s} s and {self.queue_per_replica}")


@dataclass(frozen=True)
class FleetView:
    """The fleet at one moment, as the policy needs it."""

    at: float  # seconds, any clock that only goes forward
    desired: int  # replicas the backend has that are or will be serving (starting ones count)
    serving: int  # of them, announced and not draining
    forecast_rps: float  # arrivals per second expected lead_s from now
    ttft_p99_s: float | None = None
    waiting: int = 0  # replies waiting over the fleet


@dataclass(frozen=True)
class Decision:
    add: int = 0
    drain: int = 0
    reason: str = "hold"
    target: int = 0  # the replicas the fleet is meant to have after it


@dataclass
class ScalingPolicy:
    bounds: ScalingBounds
    target_of: ScalingTarget
    target: int | None = None  # the replicas the fleet is meant to have; the backend's count at first
    _last_action: float = field(default=-math.inf)
    _idle_since: float | None = None

    def needed(self, rps: float) -> int:
        """Replicas that serve rps within the TTFT target, within the bounds."""
        n = math.ceil(rps / (self.target_of.replica_rps * self.target_of.headroom) - 1e-9)
        return min(self.bounds.max_replicas, max(self.bounds.min_replicas, n))

    def decide(self, view: FleetView) -> Decision:
        b = self.bounds
        first = self.target is None
        if self.target is None or view.desired > self.target:  # at start, or scaled up by someone else
            self.target = min(b.max_replicas, max(b.min_replicas, view.desired))
        if view.desired < self.target:
            return Decision(add=self.target - view.desired, reason="minimum" if first else "replace",
                            target=self.target)
        pressure = self._pressure(view)
        need = self.needed(view.forecast_rps)
        cooled = view.at - self._last_action >= b.cooldown_s
        if (need > self.target or pressure) and self.target < b.max_replicas:
            self._idle_since = None
            if not cooled:
                return Decision(reason="cooling down", target=self.target)
            n = min(b.step, b.max_replicas - self.target, max(need - self.target, 1))
            return self._act(view.at, n, pressure or "forecast")
        if need >= self.target or pressure or view.serving < view.desired:
            self._idle_since = None
            return Decision(target=self.target)
        if self._idle_since is None:
            self._idle_since = view.at
        if view.at - self._idle_since >= b.idle_s and cooled and self.target > b.min_replicas:
            self._idle_since = view.at  # the next one waits another idle_s
            return self._act(view.at, -1, "idle")
        return Decision(target=self.target)

    def _pressure(self, view: FleetView) -> str:
        t = self.target_of
        if view.ttft_p99_s is not None and view.ttft_p99_s > t.pressure * t.ttft_target_s:
            return "ttft"
        if view.waiting > t.queue_per_replica * max(view.serving, 1):
            return "queue"
        return ""

    def _act(self, at: float, n: int, reason: str) -> Decision:
        assert self.target is not None
        self.target += n
        self._last_action = at
        return Decision(add=max(n, 0), drain=max(-n, 0), reason=reason, target=self.target)
