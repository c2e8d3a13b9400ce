"""A reply carried on elsewhere reads as one: the engine resumed after the tokens already sent
(float32, greedy and seeded) gives the tokens and text an uninterrupted run gives; a replica
worker handed a reply mid-way continues its token log from the next event id; of two producers
of one reply the second drops its copy; the failover hands a gone replica's jobs on once, at the
front of a live replica's queue; a drain finishes what it can and hands on the rest."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import uuid
from functools import partial

import httpx
import pytest
from backends import missing
from processes import PrivateRedis
from redis_keys import delete_prefixed

from fairway.domain import FinishReason, Lane, ReplyState
from fairway.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from fairway.relay import FinalEvent, TokenEvent, make_relay
from fairway.replica.health import HealthServer
from fairway.replica.job import GenerationJob, replica_queue
from fairway.replica.registry import InProcessRegistry, RedisRegistry, ReplicaInfo
from fairway.replica.report import REPORTS_INBOX
from fairway.replica.worker import ReplicaSettings, ReplicaWorker
from fairway.router import Failover, FailoverSettings, Router

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
PROMPT = "<|im_start|>user\nName three colours and say why people like them.<|im_end|>\n<|im_start|>assistant\n"


def fp32_engine(model, tokenizer) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_kv_blocks=256, bound_step_time=False), tokenizer=tokenizer)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, output: list[int] | None = None
        ) -> tuple[list[int], str]:
    engine.add_request("r", prompt, params, output_token_ids=output)
    tokens, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                tokens.append(out.token_id)
            text += out.text
    return tokens, text


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=40,
                                                   ignore_eos=True),
                                    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["zzz", "e, "])],
                         ids=["greedy", "seeded", "stop-string"])
def test_a_resumed_request_carries_on_as_if_never_stopped(real_model_fp32, real_tokenizer, params):
    prompt = real_tokenizer.encode(PROMPT)
    whole, whole_text = run(fp32_engine(real_model_fp32, real_tokenizer), prompt, params)
    assert len(whole) > 12
    for k in (1, 9):
        sent, sent_text = run(fp32_engine(real_model_fp32, real_tokenizer), prompt,
                              SamplingParams(**{**vars(params), "max_tokens": k}))
        rest, rest_text = run(fp32_engine(real_model_fp32, real_tokenizer), prompt, params, output=sent)
        assert sent + rest == whole
        if not params.stop:  # (a text held back for a possible stop string comes out after the split)
            assert sent_text + rest_text == whole_text
        else:
            assert whole_text.startswith(sent_text) and whole_text.endswith(rest_text)


def test_a_continuation_that_no_longer_fits_is_rejected_up_front(real_model_fp32, real_tokenizer):
    engine = LLMEngine(real_model_fp32, EngineConfig(num_kv_blocks=64, max_model_len=64, bound_step_time=False),
                       tokenizer=real_tokenizer)
    with pytest.raises(ValueError):
        engine.add_request("r", list(range(20, 50)), SamplingParams(), output_token_ids=list(range(20, 60)))


# -- the worker ---------------------------------------------------------------------------------


@pytest.fixture
async def replica(real_model_fp32, real_tokenizer):
    relay = make_relay(None)
    registry = InProcessRegistry()
    engine = AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer))
    worker = ReplicaWorker(engine, relay, registry, ReplicaSettings(model="m", replica_id="b"))
    await worker.start()
    yield worker, relay, real_tokenizer
    await worker.stop()
    engine.shutdown()


async def events_of(relay, reply_id: str) -> list:
    async def all_events():
        return [e async for e in relay.log.subscribe(reply_id)]

    return await asyncio.wait_for(all_events(), 60)


async def handed_on(worker, relay, tokenizer, reply_id: str, prompt: list[int], params: dict,
                    sent: list[int]) -> list:
    """The reply's events once the worker carried it on from a log holding sent (a gone replica's
    tokens), handed to it as failover does."""
    await relay.log.create(reply_id)
    for i, token in enumerate(sent, 1):
        await relay.log.append(reply_id, TokenEvent(i, tokenizer.decode([token]), [token]))
    job = GenerationJob(reply_id, "m", prompt, params, Lane.PAID.value, attempt=1)
    await relay.jobs.submit(job.to_dict(), Lane.PAID, queue=worker.queue, front=True)
    return await events_of(relay, reply_id)


async def test_a_handed_on_reply_continues_its_log_from_the_next_event(replica):
    worker, relay, tokenizer = replica
    prompt = tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    # What the dead replica had sent: the first 9 tokens of the same greedy reply.
    first = fp32_engine(worker.engine.engine.model, tokenizer)
    sent, _ = run(first, prompt, SamplingParams(**{**params, "max_tokens": 9}))
    whole, whole_text = run(fp32_engine(worker.engine.engine.model, tokenizer), prompt, SamplingParams(**params))
    events = await handed_on(worker, relay, tokenizer, "rep1", prompt, params, sent)
    assert [e.n for e in events] == list(range(1, len(whole) + 2))  # no gap, no repeat, then the final event
    assert [t for e in events[:-1] for t in e.token_ids] == whole
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.state == ReplyState.FINISHED
    assert final.completion_tokens == len(whole) and final.prompt_tokens == len(prompt)
    reports = await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)
    finished = [d.item for d in reports if d.item["kind"] == "finished"]
    assert finished[0]["text"] == "".join(e.text for e in events[:-1]) == whole_text
    assert await relay.jobs.unfinished(queue=worker.queue) == []  # acknowledged at the end


async def test_a_reply_handed_on_after_its_last_token_ends_there(replica):
    """The replica that went had logged the reply's last allowed token but not its final event (a
    drain's hand-on, a kill): the continuation adds no token past max_tokens (it once added one:
    CI's drain test saw a reply a word longer than the same reply unbroken) and ends with length."""
    worker, relay, tokenizer = replica
    prompt = tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_tokens": 9, "ignore_eos": True}
    sent, sent_text = run(fp32_engine(worker.engine.engine.model, tokenizer), prompt, SamplingParams(**params))
    assert len(sent) == 9
    events = await handed_on(worker, relay, tokenizer, "rep9", prompt, params, sent)
    assert [e.n for e in events] == list(range(1, len(sent) + 2))  # the logged tokens, then the final event
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.error is None, final
    assert (final.finish_reason, final.state, final.completion_tokens) == \
        (FinishReason.LENGTH, ReplyState.FINISHED, len(sent))
    finished = [d.item for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10) if d.item["kind"] == "finished"]
    assert finished[0]["text"] == sent_text


