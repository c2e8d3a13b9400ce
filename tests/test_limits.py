"""fairway.limits on both backends: in-process, and Redis (db 14, a key prefix per test) where two
make_limits() instances are two gateways, each with its own client, sharing one server."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis_keys import delete_prefixed

from fairway.limits import (
    Admission,
    Allowed,
    Claimed,
    Denied,
    Existing,
    InProcessWindow,
    Limits,
    LimitsConfig,
    LimitsUnavailable,
    Overloaded,
    Reservation,
    TierLimits,
    body_fingerprint,
    flight_fingerprint,
    format_reset,
    is_cacheable,
    make_limits,
    rate_limit_headers,
)

REDIS_URL = os.environ.get("FAIRWAY_TEST_LIMITS_REDIS_URL", "redis://127.0.0.1:6379/14")

TIERS = {
    "free": TierLimits(tokens_per_minute=5_500, requests_per_minute=3),
    "paid": TierLimits(tokens_per_minute=50_000, requests_per_minute=100),
}


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Gateways:
    """Opens Limits the way gateways would: in process there is one shared object (one process);
    on Redis each open() is a separate client, as a separate gateway process would have."""

    def __init__(self, kind: str, url: str | None = None) -> None:
        self.kind = kind  # memory, redis or cluster (a local Redis Cluster of three masters)
        self.url = url or REDIS_URL
        self.prefix = f"test:{uuid.uuid4().hex[:12]}:"
        self._opened: list[Limits] = []

    def open(self, **overrides: Any) -> Limits:
        if self.kind == "memory" and self._opened:
            return self._opened[0]
        config = LimitsConfig(**{"tiers": TIERS, "prefix": self.prefix, **overrides})
        limits = make_limits(None if self.kind == "memory" else self.url, config)
        self._opened.append(limits)
        return limits

    async def cleanup(self) -> None:
        if self.kind == "redis":
            await delete_prefixed(REDIS_URL, self.prefix)
        for limits in self._opened:
            await limits.close()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def gateways(request: pytest.FixtureRequest) -> AsyncIterator[Gateways]:
    url = request.getfixturevalue("redis_cluster_url") if request.param == "cluster" else None
    gw = Gateways(request.param, url)
    yield gw
    await gw.cleanup()


# -- token quotas ------------------------------------------------------------------------------


async def test_concurrent_reservations_never_overshoot(gateways: Gateways) -> None:
    # Real clocks here (server TIME on Redis). 20 requests of 1000 against 5500: exactly 5 fit.
    g1, g2 = gateways.open(), gateways.open()
    start = asyncio.Event()

    async def one(i: int) -> Reservation | Denied:
        await start.wait()
        return await (g1 if i % 2 else g2).tokens.reserve("alice", "m", "free", 1000)

    tasks = [asyncio.create_task(one(i)) for i in range(20)]
    start.set()
    results = await asyncio.gather(*tasks)
    admitted = [r for r in results if isinstance(r, Reservation)]
    assert len(admitted) == 5
    assert all(isinstance(r, Denied) and r.type == "tokens" for r in results if r not in admitted)
    assert (await g1.tokens.state("alice", "m", "free")).used == 5000
    assert (await g2.tokens.state("alice", "m", "free")).used == 5000


async def test_settle_lowers_usage(gateways: Gateways) -> None:
    limits = gateways.open(clock=FakeClock())
    first = await limits.tokens.reserve("u", "m", "free", 4000)
    assert isinstance(first, Reservation) and first.state.used == 4000
    assert isinstance(await limits.tokens.reserve("u", "m", "free", 3000), Denied)
    await limits.tokens.settle(first, 1500)
    assert (await limits.tokens.state("u", "m", "free")).used == 1500
    second = await limits.tokens.reserve("u", "m", "free", 3000)
    assert isinstance(second, Reservation) and second.state.used == 4500


async def test_release_restores_once(gateways: Gateways) -> None:
    limits = gateways.open(clock=FakeClock())
    held = await limits.tokens.reserve("u", "m", "free", 3000)
    other = await limits.tokens.reserve("u", "m", "free", 1000)
    assert isinstance(held, Reservation) and isinstance(other, Reservation)
    await limits.tokens.release(held)
    assert (await limits.tokens.state("u", "m", "free")).used == 1000
    await limits.tokens.release(held)  # twice, then a settle: both no-ops
    await limits.tokens.settle(held, 10)
    assert (await limits.tokens.state("u", "m", "free")).used == 1000


async def test_window_expiry_and_retry_after(gateways: Gateways) -> None:
    clock = FakeClock(1000.0)
    limits = gateways.open(clock=clock)
    assert isinstance(await limits.tokens.reserve("u", "m", "free", 3000), Reservation)
    clock.advance(30.5)
    assert isinstance(await limits.tokens.reserve("u", "m", "free", 1500), Reservation)
    denied = await limits.tokens.reserve("u", "m", "free", 2000)
    assert isinstance(denied, Denied)
    assert (denied.type, denied.limit, denied.used, denied.requested) == ("tokens", 5500, 4500, 2000)
    assert denied.retry_after == pytest.approx(29.5)  # the 3000 from t=1000 leave at t=1060
    assert denied.retry_after_header == "30"
    assert (denied.state.limit, denied.state.used, denied.state.reset_s) == (5500, 4500, pytest.approx(59.5))
    clock.advance(29.4)
    assert isinstance(await limits.tokens.reserve("u", "m", "free", 2000), Denied)
    clock.advance(0.1)
    fits = await limits.tokens.reserve("u", "m", "free", 2000)
    assert isinstance(fits, Reservation) and fits.state.used == 3500
    clock.advance(60)
    assert (await limits.tokens.state("u", "m", "free")).used == 0


async def test_settle_after_the_window_is_a_no_op(gateways: Gateways) -> None:
    clock = FakeClock(1000.0)
    limits = gateways.open(clock=clock)
    old = await limits.tokens.reserve("u", "m", "free", 3000)
    assert isinstance(old, Reservation)
    clock.advance(61)
    await limits.tokens.settle(old, 5000)  # its bucket left the window: nothing to adjust
    assert (await limits.tokens.state("u", "m", "free")).used == 0


async def test_denied_shape_and_too_large(gateways: Gateways) -> None:
    limits = gateways.open(clock=FakeClock())
    denied = await limits.tokens.reserve("u", "gpt-x", "free", 6000)
    assert isinstance(denied, Denied) and denied.too_large
    message = denied.message()
    assert "gpt-x" in message and "Limit 5500" in message and "Used 0" in message and "Requested 6000" in message
    with pytest.raises(ValueError):
        await limits.tokens.reserve("u", "gpt-x", "free", -1)


async def test_limits_by_tier_and_model(gateways: Gateways) -> None:
    limits = gateways.open(clock=FakeClock(), model_tokens_per_minute={"big": {"paid": 2000}})
    assert isinstance(await limits.tokens.reserve("u", "m", "paid", 40_000), Reservation)
    assert isinstance(await limits.tokens.reserve("u", "big", "paid", 2500), Denied)  # model override
    assert isinstance(await limits.tokens.reserve("u", "other", "free", 5000), Reservation)  # per model
    assert isinstance(await limits.tokens.reserve("v", "other", "free", 5000), Reservation)  # per user
    assert limits.tokens.limit("no-such-tier", "m") == 5500  # unknown tier: the free limits


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "settle", "release", "tick"]),
                          st.integers(0, 3000)), max_size=30))
async def test_in_process_window_matches_a_reference(ops: list[tuple[str, int]]) -> None:
    """Usage is always the sum of the live reservations' current amounts, and never above the limit
    unless a settle raised it (real use beyond the reservation)."""
    clock = FakeClock(500.0)
    limits = make_limits(None, LimitsConfig(tiers=TIERS, clock=clock))
    counted: list[list[float]] = []  # [reserved at, amount now] of every admitted reservation
    open_: list[tuple[Reservation, int]] = []  # not settled or released yet: index into counted
    for op, amount in ops:
        if op == "tick":
            clock.advance(amount / 100)
        elif op == "reserve":
            result = await limits.tokens.reserve("u", "m", "free", amount)
            if isinstance(result, Reservation):
                counted.append([clock.now, amount])
                open_.append((result, len(counted) - 1))
        elif open_:
            reservation, index = open_.pop(0)
            if op == "settle":
                await limits.tokens.settle(reservation, min(amount, reservation.tokens))
                counted[index][1] = min(amount, reservation.tokens)
            else:
                await limits.tokens.release(reservation)
                counted[index][1] = 0
        expected = sum(a for at, a in counted if int(at) > int(clock.now) - 60)
        assert (await limits.tokens.state("u", "m", "free")).used == expected <= 5500


# -- request rates -----------------------------------------------------------------------------


async def test_request_rate_per_user(gateways: Gateways) -> None:
    clock = FakeClock(2000.0)
    limits = gateways.open(clock=clock)
    for i in range(3):
        allowed = await limits.requests.hit("u", "free")
        assert isinstance(allowed, Allowed) and allowed.state.used == i + 1
    denied = await limits.requests.hit("u", "free")
    assert isinstance(denied, Denied)
    assert (denied.type, denied.scope, denied.limit, denied.used, denied.requested) == ("requests", "user", 3, 3, 1)
    assert denied.retry_after == pytest.approx(60)
    clock.advance(60)
    assert isinstance(await limits.requests.hit("u", "free"), Allowed)


async def test_request_rate_per_ip_refunds_the_user(gateways: Gateways) -> None:
    limits = gateways.open(clock=FakeClock(), ip_requests_per_minute=4)
    for user in ("a", "b", "c", "d"):
        assert isinstance(await limits.requests.hit(user, "paid", ip="10.0.0.1"), Allowed)
    denied = await limits.requests.hit("e", "paid", ip="10.0.0.1")
    assert isinstance(denied, Denied) and (denied.scope, denied.limit, denied.subject) == ("ip", 4, "10.0.0.1")
    assert (await limits.requests.state("e", "paid")).used == 0  # refused by the IP: not counted
    assert isinstance(await limits.requests.hit("e", "paid", ip="10.0.0.2"), Allowed)


async def test_limits_survive_redis_losing_their_scripts(gateways: Gateways) -> None:
    """After a Redis restart (or SCRIPT FLUSH) the scripts are loaded again, and counting goes on."""
    limits = gateways.open(clock=FakeClock())
    assert isinstance(await limits.requests.hit("u", "free", ip="10.0.0.3"), Allowed)
    if gateways.kind != "memory":
        from redis_cluster import flush_scripts

        await flush_scripts(gateways.url)
    second = await limits.requests.hit("u", "free", ip="10.0.0.3")
    assert isinstance(second, Allowed) and second.state.used == 2


async def test_request_rate_per_user_refunds_the_ip(gateways: Gateways) -> None:
    """Both windows are hit in one round trip; a request the user's limit refuses does not count
    against its IP either."""
    limits = gateways.open(clock=FakeClock(), ip_requests_per_minute=4)
    for _ in range(3):  # free tier: 3 a minute
        assert isinstance(await limits.requests.hit("u", "free", ip="10.0.0.9"), Allowed)
    refused = await limits.requests.hit("u", "free", ip="10.0.0.9")
    assert isinstance(refused, Denied) and refused.scope == "user"
    assert isinstance(await limits.requests.hit("v", "paid", ip="10.0.0.9"), Allowed)  # the IP's 4th
    denied = await limits.requests.hit("w", "paid", ip="10.0.0.9")
    assert isinstance(denied, Denied) and denied.scope == "ip" and denied.used == 4


async def test_a_refunded_request_counts_against_neither_window(gateways: Gateways) -> None:
    """A request the service refused for its own load is given back (RequestLimiter.refund): the
    user's and the IP's windows both, once; its slot in the minute is free again."""
    limits = gateways.open(clock=FakeClock(), ip_requests_per_minute=5)
    for _ in range(3):  # free tier: 3 a minute
        allowed = await limits.requests.hit("u", "free", ip="10.0.0.7")
        assert isinstance(allowed, Allowed)
    await limits.requests.refund(allowed)
    assert (await limits.requests.state("u", "free")).used == 2
    again = await limits.requests.hit("u", "free", ip="10.0.0.7")
    assert isinstance(again, Allowed) and again.state.used == 3
    assert isinstance(await limits.requests.hit("u", "free", ip="10.0.0.7"), Denied)
    for user in ("v", "w"):  # the IP's 4th and 5th: the refunded one no longer counts there
        assert isinstance(await limits.requests.hit(user, "paid", ip="10.0.0.7"), Allowed)
    denied = await limits.requests.hit("x", "paid", ip="10.0.0.7")
    assert isinstance(denied, Denied) and denied.scope == "ip"


# -- headers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (-1, "0s"), (0.017, "17ms"), (0.0001, "1ms"), (0.9999, "1s"), (1, "1s"), (7.66, "7.66s"),
    (59.75, "59.75s"), (60, "1m0s"), (360, "6m0s"), (90.5, "1m30.5s"), (3723, "1h2m3s"),
])
def test_format_reset(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


async def test_rate_limit_headers(gateways: Gateways) -> None:
    clock = FakeClock(3000.25)
    limits = gateways.open(clock=clock)
    allowed = await limits.requests.hit("u", "free")
    reservation = await limits.tokens.reserve("u", "m", "free", 1500)
    assert isinstance(allowed, Allowed) and isinstance(reservation, Reservation)
    expected = {
        "x-ratelimit-limit-requests": "3",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "59.75s",
        "x-ratelimit-limit-tokens": "5500",
        "x-ratelimit-remaining-tokens": "4000",
        "x-ratelimit-reset-tokens": "59.75s",
    }
    assert rate_limit_headers(allowed.state, reservation.state) == expected
    assert await limits.headers("u", "m", "free") == expected
    clock.advance(0.75)
    assert (await limits.headers("u", "m", "free"))["x-ratelimit-reset-tokens"] == "59s"


# -- idempotency -------------------------------------------------------------------------------


async def test_idempotency_lifecycle(gateways: Gateways) -> None:
    idem = gateways.open().idempotency
    fp = body_fingerprint({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert fp == body_fingerprint({"messages": [{"content": "hi", "role": "user"}], "model": "m"})
    assert isinstance(await idem.claim("u", "k1", fp), Claimed)
    assert await idem.claim("u", "k1", fp) == Existing(None, fp, "claimed", False)
    assert isinstance(await idem.claim("other-user", "k1", fp), Claimed)  # keys are per user
    assert await idem.attach("u", "k1", "reply-1")
    assert not await idem.attach("u", "k1", "reply-2")  # already names another reply
    assert await idem.claim("u", "k1", fp) == Existing("reply-1", fp, "running", False)
    assert await idem.complete("u", "k1")
    assert await idem.claim("u", "k1", fp) == Existing("reply-1", fp, "complete", False)
    conflict = await idem.claim("u", "k1", body_fingerprint({"model": "m", "messages": []}))
    assert isinstance(conflict, Existing) and conflict.conflict and conflict.fingerprint == fp
    await idem.release("u", "k1")
    assert await idem.get("u", "k1") is None
    assert not await idem.attach("u", "k1", "reply-3")


async def test_idempotency_key_length(gateways: Gateways) -> None:
    idem = gateways.open().idempotency
    assert isinstance(await idem.claim("u", "k" * 255, "fp"), Claimed)
    for bad in ("k" * 256, ""):
        with pytest.raises(ValueError):
            await idem.claim("u", bad, "fp")


async def test_idempotency_concurrent_claims_one_winner(gateways: Gateways) -> None:
    g1, g2 = gateways.open(), gateways.open()
    results = await asyncio.gather(*[(g1 if i % 2 else g2).idempotency.claim("u", "dup", "fp") for i in range(10)])
    assert sum(isinstance(r, Claimed) for r in results) == 1


async def test_idempotency_ttl(gateways: Gateways) -> None:
    idem = gateways.open(idempotency_ttl_s=0.15).idempotency
    assert isinstance(await idem.claim("u", "short", "fp"), Claimed)
    assert isinstance(await idem.claim("u", "short", "fp"), Existing)
    await asyncio.sleep(0.25)
    assert isinstance(await idem.claim("u", "short", "fp"), Claimed)
    assert isinstance(await idem.claim("u", "long", "fp", ttl_s=60), Claimed)  # per-claim TTL
    await asyncio.sleep(0.25)
    assert isinstance(await idem.claim("u", "long", "fp"), Existing)


async def test_idempotency_claim_without_a_reply_expires_soon(gateways: Gateways) -> None:
    """A claimant that never attached nor released (its gateway died, or the store failed under
    its start and its release) held the key its whole day: every retry waited, then 409."""
    idem = gateways.open(idempotency_claim_ttl_s=0.2).idempotency
    assert isinstance(await idem.claim("u", "orphan", "fp"), Claimed)
    assert isinstance(await idem.claim("u", "kept", "fp"), Claimed)
    assert await idem.attach("u", "kept", "reply-1")  # from here on the key's whole TTL
    await asyncio.sleep(0.3)
    assert isinstance(await idem.claim("u", "orphan", "fp"), Claimed)
    assert await idem.complete("u", "kept")
    assert await idem.get("u", "kept") == Existing("reply-1", "fp", "complete", False)


async def test_idempotency_duplicates_wait_for_the_reply(gateways: Gateways) -> None:
    g1, g2 = gateways.open(), gateways.open()
    assert isinstance(await g1.idempotency.claim("u", "w", "fp"), Claimed)

    async def first() -> None:
        await asyncio.sleep(0.05)
        await g1.idempotency.attach("u", "w", "reply-9")

    attached = asyncio.create_task(first())
    seen = await asyncio.gather(*[g2.idempotency.wait_for_reply("u", "w", "fp", timeout=2) for _ in range(5)])
    await attached
    assert {s.reply_id for s in seen if s is not None} == {"reply-9"} and None not in seen
    assert isinstance(await g1.idempotency.claim("u", "gone", "fp"), Claimed)
    await g1.idempotency.release("u", "gone")
    assert await g2.idempotency.wait_for_reply("u", "gone", timeout=0.1) is None


# -- admission ---------------------------------------------------------------------------------


async def test_admission_bounds_and_fifo() -> None:
    admission = Admission(max_in_flight=2, max_waiting=2, timeout_s=1.0)
    held = [await admission.acquire(), await admission.acquire()]
    order: list[int] = []
    done = asyncio.Event()

    async def wait(i: int) -> None:
        async with admission.slot():
            order.append(i)
            await done.wait()

    waiters = [asyncio.create_task(wait(i)) for i in range(2)]
    await asyncio.sleep(0)
    assert (admission.in_flight, admission.waiting) == (2, 2)
    with pytest.raises(Overloaded) as full:
        await admission.acquire()
    assert full.value.reason == "queue_full" and full.value.retry_after >= 1
    held[0].release()
    held[0].release()  # idempotent
    await asyncio.sleep(0.01)
    assert order == [0]  # the oldest waiter got the freed slot
    held[1].release()
    done.set()
    await asyncio.gather(*waiters)
    assert order == [0, 1] and (admission.in_flight, admission.waiting) == (0, 0)


async def test_admission_timeout_and_cancel_leak_nothing() -> None:
    admission = Admission(max_in_flight=1, max_waiting=10, timeout_s=0.05)
    slot = await admission.acquire()
    started = time.monotonic()
    with pytest.raises(Overloaded) as late:
        await admission.acquire()
    assert late.value.reason == "timeout" and 0.04 < time.monotonic() - started < 1
    with pytest.raises(Overloaded):
        await admission.acquire(timeout=0)
    cancelled = asyncio.create_task(admission.acquire(timeout=5))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert admission.waiting == 0
    slot.release()
    assert admission.in_flight == 0
    async with admission.slot():
        assert admission.in_flight == 1


async def test_admission_never_exceeds_in_flight() -> None:
    admission = Admission(max_in_flight=3, max_waiting=40, timeout_s=5)
    running = peak = 0

    async def work() -> None:
        nonlocal running, peak
        async with admission.slot():
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.002)
            running -= 1

    await asyncio.gather(*[work() for _ in range(30)])
    assert peak == 3 and admission.in_flight == 0 and admission.waiting == 0


# -- single-flight -----------------------------------------------------------------------------


def test_flight_fingerprint_and_cacheable() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert flight_fingerprint("u", "m", messages, max_tokens=5) == flight_fingerprint("u", "m", messages, max_tokens=5)
    assert flight_fingerprint("u", "m", messages) != flight_fingerprint("v", "m", messages)
    assert flight_fingerprint("u", "m", messages) != flight_fingerprint("u", "m2", messages)
    assert is_cacheable(0) and is_cacheable(0.0, None)
    assert not is_cacheable(None) and not is_cacheable(0.7) and not is_cacheable(0, n=2)


async def test_single_flight_shares_one_generation(gateways: Gateways) -> None:
    g1, g2 = gateways.open(), gateways.open()
    started: list[str] = []

    async def start() -> str:
        started.append("x")
        await asyncio.sleep(0.05)  # creating the reply takes a moment: the others must wait
        return f"reply-{len(started)}"

    flights = await asyncio.gather(*[(g1 if i % 2 else g2).flights.run("fp", start) for i in range(10)])
    assert len(started) == 1
    assert {f.reply_id for f in flights} == {"reply-1"} and sum(f.leader for f in flights) == 1
    assert await g2.flights.lookup("fp") == "reply-1"
    late = await g1.flights.run("fp", start)  # published: later identical requests attach too
    assert (late.reply_id, late.leader) == ("reply-1", False)
    await g1.flights.finish("fp", "reply-1")
    fresh = await g2.flights.run("fp", start)
    assert (fresh.reply_id, fresh.leader) == ("reply-2", True)


async def test_single_flight_leader_failure_hands_over(gateways: Gateways) -> None:
    g1, g2 = gateways.open(), gateways.open()
    calls = 0

    async def start() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.03)
        if calls == 1:
            raise RuntimeError("replica gone")
        return "reply-ok"

    results = await asyncio.gather(*[(g1 if i % 2 else g2).flights.run("fp2", start) for i in range(6)],
                                   return_exceptions=True)
    assert calls == 2
    assert sum(isinstance(r, RuntimeError) for r in results) == 1
    assert {r.reply_id for r in results if not isinstance(r, Exception)} == {"reply-ok"}


async def test_single_flight_follower_stops_waiting(gateways: Gateways) -> None:
    limits = gateways.open()
    never = asyncio.Event()

    async def slow() -> str:
        await never.wait()
        return "never"

    leader = asyncio.create_task(limits.flights.run("fp3", slow))
    await asyncio.sleep(0.02)

    async def own() -> str:
        return "own-reply"

    follower = await limits.flights.run("fp3", own, wait_s=0.05)
    assert (follower.reply_id, follower.leader) == ("own-reply", True)  # duplicated, not failed
    leader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leader
    assert await limits.flights.lookup("fp3") is None


# -- Redis down --------------------------------------------------------------------------------


async def test_unreachable_redis_fails_fast() -> None:
    limits = make_limits("redis://127.0.0.1:1/14", LimitsConfig())
    started = time.monotonic()
    for call in (limits.ping(), limits.tokens.reserve("u", "m", "free", 1),
                 limits.requests.hit("u", "free"), limits.idempotency.claim("u", "k", "fp"),
                 limits.flights.run("fp", lambda: asyncio.sleep(0, "r"))):
        with pytest.raises(LimitsUnavailable):
            await call
    assert time.monotonic() - started < 3
    await limits.close()


async def test_silent_redis_times_out() -> None:
    """A server that accepts and never answers (a hung Redis): a clear error, never a hang."""
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)
        await asyncio.sleep(10)

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = make_limits(f"redis://127.0.0.1:{port}/0", LimitsConfig(socket_timeout_s=0.2))
    started = time.monotonic()
    with pytest.raises(LimitsUnavailable):
        await limits.tokens.reserve("u", "m", "free", 1)
    assert time.monotonic() - started < 2
    # The headers every response carries are left off at once, not after another timeout each
    # (a stalled Redis made every authenticated response, /v1/models too, a second slower).
    started = time.monotonic()
    assert await limits.headers("u", "m", "free") is None
    assert time.monotonic() - started < 0.1
    server.close()
    await limits.close()


def test_bad_url() -> None:
    with pytest.raises(ValueError):
        make_limits("http://nope", LimitsConfig())
    assert isinstance(make_limits("memory://").tokens._counter, InProcessWindow)


async def test_a_burst_of_commands_shares_the_connection_instead_of_failing():
    """redis-py's default pool refuses commands past its size; the limits' client multiplexes a
    burst over one connection, and every command gets its own reply (real Redis)."""
    from fairway.limits import _redis

    client, prefix = _redis.connect(REDIS_URL), f"fairway-test:{uuid.uuid4().hex[:8]}:burst"
    try:
        results = await asyncio.gather(*(client.execute("INCR", f"{prefix}:{i % 3}") for i in range(60)))
        assert sorted(results) == sorted(n for _ in range(3) for n in range(1, 21))
    finally:
        await client.execute("DEL", *(f"{prefix}:{i}" for i in range(3)))
        await client.close()
