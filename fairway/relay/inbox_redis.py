"""RedisInbox: an inbox is a stream, {prefix}inbox:{<name>}, with one consumer group (XADD,
XREADGROUP, XACK+XDEL, XPENDING IDLE + XCLAIM), so what a process had taken survives its death."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import orjson
from redis.exceptions import ResponseError

from fairway.redis_client import Command, RedisClient, field_pairs
from fairway.relay.inbox import Delivery, Inbox
from fairway.relay.redis_guard import guard

_GROUP = "consumers"  # an inbox's one consumer group


def _delivery(entry_id: str, flat: list[str], attempts: int) -> Delivery:
    """An inbox stream entry as a Delivery; an entry that is not one of ours carries {} (its
    consumer refuses it, and acknowledges it so it does not come back)."""
    try:
        item = orjson.loads(field_pairs(flat)["j"])
    except (KeyError, ValueError):  # (orjson's JSONDecodeError is a ValueError)
        item = {}
    return Delivery(entry_id, item if isinstance(item, dict) else {}, attempts)


def _ack_commands(key: str, deliveries: Sequence[Delivery]) -> list[list[Any]]:
    ids = [d.id for d in deliveries]
    return [["XACK", key, _GROUP, *ids], ["XDEL", key, *ids]] if ids else []


def _raise_errors(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, Exception):
            raise result


class RedisInbox(Inbox):
    def __init__(self, client: RedisClient, *, prefix: str = "fairway:", consumer_gone_s: float = 3600.0) -> None:
        self._client = client
        self._prefix = prefix
        self._consumer_gone_s = consumer_gone_s
        self._forget_consumers_at: dict[str, float] = {}  # per inbox key, loop time

    def _key(self, inbox: str) -> str:
        return f"{self._prefix}inbox:{{{inbox}}}"

    def post_command(self, inbox: str, item: dict[str, Any]) -> Command:
        """post() as one command, for a caller that pipelines it with others."""
        return ["XADD", self._key(inbox), "*", "j", orjson.dumps(item, option=orjson.OPT_NON_STR_KEYS)]

    async def post(self, inbox: str, item: dict[str, Any]) -> None:
        command = self.post_command(inbox, item)
        with guard():
            await self._client.execute(*command)

    async def take(self, inbox: str, consumer: str, *, max_count: int, timeout: float | None = 0.0,
                   acked: Sequence[Delivery] = ()) -> list[Delivery]:
        key = self._key(inbox)
        read = ["XREADGROUP", "GROUP", _GROUP, consumer, "COUNT", max_count]
        acks = _ack_commands(key, acked)
        for attempt in range(2):
            try:
                with guard():
                    if timeout is not None and timeout <= 0:  # the acknowledgements and the look in one trip
                        *acked_results, reply = await self._client.batch([*acks, [*read, "STREAMS", key, ">"]])
                        _raise_errors([*acked_results, reply])
                    else:
                        if acks:
                            _raise_errors(await self._client.batch(acks))
                        reply = await self._client.blocking(
                            lambda wait: [*read, "BLOCK", max(1, int(wait * 1000)), "STREAMS", key, ">"], timeout)
            except ResponseError as exc:
                # NOGROUP: first use, or a Redis that lost it (a restart: nothing of it is pending any
                # more, so nothing to acknowledge either); UNBLOCKED: the stream was deleted under a
                # blocked read.
                if attempt or not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                await self._create_group(key)
                acks = []
                continue
            return [_delivery(entry_id, flat, 1) for entry_id, flat in reply[0][1]] if reply else []
        raise AssertionError("unreachable")

    async def _create_group(self, key: str) -> None:
        # From the stream's start (0): items posted before the group existed are delivered too.
        with guard():
            try:
                await self._client.execute("XGROUP", "CREATE", key, _GROUP, "0", "MKSTREAM")
            except ResponseError as exc:
                if not str(exc).startswith("BUSYGROUP"):  # (another consumer made it meanwhile)
                    raise

    async def ack(self, inbox: str, deliveries: Sequence[Delivery]) -> None:
        if not deliveries:
            return
        with guard():
            _raise_errors(await self._client.batch(_ack_commands(self._key(inbox), deliveries)))

    async def reclaim(self, inbox: str, consumer: str, *, min_idle_s: float,
                      max_count: int) -> list[Delivery]:
        key, idle_ms = self._key(inbox), max(0, int(min_idle_s * 1000))
        with guard():
            try:
                pending = await self._client.execute("XPENDING", key, _GROUP, "IDLE", idle_ms, "-", "+", max_count)
            except ResponseError as exc:
                if str(exc).startswith("NOGROUP"):
                    return []  # nothing was ever taken
                raise
            await self._forget_consumers(key)
            if not pending:
                return []
            attempts = {entry_id: int(count) + 1 for entry_id, _, _, count in pending}
            # XCLAIM checks the idle time again: of two consumers reclaiming at once, one gets each.
            claimed = await self._client.execute("XCLAIM", key, _GROUP, consumer, idle_ms, *attempts)
        return [_delivery(entry[0], entry[1], attempts[entry[0]]) for entry in claimed if entry]

    async def _forget_consumers(self, key: str) -> None:
        """Now and then, drop the group's consumers that hold nothing and have not asked for
        anything for consumer_gone_s (gateway processes long gone: each had a name of its own)."""
        loop = asyncio.get_running_loop()
        if loop.time() < self._forget_consumers_at.get(key, 0.0):
            return
        self._forget_consumers_at[key] = loop.time() + 60.0
        consumers = [field_pairs(c) for c in await self._client.execute("XINFO", "CONSUMERS", key, _GROUP)]
        gone_ms = self._consumer_gone_s * 1000
        gone = [c["name"] for c in consumers if int(c["pending"]) == 0 and int(c["idle"]) > gone_ms]
        if gone:
            await self._client.batch([["XGROUP", "DELCONSUMER", key, _GROUP, name] for name in gone])