async def test_a_fault_of_the_replica_ends_the_reply_with_an_error(replica):
    """A bug inside the replica's generation (here the round itself raising) ends the reply with an
    error final event, reported and acknowledged: its clients are not left waiting for an end
    (a missing engine method once left a stream silent until the client gave up)."""
    worker, relay, tokenizer = replica

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    worker._round = broken
    job = GenerationJob("rep8", "m", tokenizer.encode(PROMPT), {"temperature": 0, "max_tokens": 8}, Lane.PAID.value)
    await relay.log.create("rep8")
    await relay.jobs.submit(job.to_dict(), Lane.PAID, queue=worker.queue)
    (final,) = await events_of(relay, "rep8")
    assert isinstance(final, FinalEvent) and final.state == ReplyState.STOPPED and final.finish_reason == "abort"
    assert "failed" in final.error
    reports = [d.item for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)]
    assert [r["kind"] for r in reports] == ["started", "finished"] and reports[1]["error"] == final.error
    assert await relay.jobs.unfinished(queue=worker.queue) == []


async def test_a_second_producer_of_a_reply_drops_its_copy(replica):
    """A failover that raced a slow replica: the copy read the log, then the first producer
    appended the next event; the copy's first append fails and it ends nothing."""
    worker, relay, tokenizer = replica
    await relay.log.create("rep2")
    for i in range(1, 5):
        await relay.log.append("rep2", TokenEvent(i, "x", [300 + i]))
    read_log = worker._resume_point

    async def then_the_first_producer_appends(*args):
        resumed = await read_log(*args)
        await relay.log.append("rep2", TokenEvent(5, "y", [400]))
        return resumed

    worker._resume_point = then_the_first_producer_appends
    job = GenerationJob("rep2", "m", tokenizer.encode(PROMPT), {"temperature": 0, "max_tokens": 8}, attempt=1)
    assert await asyncio.wait_for(worker.serve(job), 60) is True  # done with: its job is acked
    assert [e.n for e in await relay.log.read("rep2")] == [1, 2, 3, 4, 5]  # no final event from the copy
    reports = [d.item["kind"] for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)]
    assert "finished" not in reports


