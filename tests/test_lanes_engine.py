"""Tier lanes inside one engine: paid before free before background at admission and at
preemption (the lowest lane first, then the newest), and background work that ages."""

from __future__ import annotations

from fairway.domain import Priority
from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.scheduler import Scheduler, SchedulerConfig
from fairway.engine.sequence import Sequence, SequenceStatus

PARAMS = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)


def scheduler(max_num_seqs: int = 8, num_blocks: int = 64, aging: float | None = None) -> Scheduler:
    """Arrivals in these tests are small numbers, long past on the monotonic clock: aging is off
    unless a test turns it on and passes its own clock."""
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=512,
                                     background_max_wait_s=aging), KVCacheManager(num_blocks, 16, 0, False))


def seq(name: str, priority: int, arrival: float, tokens: int = 20) -> Sequence:
    return Sequence(name, list(range(1, tokens + 1)), PARAMS, priority=priority, arrival=arrival)


def run_step(s: Scheduler) -> list[str]:
    """Schedule a step and mark what it computed, as the engine would (one new token each)."""
    batch = s.schedule()
    for q, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:
            q.token_ids.append(7)
    return [q.request_id for q in batch.preempted]


def test_a_paid_arrival_takes_the_seat_of_the_newest_free_sequence_not_the_oldest_or_a_paid_one() -> None:
    s = scheduler(max_num_seqs=3)
    for q in (seq("paid-0", Priority.PAID, 0.0), seq("free-1", Priority.FREE, 1.0), seq("free-2", Priority.FREE, 2.0)):
        s.add(q)
    run_step(s)
    assert {q.request_id for q in s.running} == {"paid-0", "free-1", "free-2"}
    s.add(seq("paid-3", Priority.PAID, 3.0))
    assert run_step(s) == ["free-2"]
    assert {q.request_id for q in s.running} == {"paid-0", "free-1", "paid-3"}
    assert [q.request_id for q in s.lanes[Priority.FREE]] == ["free-2"]  # at the front of its lane, recomputed later
    # Another paid one: the next victim is the newest of what is left of the lowest lane.
    s.add(seq("paid-4", Priority.PAID, 4.0))
    assert run_step(s) == ["free-1"]
    # A third finds only paid sequences running: it waits, nobody is preempted for it.
    s.add(seq("paid-5", Priority.PAID, 5.0))
    assert run_step(s) == [] and [q.request_id for q in s.lanes[Priority.PAID]] == ["paid-5"]


def test_background_is_preempted_before_free_when_blocks_run_out() -> None:
    # 4 blocks of 16 tokens: a 20-token prompt needs 2, a 10-token one 1; the paid one finds 1 free.
    s = scheduler(max_num_seqs=8, num_blocks=4)
    s.add(seq("bg", Priority.BACKGROUND, 0.0))
    s.add(seq("free", Priority.FREE, 1.0, tokens=10))
    run_step(s)
    assert {q.request_id for q in s.running} == {"bg", "free"}
    s.add(seq("paid", Priority.PAID, 2.0))
    assert run_step(s) == ["bg"]  # the lowest lane goes first, although it is the oldest
    assert {q.request_id for q in s.running} == {"free", "paid"}


def test_a_paid_prompt_is_prefilled_before_a_free_prompt_already_under_way() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), KVCacheManager(64, 16, 0, False))
    s.add(seq("free-long", Priority.FREE, 0.0, tokens=300))
    run_step(s)  # its first 64-token chunk
    s.add(seq("paid", Priority.PAID, 1.0, tokens=40))
    batch = s.schedule()
    got = dict(zip((q.request_id for q in batch.seqs), batch.num_new_tokens, strict=True))
    assert got == {"paid": 40, "free-long": 24}


def test_background_work_ages_up_a_lane_per_bound_so_it_is_never_starved() -> None:
    s = scheduler(max_num_seqs=8, aging=10.0)
    bg = seq("bg", Priority.BACKGROUND, 100.0)
    s.add(bg)
    s.add(seq("free-early", Priority.FREE, 95.0))
    s.add(seq("free-late", Priority.FREE, 105.0))
    s.add(seq("free-new", Priority.FREE, 120.0))
    s.age(now=105.0)
    assert bg in s.lanes[Priority.BACKGROUND]  # 5 s: not yet
    s.age(now=111.0)  # past the bound: free, where its arrival puts it
    assert [q.request_id for q in s.lanes[Priority.FREE]] == ["free-early", "bg", "free-late", "free-new"]
    s.age(now=119.0)
    assert bg.priority == Priority.FREE
    s.age(now=121.0)  # twice the bound: paid
    assert bg.priority == Priority.PAID and list(s.lanes[Priority.PAID]) == [bg]
    assert bg.base_priority == Priority.BACKGROUND and s.num_aged == 2
    # Free work never ages: it is already above background, and below paid by design.
    assert all(q.priority == Priority.FREE for q in s.lanes[Priority.FREE])


def test_without_aging_background_waits_as_long_as_free_work_keeps_coming() -> None:
    s = scheduler(max_num_seqs=1, aging=None)
    s.add(seq("bg", Priority.BACKGROUND, 0.0))
    for i in range(5):
        s.add(seq(f"free-{i}", Priority.FREE, 1.0 + i))
    s.age(now=1e9)
    assert [q.request_id for q in s.lanes[Priority.BACKGROUND]] == ["bg"]


def test_an_engine_under_a_free_flood_finishes_background_work_within_its_bound(tiny_model) -> None:
    """A real engine, one seat, free requests arriving faster than they finish: the background
    request still finishes, after its bound, not at the end of the flood."""
    import time

    eng = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128, max_num_seqs=1, speculative=None,
                                             background_max_wait_s=0.05))
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("bg", [1, 2, 3], short, priority=Priority.BACKGROUND)
    finished: list[str] = []
    n = 0
    deadline = time.monotonic() + 20
    while "bg" not in finished and time.monotonic() < deadline:
        while eng.scheduler.num_waiting < 3:  # the free lane is never empty
            eng.add_request(f"free-{n}", [4, 5, n % 200 + 6], short, priority=Priority.FREE)
            n += 1
        finished += [o.request_id for o in eng.step() if o.finished]
    assert "bg" in finished and eng.scheduler.num_aged >= 1
    assert any(s.status == SequenceStatus.WAITING for s in eng.requests.values())  # the flood went on


def test_the_bound_is_set_on_the_command_line_for_the_claim_and_the_engine_alike() -> None:
    """`fairway replica --background-max-wait S`: the replica's seats (what it claims first) and
    its engine's scheduler age background work by the same bound; one that cannot work is refused."""
    import subprocess
    import sys

    from fairway.assembly import engine_config, replica_settings
    from fairway.cli import _server_options, build_parser

    args = build_parser().parse_args(["replica", "--redis", "redis://127.0.0.1:1/0", "--background-max-wait", "5"])
    options = _server_options(args)
    assert replica_settings(options, "m").background_max_wait_s == 5.0
    assert engine_config(options).background_max_wait_s == 5.0
    bad = subprocess.run([sys.executable, "-m", "fairway.cli", "replica", "--redis", "redis://127.0.0.1:1/0",
                          "--background-max-wait", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--background-max-wait: must be a number of seconds above 0" in bad.stderr
