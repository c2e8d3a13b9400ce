"""The router: its cached view of the live replicas, prefix affinity, overflow, regions, expiry,
and what the replicas announce (the registry on the real Redis server where it matters).

The fleets here are in process: each replica a real KV cache manager (the engine's, hashing and
caching blocks as the engine does) without a model, since which blocks get cached does not depend
on the tokens a model would pick; the prompts are built by the gateway's context builder with the
real tokenizer. The worker's own heartbeat is checked on a real (tiny) engine at the end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections import Counter

import pytest
from backends import missing
from redis_keys import delete_prefixed

from fairway.block_hash import block_hash, prefix_block_hashes
from fairway.conversation.context_builder import ContextBuilder
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.sequence import Sequence
from fairway.replica.prefix_summary import PrefixSummary
from fairway.replica.registry import InProcessRegistry, RedisRegistry, ReplicaInfo, ReplicaRegistry
from fairway.router import NoReplica, Router, RouterSettings, region_fallback
from fairway.router.router import REGION_MISS_S

REDIS_URL = os.environ.get("FAIRWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


class CountingRegistry(InProcessRegistry):
    """The in-process registry, counting how often the router looks at it (each look is a Redis
    round trip with the Redis registry), and slow to answer like one."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    async def live(self) -> list[ReplicaInfo]:
        self.looks += 1
        await asyncio.sleep(0.01)
        return await super().live()


def replica(name: str, load: int = 0, **fields) -> ReplicaInfo:
    return ReplicaInfo(name, "m", f"replica:{name}", 2048, 2000, load=load, **fields)


async def test_requests_that_find_the_view_stale_together_share_one_look() -> None:
    registry = CountingRegistry()
    await registry.announce(replica("a"))
    router = Router(registry, cache_s=0.05)
    placed = await asyncio.gather(*(router.place("m") for _ in range(30)))
    assert {r.id for r in placed} == {"a"} and registry.looks == 1
    await asyncio.sleep(0.06)  # stale again: the next crowd looks once more
    await asyncio.gather(*(router.place("m") for _ in range(30)))
    assert registry.looks == 2


async def test_the_least_loaded_replica_is_placed_and_a_missing_model_is_looked_up_afresh() -> None:
    registry = CountingRegistry()
    await registry.announce(replica("busy", load=3))
    await registry.announce(replica("idle", load=1))
    router = Router(registry, cache_s=60)
    assert (await router.place("m")).id == "idle"
    with pytest.raises(NoReplica, match="No replica is serving model 'other-model'"):
        await router.place("other-model")
    assert registry.looks == 2  # the miss looked again rather than trust the cached view


# -- the prefix summary and the announcement ------------------------------------------------------

def test_chained_hashes_of_a_prompt_are_the_engines_block_hashes() -> None:
    tokens = list(range(1000, 1000 + 16 * 5 + 7))  # five full blocks and a partial one
    parent, expected = None, []
    for start in range(0, 80, 16):
        parent = block_hash(parent, tuple(tokens[start:start + 16]))
        expected.append(parent)
    assert prefix_block_hashes(tokens) == expected
    first = block_hash(None, tuple(tokens[:32]))  # another block size: as an engine of that size hashes
    assert prefix_block_hashes(tokens, 32) == [first, block_hash(first, tuple(tokens[32:64]))]
    assert prefix_block_hashes(tokens[:15]) == []


def test_a_summary_holds_its_hashes_counts_leading_hits_and_stays_small() -> None:
    held = prefix_block_hashes(list(range(16 * 40)))  # 40 blocks
    summary = PrefixSummary.of(held[:30])
    assert all(h in summary for h in held[:30])
    assert summary.leading_hits(held) == 30  # the run stops at the first block it does not hold
    assert summary.leading_hits(held[:10]) == 10
    assert summary.leading_hits([held[35], *held[:30]]) == 0  # leading: a miss first is no run
    # Sized by capacity, not content: every announcement of a replica has the same size.
    assert len(PrefixSummary.of([]).bits) == len(summary.bits) == 4912  # 4,096 blocks at a 1% false-positive rate
    strangers = prefix_block_hashes(list(range(50_000, 50_000 + 16 * 4000)))
    full = PrefixSummary.of(prefix_block_hashes(list(range(16 * 4096))))  # (built once: ~20 ms)
    false_hits = sum(h in full for h in strangers)
    assert false_hits < 4000 * 0.02
    wire = PrefixSummary.from_wire(summary.to_wire())
    assert wire is not None and wire.leading_hits(held) == 30 and wire.count == 30
    # Every gateway reads each announcement twice a second: one decoded already is not decoded again.
    assert PrefixSummary.from_wire(summary.to_wire()) is wire
    assert PrefixSummary.from_wire({**summary.to_wire(), "n": 31}) is not wire
    for bad in ({"k": 7}, {"bits": "not base64!", "k": 7}, {"bits": ["a list"], "k": 7}, {"bits": "", "k": 7},
                {"bits": summary.to_wire()["bits"], "k": 0}, "a string"):
        assert PrefixSummary.from_wire(bad) is None