def append_many_at(relay, reply_id: str, n: int, before) -> None:
    """relay.log.append_many, with before(real append_many, items) run in place of the call whose
    batch holds reply_id's event n (once)."""
    real = relay.log.append_many

    async def append_many(items, runs=None):
        if any(r == reply_id and e.n == n for r, e in items) and not append_many.done:
            append_many.done = True
            return await before(partial(real, runs=runs), items)
        return await real(items, runs)

    append_many.done = False
    relay.log.append_many = append_many


async def test_a_producer_overtaken_mid_reply_drops_its_copy_and_leaves_the_end_to_the_other(replica):
    """A replica taken over while cut off from Redis (its announcement lapsed): the new producer
    logged event 5 before this one could. This one stops there and writes no final event (an
    error final once ended the other producer's stream: CI's Redis-restart test)."""
    worker, relay, tokenizer = replica
    await relay.log.create("rep3")

    async def the_other_producer_first(real, items):
        await relay.log.append("rep3", TokenEvent(5, " other", [999]))
        return await real(items)

    append_many_at(relay, "rep3", 5, the_other_producer_first)
    job = GenerationJob("rep3", "m", tokenizer.encode(PROMPT), {"temperature": 0, "max_tokens": 16})
    assert await asyncio.wait_for(worker.serve(job), 60) is True
    events = await relay.log.read("rep3")
    assert [e.n for e in events] == [1, 2, 3, 4, 5] and events[-1].text == " other"  # no final event from here
    reports = [d.item["kind"] for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)]
    assert "finished" not in reports


async def test_an_append_whose_answer_was_lost_counts_as_written(replica):
    """The connection went after Redis ran a batch and the client ran it again (redis_client
    retries a lost connection itself): the second run finds event 5 logged, and it is this
    replica's own, so the reply goes on, each event once, and ends whole."""
    worker, relay, tokenizer = replica
    await relay.log.create("rep4")

    async def run_twice(real, items):
        await real(items)
        return await real(items)

    append_many_at(relay, "rep4", 5, run_twice)
    params = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    job = GenerationJob("rep4", "m", tokenizer.encode(PROMPT), params)
    assert await asyncio.wait_for(worker.serve(job), 60) is True
    events = await relay.log.read("rep4")
    assert [e.n for e in events] == list(range(1, 18))
    final = events[-1]
    assert isinstance(final, FinalEvent) and final.error is None and final.state == ReplyState.FINISHED


async def test_a_handed_on_job_of_a_run_whose_log_was_made_again_leaves_the_later_run_alone(replica):
    """A failover handed on run 0's job after its log was lost and made again for run 1: the
    continuation does not carry on after run 1's events as if they were its own (nor write a final
    event): it drops its copy, and its job is acknowledged."""
    worker, relay, tokenizer = replica
    await relay.log.create("rep9", run=1)
    for i in range(1, 4):
        await relay.log.append("rep9", TokenEvent(i, "b", [500 + i]), run=1)
    job = GenerationJob("rep9", "m", tokenizer.encode(PROMPT), {"temperature": 0, "max_tokens": 8}, attempt=1, run=0)
    assert await asyncio.wait_for(worker.serve(job), 60) is True
    assert [e.text for e in await relay.log.read("rep9")] == ["b", "b", "b"]
    reports = [d.item["kind"] for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)]
    assert "finished" not in reports


@pytest.fixture(params=["memory", "redis", "cluster"])
async def replica_on(request, real_model_fp32, real_tokenizer):
    """The replica fixture's worker on each token log backend (in process, Redis, a Redis Cluster)."""
    url = {"memory": None, "redis": REDIS_URL}.get(request.param) or request.getfixturevalue("redis_cluster_url")
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    relay = make_relay(url, prefix=prefix, block_s=0.2)
    try:
        await relay.ping()
    except Exception as exc:
        await relay.close()
        missing("Redis", f"nothing answers at {url}: {exc}")
    engine = AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer))
    worker = ReplicaWorker(engine, relay, InProcessRegistry(), ReplicaSettings(model="m", replica_id="b"))
    await worker.start()
    yield worker, relay, real_tokenizer, prefix
    await worker.stop()
    engine.shutdown()
    await relay.close()
    if request.param == "redis":
        await delete_prefixed(REDIS_URL, prefix)


