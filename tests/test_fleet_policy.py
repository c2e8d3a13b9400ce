"""The fleet manager's forecast and scaling policy on their own (plain numbers, a clock passed
in), and its bounds checked at start: `fairway fleet` refuses bounds that cannot work, saying
which."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fairway.fleet import (
    FleetConfigError,
    FleetManager,
    FleetView,
    HoltForecaster,
    ScalingBounds,
    ScalingPolicy,
    ScalingTarget,
)
from fairway.fleet.local import LocalBackend
from fairway.fleet.signals import ArrivalMeter, FleetSample
from fairway.fleet.startup import StartupMeter
from fairway.replica.registry import InProcessRegistry, ReplicaInfo


def test_holt_sees_a_ramp_coming():
    """Arrivals rising by 0.5/s each second: the forecast a minute ahead is near where the ramp
    will be (level + trend * 60), not where it is now."""
    holt = HoltForecaster(alpha=0.5, beta=0.3)
    for t in range(60):
        holt.observe(0.5 * t)
    assert holt.forecast(0) == pytest.approx(29.5, rel=0.05)
    assert holt.forecast(60) == pytest.approx(59.5, rel=0.05)
    for _ in range(120):  # then flat: the trend dies away
        holt.observe(10.0)
    assert holt.forecast(60) == pytest.approx(10.0, rel=0.05)


@pytest.mark.parametrize(("bounds", "says"), [
    (dict(min_replicas=0), "never scales to zero"),
    (dict(min_replicas=3, max_replicas=2), r"max replicas \(2\) is below min replicas \(3\)"),
    (dict(step=0), "step must be at least 1"),
    (dict(cooldown_s=-1), "must not be negative"),
])
def test_bounds_that_cannot_work_are_refused(bounds, says):
    with pytest.raises(FleetConfigError, match=says):
        ScalingBounds(**bounds)


def test_the_cli_refuses_bad_bounds_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "fairway.cli", "fleet", "--min-replicas", "4", "--max-replicas", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "fairway fleet: max replicas (2) is below min replicas (4)"


def view(at: float, desired: int, rps: float, **kw) -> FleetView:
    return FleetView(at=at, desired=desired, serving=kw.pop("serving", desired), forecast_rps=rps, **kw)


def test_forecast_adds_up_to_a_step_per_cooldown_within_max():
    policy = ScalingPolicy(ScalingBounds(1, 5, step=2, cooldown_s=10, idle_s=30), ScalingTarget(replica_rps=1.0))
    assert policy.decide(view(0, 1, 0.5)).reason == "hold"
    first = policy.decide(view(1, 1, 10.0))  # 10/s needs 13 at 0.8 each: +2 (the step)
    assert (first.add, first.reason, first.target) == (2, "forecast", 3)
    assert policy.decide(view(5, 3, 10.0)).reason == "cooling down"
    assert policy.decide(view(11, 3, 10.0)).target == 5
    assert policy.decide(view(30, 5, 10.0)).add == 0  # at max


def test_a_lost_replica_is_replaced_first_without_cooldown():
    policy = ScalingPolicy(ScalingBounds(1, 5, cooldown_s=60), ScalingTarget(replica_rps=1.0))
    policy.decide(view(0, 2, 1.0))
    policy.decide(view(1, 2, 4.0))  # up to 3
    lost = policy.decide(view(2, 2, 4.0))  # a spot reclaim: the backend counts 2
    assert (lost.add, lost.reason, lost.target) == (1, "replace", 3)


def test_pressure_adds_one_whatever_the_forecast():
    policy = ScalingPolicy(ScalingBounds(1, 5, cooldown_s=0), ScalingTarget(replica_rps=10.0, ttft_target_s=2.0))
    assert policy.decide(view(0, 1, 1.0, ttft_p99_s=1.7)).reason == "ttft"
    assert policy.decide(view(1, 2, 1.0, waiting=17)).reason == "queue"


def test_idle_drains_one_per_idle_period_never_below_min():
    policy = ScalingPolicy(ScalingBounds(2, 5, cooldown_s=0, idle_s=30), ScalingTarget(replica_rps=1.0))
    policy.decide(view(0, 4, 0.0))
    assert policy.decide(view(29, 4, 0.0)).drain == 0
    assert policy.decide(view(30, 4, 0.0)).drain == 1
    assert policy.decide(view(45, 3, 2.0)).drain == 0  # load back: needs 3, the idle clock restarts
    assert policy.decide(view(46, 3, 0.0)).drain == 0
    assert policy.decide(view(76, 3, 0.0)).drain == 1
    assert policy.decide(view(200, 2, 0.0)).drain == 0  # at min


def test_no_drain_while_a_replica_is_still_starting():
    """The fleet just added one and the forecast fell back: the replica drained could be the only
    one serving. The idle clock starts once every replica serves."""
    policy = ScalingPolicy(ScalingBounds(1, 5, cooldown_s=0, idle_s=4), ScalingTarget(replica_rps=1.0))
    policy.decide(view(0, 2, 0.0, serving=1))
    assert policy.decide(view(10, 2, 0.0, serving=1)).drain == 0
    assert policy.decide(view(11, 2, 0.0, serving=2)).drain == 0  # both serve: the clock starts
    assert policy.decide(view(15, 2, 0.0, serving=2)).drain == 1


def test_arrivals_are_the_growth_of_the_replicas_counts():
    def sample(at: float, **arrived: int) -> FleetSample:
        return FleetSample(at, [ReplicaInfo(i, "m", i, 1, 1, arrived=n) for i, n in arrived.items()])

    meter = ArrivalMeter(window_s=1.0)
    assert meter.rate(sample(0, a=0, b=10)) is None
    assert meter.rate(sample(0.5, a=1, b=10)) is None  # within the window
    assert meter.rate(sample(2, a=6, b=12)) == (4.0, 2)
    # 3 jobs moved from b's queue to a's (b drains): no arrival; c is new: no baseline yet
    assert meter.rate(sample(3, a=9, b=9, c=40)) == (0.0, 1)
    assert meter.rate(sample(4, a=10, b=9, c=43)) == (4.0, 1)


def test_a_replicas_start_up_is_measured_from_the_ask_to_ready():
    """From the counts the backend reports: each ask ends when the ready count rises (the longest of
    the latest is the estimate), or, when a starting replica leaves without getting ready, is
    dropped unmeasured."""
    meter = StartupMeter()
    meter.seen(0, desired=0, ready=0)
    meter.asked(0, 1)
    meter.seen(1, desired=1, ready=0)
    assert meter.seconds is None  # still starting
    meter.seen(9, desired=1, ready=1)
    assert meter.seconds == 9
    meter.asked(20, 1)
    meter.seen(40, desired=2, ready=2)
    assert meter.seconds == 20  # the longest of the latest

    meter = StartupMeter()
    meter.seen(0, desired=0, ready=0)
    meter.asked(0, 2)
    meter.seen(3, desired=2, ready=1)  # one of the two
    meter.seen(30, desired=1, ready=1)  # the other left before it got ready: not a start-up
    assert meter.seconds == 3


def test_the_forecast_looks_as_far_ahead_as_replicas_took_to_start():
    policy = ScalingPolicy(ScalingBounds(1, 4), ScalingTarget(replica_rps=1.0, lead_s=5))
    manager = FleetManager(LocalBackend("redis://127.0.0.1:1"), InProcessRegistry(), policy, interval_s=1.0)
    assert manager.horizon_s == 5  # nothing measured: the lead
    manager.startup.asked(0, 1)
    manager.startup.seen(3, desired=1, ready=1)
    assert manager.horizon_s == 5  # started sooner than the lead
    manager.startup.asked(10, 1)
    manager.startup.seen(22, desired=2, ready=2)
    assert manager.horizon_s == 13  # its start-up and a tick
