"""The predicted wait and the at-capacity verdict (fairway/router/pressure.py), and a replica's
seats by lane (fairway/replica/seats.py)."""

from __future__ import annotations

import time

import pytest

from fairway.domain import LANE_ORDER, Lane
from fairway.replica.registry import ReplicaInfo
from fairway.replica.seats import AGED_ORDER, Seats
from fairway.router.pressure import PressureSettings, pool_pressure, predicted_wait, under_limit

SETTINGS = PressureSettings(max_wait_s=2.0)


def replica(name: str, waiting: dict[str, int], drain_rate: float | None) -> ReplicaInfo:
    return ReplicaInfo(name, "m", f"replica:{name}", 4096, 4000, waiting=waiting, drain_rate=drain_rate)


def none_placed(_: ReplicaInfo) -> int:
    return 0


def test_the_wait_counts_the_replies_ahead_in_its_lane_and_above_over_the_drain_rate() -> None:
    r = replica("a", {"paid": 2, "free": 4, "background": 30}, drain_rate=2.0)
    assert predicted_wait(r, Lane.PAID) == 1.0
    assert predicted_wait(r, Lane.FREE) == 3.0  # background work is never ahead of free
    assert predicted_wait(r, Lane.FREE, placed=2) == 4.0  # this gateway's placements since the heartbeat
    assert predicted_wait(replica("idle", {}, None), Lane.FREE) == 0.0
    assert predicted_wait(replica("new", {"free": 3}, None), Lane.FREE) is None  # nothing measured yet


def test_a_pool_is_at_capacity_only_when_even_its_least_waiting_replica_is_past_the_limit() -> None:
    busy, busier = replica("a", {"free": 6}, 2.0), replica("b", {"free": 20}, 2.0)
    assert pool_pressure([busy, busier], Lane.FREE, none_placed, SETTINGS).at_capacity
    assert pool_pressure([busy, busier], Lane.FREE, none_placed, SETTINGS).retry_after_s == 3
    calm = replica("c", {"free": 1}, 2.0)
    assert not pool_pressure([busy, calm], Lane.FREE, none_placed, SETTINGS).at_capacity
    assert under_limit([busy, busier, calm], Lane.FREE, none_placed, SETTINGS) == [calm]
    assert under_limit([busy, busier], Lane.FREE, none_placed, SETTINGS) == [busy, busier]  # all past: all
    assert under_limit([busy, calm], Lane.PAID, none_placed, SETTINGS) == [busy, calm]  # paid goes anywhere
    # A replica without a measurement leaves the pool without a verdict: never full on missing data.
    assert not pool_pressure([busy, replica("new", {"free": 50}, None)], Lane.FREE, none_placed, SETTINGS).at_capacity


def test_bad_pressure_settings_are_refused_at_start() -> None:
    with pytest.raises(ValueError, match="free_at_capacity"):
        PressureSettings(free_at_capacity="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PressureSettings(shorter_max_tokens=0)


async def test_full_seats_still_take_paid_work_up_to_the_capacity_in_paid_replies() -> None:
    seats = Seats(2)
    assert seats.open_lanes() == LANE_ORDER
    free = [seats.take(Lane.FREE), seats.take(Lane.FREE)]
    assert seats.open_lanes() == (Lane.PAID,)
    paid = [seats.take(Lane.PAID), seats.take(Lane.PAID)]
    assert seats.open_lanes() == ()
    seats.give(Lane.PAID, paid[0])
    assert seats.open_lanes() == (Lane.PAID,)  # 3 in flight, 2 seats: still only paid
    seats.give(Lane.FREE, free[0])
    seats.give(Lane.FREE, free[1])
    assert seats.open_lanes() == LANE_ORDER


def test_the_drain_rate_is_seats_over_the_mean_time_a_reply_holds_one() -> None:
    seats = Seats(4)
    assert seats.drain_rate() is None
    now = time.monotonic()
    seats.give(Lane.FREE, now - 2.0)
    seats.give(Lane.FREE, now - 2.0)
    assert seats.drain_rate() == pytest.approx(2.0, rel=0.01)


def test_background_work_queued_past_its_bound_is_claimed_first_once_a_seat_is_free() -> None:
    seats = Seats(2, background_max_wait_s=0.05)
    seats.waiting({Lane.PAID: 0, Lane.FREE: 9, Lane.BACKGROUND: 1})
    assert seats.open_lanes() == LANE_ORDER
    time.sleep(0.06)
    assert seats.open_lanes() == AGED_ORDER
    seats.take(Lane.BACKGROUND)  # the next background job waits a bound of its own
    assert seats.open_lanes() == LANE_ORDER
    seats.waiting({Lane.PAID: 0, Lane.FREE: 9, Lane.BACKGROUND: 0})
    time.sleep(0.06)
    assert seats.open_lanes() == LANE_ORDER