async def test_a_later_run_of_a_reply_replaces_the_run_still_going_on_its_replica(replica_on, caplog):
    """The reply's log was lost while this replica ran its run 0 (which never learnt it); a
    gateway ran the reply again (a log for run 1, then run 1's job), and the router placed run 1
    here. The job is not dropped as a duplicate: run 0 gives way (its engine sequence goes, its
    next append is refused for its run, it reports nothing) and run 1 runs here; the reply ends
    with run 1's text alone, one finished report, and both jobs acknowledged. Run 0 is held at
    its fourth append until run 1's job is here, so it cannot find the log missing first."""
    worker, relay, tokenizer, prefix = replica_on
    rid = f"rep-{uuid.uuid4().hex[:8]}"
    old_prompt = tokenizer.encode(PROMPT)
    new_prompt = tokenizer.encode(PROMPT.replace("three colours", "two rivers"))
    new_params = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    whole, whole_text = run(fp32_engine(worker.engine.engine.model, tokenizer), new_prompt,
                            SamplingParams(**new_params))
    gate = asyncio.Event()

    async def held_at_the_fourth(real, items):
        await gate.wait()
        return await real(items)

    append_many_at(relay, rid, 4, held_at_the_fourth)
    caplog.set_level("INFO", logger="fairway.replica.worker")
    await relay.launch(rid, GenerationJob(rid, "m", old_prompt, {"temperature": 0, "max_tokens": 200,
                                                                "ignore_eos": True}).to_dict(),
                       Lane.PAID, queue=worker.queue)
    for _ in range(600):
        if await relay.log.exists(rid) and await relay.log.last_event_id(rid) >= 3:
            break
        await asyncio.sleep(0.02)
    # The log is lost (a Redis restarted without its data) and a gateway runs the reply again.
    if hasattr(relay.log, "_logs"):  # the in-process log: its process ended
        relay.log._logs.pop(rid)
    else:
        stream = f"{prefix}reply:{{{rid}}}"
        await relay.client.execute("DEL", stream, *(f"{stream}:{part}" for part in ("listened", "run")))
    assert await relay.log.create(rid, run=1)
    new_job = GenerationJob(rid, "m", new_prompt, new_params, Lane.PAID.value, run=1)
    await relay.jobs.submit(new_job.to_dict(), Lane.PAID, queue=worker.queue, front=True)
    for _ in range(600):
        if "run 1 replaces run 0" in caplog.text:
            break
        await asyncio.sleep(0.02)
    assert "run 1 replaces run 0" in caplog.text
    gate.set()
    events = await events_of(relay, rid)
    assert [e.n for e in events] == list(range(1, len(whole) + 2))
    assert "".join(e.text for e in events[:-1]) == whole_text
    assert isinstance(events[-1], FinalEvent) and events[-1].state == ReplyState.FINISHED
    for _ in range(100):  # (the report and the acknowledgement follow the final event)
        if not await relay.jobs.unfinished(queue=worker.queue):
            break
        await asyncio.sleep(0.05)
    assert await relay.jobs.unfinished(queue=worker.queue) == []
    reports = [d.item for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)]
    finished = [r for r in reports if r["kind"] == "finished"]
    assert len(finished) == 1 and finished[0]["text"] == whole_text, reports
    assert worker.engine.engine.has_unfinished() is False  # run 0's sequence left the engine


async def test_a_continuation_that_no_longer_fits_ends_with_length(real_model_fp32, real_tokenizer):
    """The replica that died had said so much that the context plus its words fill this one's
    window: the reply ends there, finish_reason length and FINISHED (no error), numbered on."""
    prompt = real_tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    sent, _ = run(fp32_engine(real_model_fp32, real_tokenizer), prompt, SamplingParams(**{**params, "max_tokens": 8}))
    logged = [real_tokenizer.decode([token]) for token in sent]
    small = LLMEngine(real_model_fp32, EngineConfig(num_kv_blocks=64, max_model_len=len(prompt) + len(sent),
                                                    bound_step_time=False), tokenizer=real_tokenizer)
    relay = make_relay(None)
    engine = AsyncEngine(small)
    worker = ReplicaWorker(engine, relay, InProcessRegistry(), ReplicaSettings(model="m", replica_id="small"))
    await worker.start()
    try:
        await relay.log.create("rep6")
        for i, (token, text) in enumerate(zip(sent, logged, strict=True), 1):
            await relay.log.append("rep6", TokenEvent(i, text, [token]))
        job = GenerationJob("rep6", "m", prompt, params, Lane.PAID.value, attempt=1)
        await relay.jobs.submit(job.to_dict(), Lane.PAID, queue=worker.queue, front=True)
        events = await events_of(relay, "rep6")
        assert [e.n for e in events] == list(range(1, len(sent) + 2))
        final = events[-1]
        assert isinstance(final, FinalEvent) and final.error is None, final
        assert (final.finish_reason, final.state, final.completion_tokens) == \
            (FinishReason.LENGTH, ReplyState.FINISHED, len(sent))
        finished = [d.item for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)
                    if d.item["kind"] == "finished"]
        assert finished[0]["text"] == "".join(logged)
    finally:
        await worker.stop()
        engine.shutdown()