def test_an_announcement_reads_back_whatever_the_replicas_version() -> None:
    summary = PrefixSummary.of(prefix_block_hashes(list(range(64))))
    info = replica("a", load=3, region="eu", running={"paid": 2}, waiting={"free": 1}, free_kv_blocks=100,
                   kv_blocks=2048, ttft_s=0.25, prefix=summary, expires_at=123.0)
    raw = info.to_json()
    assert "expires_at" not in raw  # the reader's, never announced
    back = ReplicaInfo.from_json(raw)
    assert (back.region, back.running, back.waiting, back.ttft_s, back.free_kv_blocks) == ("eu", {"paid": 2},
                                                                                          {"free": 1}, 0.25, 100)
    assert back.prefix is not None and back.prefix.leading_hits(prefix_block_hashes(list(range(64)))) == 4
    # An older replica's announcement (before regions and summaries), and a newer one's extra fields.
    old = ReplicaInfo.from_json('{"id":"o","model":"m","queue":"replica:o","max_model_len":2048,'
                                '"max_prompt_tokens":2000,"load":2,"capacity":256,"started_at":1.0}')
    assert (old.region, old.prefix, old.load, old.block_size) == ("local", None, 2, 16)
    newer = ReplicaInfo.from_json(raw[:-1] + ',"gpu_temperature":71,"prefix":{"bloom":"v2"},"running":[1]}')
    assert newer.prefix is None and newer.running == {} and newer.region == "eu"


# -- a fleet in process --------------------------------------------------------------------------

class SimulatedReplica:
    """A replica's prefix cache, real: the engine's KVCacheManager admitting each reply's sequence,
    caching its full blocks as they are computed and keeping them after it ends. Announces what the
    worker announces about it."""

    def __init__(self, name: str, region: str = "local", num_blocks: int = 2048) -> None:
        self.name = name
        self.region = region
        self.kv = KVCacheManager(num_blocks)
        self.load = 0

    def serve(self, tag: str, prompt: list[int], reply: list[int]) -> int:
        """Run one reply through the cache; returns the prompt tokens it found cached."""
        seq = Sequence(tag, list(prompt), SamplingParams(max_tokens=max(1, len(reply))))
        assert self.kv.admit(seq)
        cached = seq.num_computed_tokens
        seq.num_computed_tokens = len(prompt)  # prefilled
        assert self.kv.grow(seq, len(reply))
        seq.token_ids += reply
        seq.num_computed_tokens = len(seq.token_ids)  # and decoded
        self.kv.cache_full_blocks(seq)
        self.kv.free(seq)
        return cached

    def info(self, measured_at: float | None = None) -> ReplicaInfo:
        return replica(self.name, load=self.load, region=self.region, measured_at=measured_at or time.time(),
                       prefix=PrefixSummary.of(self.kv.pool.recent_hashes(4096)),
                       free_kv_blocks=self.kv.pool.num_free, kv_blocks=self.kv.pool.num_blocks)


class Fleet:
    def __init__(self, *replicas: SimulatedReplica, registry: ReplicaRegistry | None = None,
                 settings: RouterSettings | None = None) -> None:
        self.replicas = {r.name: r for r in replicas}
        self.registry = registry or InProcessRegistry()
        self.router = Router(self.registry, settings, cache_s=0)  # every placement sees the latest beat

    async def heartbeat(self) -> None:
        for r in self.replicas.values():
            await self.registry.announce(r.info())

    async def place(self, prompt: list[int], region: str | None = None) -> SimulatedReplica:
        return self.replicas[(await self.router.place("m", prompt, region)).id]


