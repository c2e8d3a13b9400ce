"""The fleet manager's loop: each tick, read the replicas' heartbeats and the backend, feed the
arrivals to the forecast, ask the policy, act through the backend.

The forecast looks ahead the longer of the policy's lead_s and the replicas' measured start-up
(startup.py) plus a tick: a replica asked for then is live when the load it is for arrives.

Missing data never scales: while the registry (Redis) or the backend (the Kubernetes API) does
not answer, or no replica announces itself although the backend has ready ones, the fleet is
kept as it is; the log says so once, and fairway:fleet_holding{source} is 1 until it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from fairway.fleet.backend import Backend, BackendError, BackendUnavailable
from fairway.fleet.forecast import HoltForecaster
from fairway.fleet.policy import Decision, FleetView, ScalingPolicy
from fairway.fleet.signals import ArrivalMeter, FleetSample, read_sample
from fairway.fleet.startup import StartupMeter
from fairway.replica.registry import ReplicaRegistry
from fairway.usage import metrics

log = logging.getLogger(__name__)
SOURCES = ("registry", "backend")


@dataclass
class FleetManager:
    backend: Backend
    registry: ReplicaRegistry
    policy: ScalingPolicy
    forecaster: HoltForecaster = field(default_factory=HoltForecaster)
    interval_s: float = 1.0
    meter: ArrivalMeter = field(default_factory=ArrivalMeter)
    startup: StartupMeter = field(default_factory=StartupMeter)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)  # (monotonic, decision) of each action
    _holding: dict[str, str] = field(default_factory=dict)  # source -> why

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every interval_s until stop is set."""
        await self.backend.start()
        for source in SOURCES:
            metrics.FLEET_HOLDING.labels(source).set(0)
        while not stop.is_set():
            await self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    async def tick(self) -> Decision | None:
        """One look and one decision; None while holding on missing data."""
        try:
            sample = await read_sample(self.registry)
        except Exception as exc:  # Redis away (whatever its client raises): hold, say so
            return self._hold("registry", f"the replica registry does not answer ({exc.__class__.__name__}: {exc})")
        try:
            state = await self.backend.state()
        except (BackendUnavailable, BackendError) as exc:
            return self._hold("backend", str(exc))
        if state.ready and not sample.replicas:
            return self._hold("registry", f"no replica announces itself while {state.ready} are ready")
        self._answered()
        now = time.monotonic()
        self.startup.seen(now, state.desired, state.ready)
        rate = self.meter.rate(sample)
        if rate is not None:
            self.forecaster.observe(*rate)
        demand = max(self.forecaster.forecast(0.0), self.forecaster.forecast(self.horizon_s))
        view = FleetView(at=now, desired=state.desired, serving=len(sample.serving),
                         forecast_rps=demand, ttft_p99_s=sample.ttft_p99_s, waiting=sample.waiting)
        decision = self.policy.decide(view)
        self._gauges(state.desired, state.ready, len(sample.serving), rate, demand)
        if decision.add or decision.drain:
            await self._act(decision, view, sample)
        return decision

    @property
    def horizon_s(self) -> float:
        """How far ahead the forecast looks: lead_s, or longer when replicas took longer to start."""
        measured = self.startup.seconds
        lead = self.policy.target_of.lead_s
        return lead if measured is None else max(lead, measured + self.interval_s)

    async def _act(self, decision: Decision, view: FleetView, sample: FleetSample) -> None:
        before = view.desired
        log.info("fleet: %s, %d -> %d replicas (forecast %.2f replies/s %.0f s ahead, TTFT p99 %s, %d waiting)",
                 decision.reason, before, decision.target, view.forecast_rps, self.horizon_s,
                 "-" if view.ttft_p99_s is None else f"{view.ttft_p99_s:.2f} s", view.waiting)
        try:
            if decision.add:
                await self.backend.add(decision.add)
                self.startup.asked(view.at, decision.add)
            else:
                least = min(sample.serving, key=lambda r: (r.load, r.started_at), default=None)
                await self.backend.drain(least.id if least is not None else None)
        except (BackendUnavailable, BackendError) as exc:
            self._hold("backend", f"scaling failed: {exc}")  # the next tick sees the count as it is
            return
        self.decisions.append((view.at, decision))
        metrics.FLEET_SCALING.labels("up" if decision.add else "down", decision.reason).inc()
        metrics.FLEET_REPLICAS.labels("target").set(decision.target)

    def _hold(self, source: str, why: str) -> None:
        if self._holding.get(source) != why:
            log.warning("fleet: %s; keeping the fleet as it is (target %s) until it answers", why,
                        self.policy.target if self.policy.target is not None else "not set yet")
        self._holding[source] = why
        metrics.FLEET_HOLDING.labels(source).set(1)
        return None

    def _answered(self) -> None:
        for source in list(self._holding):
            log.info("fleet: %s answers again", source)
            del self._holding[source]
            metrics.FLEET_HOLDING.labels(source).set(0)

    @property
    def holding(self) -> dict[str, str]:
        """Sources that do not answer now, and why."""
        return dict(self._holding)

    def _gauges(self, desired: int, ready: int, serving: int, rate: tuple[float, float] | None,
                demand: float) -> None:
        for state, value in (("desired", desired), ("ready", ready), ("serving", serving),
                             ("target", self.policy.target or 0)):
            metrics.FLEET_REPLICAS.labels(state).set(value)
        if rate is not None:
            metrics.FLEET_ARRIVALS.labels("observed").set(rate[0])
        metrics.FLEET_ARRIVALS.labels("forecast").set(demand)
        metrics.FLEET_HORIZON.set(self.horizon_s)