# -- the failover -------------------------------------------------------------------------------


def info(replica_id: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id, "m", replica_queue(replica_id), 1024, 1000)


async def test_a_gone_replicas_jobs_go_to_the_front_of_a_live_ones_queue_once():
    relay = make_relay(None)
    registry = InProcessRegistry(ttl_s=60)
    for r in ("a", "b"):
        await registry.announce(info(r))
    jobs = relay.jobs
    dead, live = replica_queue("a"), replica_queue("b")
    await jobs.submit(GenerationJob("waiting-b", "m", [1]).to_dict(), Lane.FREE, queue=live)
    for reply in ("running", "queued"):
        await jobs.submit(GenerationJob(reply, "m", [1, 2], lane=Lane.FREE.value).to_dict(), Lane.FREE, queue=dead)
    await jobs.claim(queue=dead)  # "running" was claimed by a, which dies now
    router = Router(registry, cache_s=0)
    one, other = Failover(registry, relay, router), Failover(registry, relay, router)
    assert await one.sweep() == 0  # a is alive: nothing to do
    await registry.withdraw("a")  # (an expired heartbeat looks the same)
    assert await registry.gone() == ["a"]
    assert await one.sweep() == 2
    assert await other.sweep() == 0  # handed on once
    assert await registry.gone() == []
    queued = await jobs.unfinished(queue=live)
    assert [(j.job["reply_id"], j.job["attempt"]) for j in queued] == [("queued", 1), ("running", 1), ("waiting-b", 0)]
    reports = [d.item for d in await relay.inbox.take(REPORTS_INBOX, "t", max_count=10)]
    assert sorted((r["kind"], r["reply_id"], r["replica_id"]) for r in reports) == [
        ("resumed", "queued", "b"), ("resumed", "running", "b")]


@pytest.mark.parametrize("gone", [False, True], ids=["draining", "dead"])
async def test_two_gateways_sweeping_at_once_hand_each_job_on_once(gone):
    """On Redis, two gateways' sweeps at the same moment: a draining replica's waiting jobs, or a
    dead one's jobs, are moved by one of them (the takeover claim), each job once."""
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    relay, registry = make_relay(REDIS_URL, prefix=prefix), RedisRegistry(REDIS_URL, prefix=prefix, ttl_s=60)
    try:
        try:
            await registry.live()
        except Exception as exc:
            missing("Redis", f"nothing answers at {REDIS_URL}: {exc}")
        await registry.announce(dataclasses.replace(info("a"), draining=True))
        await registry.announce(info("b"))
        replies = [f"reply-{i}" for i in range(6)]
        for reply in replies:
            await relay.jobs.submit(GenerationJob(reply, "m", [1]).to_dict(), Lane.FREE, queue=replica_queue("a"))
        if gone:
            await registry.withdraw("a")
        gateways = [Failover(registry, relay, Router(registry, cache_s=0)) for _ in range(2)]
        assert sorted(await asyncio.gather(*(g.sweep() for g in gateways))) == [0, len(replies)]
        moved = [j.job["reply_id"] for j in await relay.jobs.unfinished(queue=replica_queue("b"))]
        assert sorted(moved) == replies
        assert await relay.jobs.unfinished(queue=replica_queue("a")) == []
    finally:
        await relay.close()
        await registry.close()
        await delete_prefixed(REDIS_URL, prefix)