@pytest.fixture(scope="module")
def builder(real_tokenizer) -> ContextBuilder:
    return ContextBuilder(real_tokenizer, 8192)


SYSTEM = [{"role": "system", "content": "You are Fairway's test assistant. " + "Answer briefly and kindly. " * 12}]


def turn_prompt(builder: ContextBuilder, history: list[dict], question: str) -> list[int]:
    return builder.build(SYSTEM, history, [{"role": "user", "content": question}], 16).prompt_token_ids


async def test_a_conversation_stays_on_one_replica_every_turn_while_load_is_balanced(builder, real_tokenizer) -> None:
    """Two conversations at once, five turns each: each lands where its history is cached, turn
    after turn, and finds all of its previous prompt there."""
    fleet = Fleet(SimulatedReplica("a"), SimulatedReplica("b"))
    await fleet.heartbeat()
    histories: dict[str, list[dict]] = {"c1": [], "c2": []}
    placed: dict[str, list[str]] = {"c1": [], "c2": []}
    previous: dict[str, list[int]] = {}
    for turn in range(5):
        for conv, history in histories.items():
            question = f"Conversation {conv}, question {turn}: what is {turn} plus {len(conv)}?"
            prompt = turn_prompt(builder, history, question)
            target = await fleet.place(prompt)
            answer = f"{turn} plus {len(conv)} is {turn + len(conv)}."
            cached = target.serve(f"{conv}-{turn}", prompt, real_tokenizer.encode(answer))
            if turn:  # the whole previous prompt was cached where it landed
                assert cached >= len(previous[conv]) // 16 * 16, (conv, turn, cached, len(previous[conv]))
            previous[conv] = prompt
            placed[conv].append(target.name)
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            await fleet.heartbeat()  # (both replicas announce the same load: 0)
    assert len(set(placed["c1"])) == 1 and len(set(placed["c2"])) == 1, placed


