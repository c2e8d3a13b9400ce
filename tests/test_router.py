"""The router's cached view of the live replicas."""

from __future__ import annotations

import asyncio

import pytest

from fairway.replica.registry import InProcessRegistry, ReplicaInfo
from fairway.router import NoReplica, Router


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


def replica(name: str, load: int = 0) -> ReplicaInfo:
    return ReplicaInfo(name, "m", f"replica:{name}", 2048, 2000, load=load)


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
    with pytest.raises(NoReplica):
        await router.place("other-model")
    assert registry.looks == 2  # the miss looked again rather than trust the cached view