async def test_a_late_replica_nobody_answers_for_is_failed_over_before_its_announcement_expires():
    """Heartbeats late (two missed) and its health endpoint refuses connections: out now, its
    jobs handed on, rather than after the registry's ttl. Late but answering (a slow machine),
    or answering too slowly to tell: it stays until its announcement expires."""
    relay = make_relay(None)
    registry = InProcessRegistry(ttl_s=60)
    health = HealthServer(lambda: True)
    await health.start()
    stalled = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never answers
    stalled_url = f"http://127.0.0.1:{stalled.sockets[0].getsockname()[1]}"
    closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    closed_url = f"http://127.0.0.1:{closed.sockets[0].getsockname()[1]}"
    closed.close()
    await closed.wait_closed()  # nothing listens there now: a dead process's port
    registry.ttl_s = 58.5  # announced as if 1.5 s ago: three heartbeats missed
    for name, url in (("alive", health.url), ("stalled", stalled_url), ("dead", closed_url)):
        await registry.announce(dataclasses.replace(info(name), health_url=url))
    registry.ttl_s = 60
    await registry.announce(dataclasses.replace(info("fresh"), health_url=closed_url))  # on time
    for name in ("alive", "stalled", "dead", "fresh"):
        await relay.jobs.submit(GenerationJob(f"reply-{name}", "m", [1]).to_dict(), Lane.FREE,
                                queue=replica_queue(name))
    try:
        failover = Failover(registry, relay, Router(registry, cache_s=0))
        assert await failover.sweep() == 1
        assert sorted(r.id for r in await registry.live()) == ["alive", "fresh", "stalled"]
        moved = [j.job["reply_id"] for q in ("alive", "fresh", "stalled")
                 for j in await relay.jobs.unfinished(queue=replica_queue(q))]
        assert sorted(moved) == ["reply-alive", "reply-dead", "reply-fresh", "reply-stalled"]
        assert await relay.jobs.unfinished(queue=replica_queue("dead")) == []
    finally:
        await health.close()
        stalled.close()


async def test_a_replica_whose_announcement_lapsed_while_it_serves_is_not_taken_over_at_once():
    """Redis restarted for longer than the registry's ttl: every announcement lapsed, the replicas
    alive. One whose health endpoint answers ready keeps its replies (a takeover would set a second
    producer on each) for lapse_grace_s, time to announce again; after that, or once it answers
    not ready (stopping, draining), its jobs are handed on as a dead one's are."""
    relay = make_relay(None)
    registry = InProcessRegistry(ttl_s=60)
    serving = {"lapsed": True, "stopping": False}
    servers = {name: HealthServer(lambda name=name: serving[name]) for name in serving}
    for server in servers.values():
        await server.start()
    try:
        for name, server in servers.items():
            await registry.announce(dataclasses.replace(info(name), health_url=server.url))
            await relay.jobs.submit(GenerationJob(f"reply-{name}", "m", [1]).to_dict(), Lane.FREE,
                                    queue=replica_queue(name))
        await registry.announce(info("other"))
        failover = Failover(registry, relay, Router(registry, cache_s=0), FailoverSettings(lapse_grace_s=0.5))
        assert await failover.sweep() == 0  # all announced: nothing to do (their addresses noted)
        for name in servers:
            await registry.withdraw(name)  # (an expired announcement looks the same)
        assert await failover.sweep() == 1  # the stopping one's job only
        assert [j.job["reply_id"] for j in await relay.jobs.unfinished(queue=replica_queue("other"))] == \
            ["reply-stopping"]
        assert await registry.gone() == ["lapsed"]
        await registry.announce(dataclasses.replace(info("lapsed"), health_url=servers["lapsed"].url))
        assert await failover.sweep() == 0 and await registry.gone() == []  # it came back: nothing moved
        await registry.withdraw("lapsed")
        assert await failover.sweep() == 0  # lapsed again: a new grace
        await asyncio.sleep(0.6)
        assert await failover.sweep() == 1  # it never announced again: out
        assert await relay.jobs.unfinished(queue=replica_queue("lapsed")) == []
    finally:
        for server in servers.values():
            await server.close()


async def test_the_health_endpoint_answers_ready_until_the_replica_drains():
    draining = False
    health = HealthServer(lambda: not draining)
    await health.start()
    try:
        async with httpx.AsyncClient(base_url=health.url) as client:
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/ready")).status_code == 200
            draining = True
            assert (await client.get("/ready")).status_code == 503
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/nope")).status_code == 404
    finally:
        await health.close()