async def test_a_hot_spot_overflows_to_the_least_loaded_replica(builder, real_tokenizer) -> None:
    hot, cold = SimulatedReplica("hot"), SimulatedReplica("cold")
    fleet = Fleet(hot, cold, settings=RouterSettings(overflow_abs=4, overflow_rel=0.5))
    prompt = turn_prompt(builder, [], "Which replica has this cached?")
    hot.serve("warm-up", prompt, real_tokenizer.encode("This one."))
    for load, expected in [(0, "hot"), (4, "hot"), (5, "cold")]:  # overflow past 4 more than cold's 0
        hot.load = load
        await fleet.heartbeat()
        choice = await fleet.router.choose("m", prompt)
        assert choice.replica.id == expected, (load, choice)
        assert choice.reason == ("affinity" if expected == "hot" else "overflow")
        assert choice.score == (len(prompt) // 16 if expected == "hot" else 0)
    # Relative too: 15 against 10 is 5 more, but not half as many again.
    hot.load, cold.load = 15, 10
    await fleet.heartbeat()
    assert (await fleet.place(prompt)).name == "hot"
    hot.load = 16
    await fleet.heartbeat()
    assert (await fleet.place(prompt)).name == "cold"


async def test_a_burst_of_eight_spreads_over_two_idle_replicas(builder) -> None:
    """No heartbeat comes during the burst: what this gateway placed is what spreads it."""
    fleet = Fleet(SimulatedReplica("a"), SimulatedReplica("b"))
    await fleet.heartbeat()
    prompts = [turn_prompt(builder, [], f"Burst request {i}: say hi.") for i in range(8)]
    placed = await asyncio.gather(*(fleet.place(p) for p in prompts))
    assert Counter(r.name for r in placed) == {"a": 4, "b": 4}
    # A burst of a prefix one of them caches still spreads once that one is overloaded; affinity
    # keeps more of it where the cache is.
    fleet.replicas["a"].serve("warm", prompts[0], [])
    await asyncio.sleep(0.01)
    await fleet.heartbeat()  # measured after the first burst: its placements are the beat's now
    again = Counter(r.name for r in await asyncio.gather(*(fleet.place(prompts[0]) for _ in range(8))))
    assert again == {"a": 6, "b": 2}  # b from when a was more than 4 ahead (and over half again)


async def test_a_placement_counts_until_a_heartbeat_measured_after_it() -> None:
    registry = InProcessRegistry()
    router = Router(registry, cache_s=0)
    await registry.announce(replica("a"))
    await registry.announce(replica("b", load=1))
    assert [(await router.place("m")).id for _ in range(3)] == ["a", "b", "a"]
    assert router.load(replica("a", measured_at=0.0)) == 2
    await asyncio.sleep(0.01)
    await registry.announce(replica("a", load=2))  # measured now: it counts those two itself
    live = {r.id: r for r in await router.live()}
    assert router.load(live["a"]) == 2 and router.load(live["b"]) == 2


async def test_the_requested_region_is_preferred_and_another_serves_when_it_has_none() -> None:
    eu, us = SimulatedReplica("eu-1", "eu"), SimulatedReplica("us-1", "us")
    eu.load = 50  # busy, and still the only one in its region
    fleet = Fleet(eu, us)
    await fleet.heartbeat()
    served = await fleet.router.place("m", [1] * 40, "eu")
    assert served.id == "eu-1" and region_fallback("eu", served) is None
    served = await fleet.router.place("m", [1] * 40, "ap")  # no replica in ap: the least loaded elsewhere
    assert served.id == "us-1" and region_fallback("ap", served) == "us"
    assert region_fallback(None, served) is None


async def test_a_replica_just_started_in_the_requested_region_is_found_before_falling_back() -> None:
    """The cached view (60 s here) predates the region's first replica: a request naming that
    region looks afresh and is placed there, not elsewhere; requests to a region with no replica
    look again at most every REGION_MISS_S, not once each."""
    registry = CountingRegistry()
    await registry.announce(replica("us-1", region="us"))
    router = Router(registry, cache_s=60)
    assert (await router.place("m", region="us")).id == "us-1" and registry.looks == 1
    await asyncio.sleep(REGION_MISS_S)
    await registry.announce(replica("eu-1", region="eu", load=9))  # just started, after the view
    assert (await router.place("m", region="eu")).id == "eu-1" and registry.looks == 2
    await asyncio.sleep(REGION_MISS_S)
    placed = await asyncio.gather(*(router.place("m", region="ap") for _ in range(20)))
    assert len(placed) == 20 and registry.looks == 3  # served elsewhere, after one look for all


async def test_round_robin_takes_each_replica_in_turn_whatever_is_cached(builder) -> None:
    fleet = Fleet(SimulatedReplica("a"), SimulatedReplica("b"), settings=RouterSettings(routing="round-robin"))
    prompt = turn_prompt(builder, [], "Round and round.")
    fleet.replicas["a"].serve("warm", prompt, [])
    await fleet.heartbeat()
    assert [(await fleet.place(prompt)).name for _ in range(4)] == ["a", "b", "a", "b"]


# -- expiry, on both registries ------------------------------------------------------------------

@pytest.fixture(params=["memory", "redis"])
async def registry(request):
    if request.param == "memory":
        yield InProcessRegistry()
        return
    prefix = f"test:{uuid.uuid4().hex[:12]}:"
    registry = RedisRegistry(REDIS_URL, prefix=prefix)
    try:
        await registry.live()
    except Exception as exc:
        await registry.close()
        missing("Redis", f"nothing answers at {REDIS_URL}: {exc}")
    yield registry
    await delete_prefixed(REDIS_URL, prefix)
    await registry.close()


async def test_a_replica_whose_heartbeat_expired_is_never_chosen(registry, builder) -> None:
    """Even from a cached view that still lists it, and though it would win on every count."""
    favourite, other = SimulatedReplica("favourite"), SimulatedReplica("other")
    prompt = turn_prompt(builder, [], "Pick the favourite.")
    favourite.serve("warm", prompt, [])
    other.load = 3
    registry.ttl_s = 1.0  # the favourite's last heartbeat: it expires in a second
    await registry.announce(favourite.info())
    registry.ttl_s = 30.0
    await registry.announce(other.info())
    router = Router(registry, cache_s=60)
    assert (await router.place("m", prompt)).id == "favourite"
    expiring = next(r for r in await router.live() if r.id == "favourite")
    assert 0 < expiring.expires_at - time.monotonic() <= 1.0
    await asyncio.sleep(1.05)
    assert {r.id for r in await registry.live()} == {"other"}  # the registry dropped it
    assert [r.id for r in await router.live()] == ["other"]  # and the cached view, without a look
    assert {(await router.place("m", prompt)).id for _ in range(5)} == {"other"}


async def test_a_draining_replica_is_never_chosen(registry, builder) -> None:
    """A drain (SIGTERM) announces it: out of routing at the next look, though it caches the prompt
    and is idle; the model's last replica draining leaves it with none (a 503 no_replica)."""
    favourite, other = SimulatedReplica("favourite"), SimulatedReplica("other")
    prompt = turn_prompt(builder, [], "Pick the favourite.")
    favourite.serve("warm", prompt, [])
    other.load = 3
    await registry.announce(favourite.info())
    await registry.announce(other.info())
    router = Router(registry, cache_s=0)
    assert (await router.place("m", prompt)).id == "favourite"
    await registry.announce(dataclasses.replace(favourite.info(), draining=True))
    assert {(await router.place("m", prompt)).id for _ in range(5)} == {"other"}
    await registry.announce(dataclasses.replace(other.info(), draining=True))
    with pytest.raises(NoReplica):
        await router.place("m", prompt)


async def test_the_registry_carries_the_whole_announcement(registry) -> None:
    summary = PrefixSummary.of(prefix_block_hashes(list(range(16 * 100))))
    await registry.announce(replica("full", load=7, region="eu", running={"paid": 5}, waiting={"free": 2},
                                    ttft_s=0.4, prefix=summary, free_kv_blocks=9))
    (back,) = await registry.live()
    assert (back.load, back.region, back.running, back.waiting, back.ttft_s, back.free_kv_blocks) == \
        (7, "eu", {"paid": 5}, {"free": 2}, 0.4, 9)
    assert back.prefix is not None and back.prefix.leading_hits(prefix_block_hashes(list(range(16 * 120)))) == 100
    assert len(back.to_json()) < 7_500  # a heartbeat, with its 4,096 blocks' summary


# -- what a real worker announces ----------------------------------------------------------------

async def test_the_workers_heartbeat_describes_its_engines_cache_and_load(tiny_model) -> None:
    from fairway.engine import AsyncEngine, EngineConfig, LLMEngine
    from fairway.relay import make_relay
    from fairway.replica.worker import ReplicaSettings, ReplicaWorker

    engine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(num_kv_blocks=256, speculative=None)))
    registry = InProcessRegistry()
    relay = make_relay(None)
    worker = ReplicaWorker(engine, relay, registry, ReplicaSettings(model="m", region="eu-west", heartbeat_s=0.05))
    prompt = [(7 * i) % 200 + 1 for i in range(16 * 6 + 3)]
    await worker.start()
    try:
        first = (await registry.live())[0]
        assert (first.region, first.load, first.kv_blocks, first.free_kv_blocks) == ("eu-west", 0, 256, 256)
        assert first.ttft_s is None and first.prefix is not None and first.prefix.count == 0
        await relay.launch("r1", {"reply_id": "r1", "model": "m", "prompt_token_ids": prompt,
                                  # long enough to be seen running by several heartbeats
                                  "sampling": {"max_tokens": 600, "temperature": 0, "ignore_eos": True},
                                  "lane": "paid", "tier": "paid", "submitted_at": time.time()},
                           "paid", queue=worker.queue)
        busy = None
        for _ in range(1000):
            await asyncio.sleep(0.02)
            latest = (await registry.live())[0]
            if latest.running:
                busy = busy or latest
            if not latest.load and latest.ttft_s is not None and latest.prefix and latest.prefix.count:
                break
        assert busy is not None and busy.running == {"paid": 1} and busy.load == 1
        assert latest.load == 0 and latest.ttft_s is not None and latest.ttft_s > 0
        # The router, hashing the prompt itself, finds every full block of it in the summary.
        assert latest.prefix.leading_hits(prefix_block_hashes(prompt)) == len(prompt) // 16
        assert latest.started_at == first.started_at
    finally:
        await worker.stop()
        engine.shutdown()