async def test_a_takeover_waits_while_no_replica_serves_the_model():
    relay = make_relay(None)
    registry = InProcessRegistry(ttl_s=60)
    await registry.announce(info("a"))
    await relay.jobs.submit(GenerationJob("r", "m", [1]).to_dict(), Lane.PAID, queue=replica_queue("a"))
    await registry.withdraw("a")
    failover = Failover(registry, relay, Router(registry, cache_s=0))
    assert await failover.sweep() == 0
    assert await registry.gone() == ["a"]  # still to do
    await registry.announce(info("c"))
    assert await failover.sweep() == 1
    assert [j.job["reply_id"] for j in await relay.jobs.unfinished(queue=replica_queue("c"))] == ["r"]


# -- Redis away for a moment ----------------------------------------------------------------------


@pytest.fixture
def private_redis(tmp_path):
    """A Redis of this test's own, which it may stop and restart (tests/processes.py)."""
    if shutil.which("redis-server") is None:
        missing("Redis", "no redis-server on this machine")
    server = PrivateRedis(tmp_path)
    server.start()
    yield server.url, server.restart
    server.stop()


async def test_a_reply_carries_on_through_a_redis_restart(private_redis, real_model_fp32, real_tokenizer):
    """Redis stopped for 2 s (its append-only file keeps what it had) while a replica streams a
    reply: the replica keeps generating, retries its appends, and the log ends whole: every event
    once, in order, then the final event, the text that of an uninterrupted run."""
    url, restart = private_redis
    prompt = real_tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
    whole, whole_text = run(fp32_engine(real_model_fp32, real_tokenizer), prompt, SamplingParams(**params))
    relay, registry = make_relay(url), InProcessRegistry()
    engine = AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer))
    worker = ReplicaWorker(engine, relay, registry, ReplicaSettings(model="m", replica_id="w"))
    await worker.start()
    try:
        await relay.launch("rep3", GenerationJob("rep3", "m", prompt, params).to_dict(), Lane.PAID,
                           queue=worker.queue)
        for _ in range(600):  # mid-reply
            if await relay.log.last_event_id("rep3") >= 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.to_thread(restart, 2.0)
        reader = make_relay(url)
        try:
            for _ in range(600):
                events = await reader.log.read("rep3")
                if events and isinstance(events[-1], FinalEvent):
                    break
                await asyncio.sleep(0.1)
        finally:
            await reader.close()
    finally:
        await worker.stop()
        engine.shutdown()
        await relay.close()
    assert [e.n for e in events] == list(range(1, len(whole) + 2))
    assert isinstance(events[-1], FinalEvent) and events[-1].state == ReplyState.FINISHED, events[-1]
    assert "".join(e.text for e in events[:-1]) == whole_text


async def test_a_replica_drained_before_it_started_never_starts(real_model_fp32, real_tokenizer):
    """SIGTERM while the model loads (a fleet scaling down, a spot reclaim): `fairway replica`
    drains, then starts the worker; it must end at once, not run without claiming for ever."""
    relay, registry = make_relay(None), InProcessRegistry()
    engine = AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer))
    worker = ReplicaWorker(engine, relay, registry, ReplicaSettings(model="m", replica_id="early"))
    try:
        await worker.drain()
        await asyncio.wait_for(worker.run(), 5)
        assert await registry.live() == []
    finally:
        engine.shutdown()


async def test_a_replica_drained_while_it_starts_ends(real_model_fp32, real_tokenizer):
    """SIGTERM just after the replica announced itself, while it still starts (a fleet's replacement
    told to go at once): the drain found no loops to end; the worker must not start them after it
    and serve for ever (a local fleet's replica once did), but end, withdrawn."""
    relay, registry = make_relay(None), InProcessRegistry()
    engine = AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer))
    worker = ReplicaWorker(engine, relay, registry, ReplicaSettings(model="m", replica_id="starting"))
    resuming, go_on = asyncio.Event(), asyncio.Event()
    resume_own = worker._resume_own

    async def slow_resume() -> None:  # the start's last step before its loops, held open
        resuming.set()
        await go_on.wait()
        await resume_own()

    worker._resume_own = slow_resume
    try:
        running = asyncio.create_task(worker.run())
        await asyncio.wait_for(resuming.wait(), 5)
        assert [r.id for r in await registry.live()] == ["starting"]  # announced: a fleet sees it live
        draining = asyncio.create_task(worker.drain())
        await asyncio.sleep(0.05)
        go_on.set()
        await asyncio.wait_for(draining, 5)
        await asyncio.wait_for(running, 5)
        assert await registry.live() == [] and worker._loops == []
    finally:
        engine.shutdown()


async def test_a_drain_hands_on_what_it_cannot_finish_in_its_grace(real_model_fp32, real_tokenizer):
    """SIGTERM's drain: the reply that outlives the grace period gets no final event from the
    draining replica, its job stays in the queue, and the failover's replica finishes it whole."""
    prompt = real_tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    whole, _ = run(fp32_engine(real_model_fp32, real_tokenizer), prompt, SamplingParams(**params))
    relay, registry = make_relay(None), InProcessRegistry(ttl_s=60)
    engines = [AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer)) for _ in range(2)]
    a = ReplicaWorker(engines[0], relay, registry, ReplicaSettings(model="m", replica_id="a", drain_grace_s=0.05))
    b = ReplicaWorker(engines[1], relay, registry, ReplicaSettings(model="m", replica_id="b"))
    try:
        running = asyncio.create_task(a.run())  # as `fairway replica` runs it
        while not await registry.live():
            await asyncio.sleep(0.01)
        await relay.launch("rep4", GenerationJob("rep4", "m", prompt, params).to_dict(), Lane.PAID, queue=a.queue)
        for _ in range(3000):
            if await relay.log.last_event_id("rep4") >= 3:
                break
            await asyncio.sleep(0.01)
        await a.drain()
        await asyncio.wait_for(running, 10)
        logged = await relay.log.read("rep4")
        assert logged and not any(isinstance(e, FinalEvent) for e in logged)  # no error ended it
        assert [j.job["reply_id"] for j in await relay.jobs.unfinished(queue=a.queue)] == ["rep4"]
        assert await registry.gone() == ["a"]
        await b.start()
        assert await Failover(registry, relay, Router(registry, cache_s=0)).sweep() == 1
        events = await events_of(relay, "rep4")
        assert [e.n for e in events] == list(range(1, len(whole) + 2))
        assert [t for e in events[:-1] for t in e.token_ids] == whole
        assert events[-1].state == ReplyState.FINISHED
    finally:
        await b.stop()
        for engine in engines:
            engine.shutdown()


async def test_a_replica_restarted_under_its_id_carries_on_what_its_last_run_left(real_model_fp32, real_tokenizer):
    """Back before any failover took its queue over (a quick restart): the reply its last run
    had claimed and not finished carries on in the new run, whole, from the next event id."""
    prompt = real_tokenizer.encode(PROMPT)
    params = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
    whole, _ = run(fp32_engine(real_model_fp32, real_tokenizer), prompt, SamplingParams(**params))
    relay, registry = make_relay(None), InProcessRegistry(ttl_s=60)
    engines = [AsyncEngine(fp32_engine(real_model_fp32, real_tokenizer)) for _ in range(2)]
    first = ReplicaWorker(engines[0], relay, registry, ReplicaSettings(model="m", replica_id="a", drain_grace_s=0.05))
    again = ReplicaWorker(engines[1], relay, registry, ReplicaSettings(model="m", replica_id="a"))
    try:
        await first.start()
        await relay.launch("rep5", GenerationJob("rep5", "m", prompt, params).to_dict(), Lane.PAID,
                           queue=first.queue)
        for _ in range(3000):
            if await relay.log.last_event_id("rep5") >= 3:
                break
            await asyncio.sleep(0.01)
        await first.drain()  # leaves rep5 claimed, unfinished: as a process killed mid-reply does
        assert [j.job["reply_id"] for j in await relay.jobs.unfinished(queue=first.queue)] == ["rep5"]
        await again.start()
        events = await events_of(relay, "rep5")
        assert [e.n for e in events] == list(range(1, len(whole) + 2))
        assert [t for e in events[:-1] for t in e.token_ids] == whole
        assert events[-1].state == ReplyState.FINISHED
        for _ in range(100):
            if not await relay.jobs.unfinished(queue=again.queue):
                break
            await asyncio.sleep(0.05)
        assert await relay.jobs.unfinished(queue=again.queue) == []
    finally:
        await again.stop()
        for engine in engines:
            engine.shutdown()
