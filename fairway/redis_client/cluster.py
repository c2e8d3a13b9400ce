"""The multiplexed connection's interface over a Redis Cluster: one RedisMux per master, each
command sent to the master that holds its key's slot.

Fairway's keys carry hash tags ({reply id}, {queue}, {inbox}), so everything one command or one
script touches lives in one slot. A batch is split by node and its parts sent concurrently, each
in its node's order (ordered=True sends the parts one after the other, in the order their first
commands came: a new reply's log before its job); the replies come back in the batch's order. A
MULTI ... EXEC block goes whole to the node of its first keyed command. A MOVED or ASK reply
(slots moved: resharding, a failover) refreshes the slot map and the commands it refused run
again, once: Redis did not run them.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import hiredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from fairway.redis_client.mux import Command, RawConnection, RedisMux, pack

_KEYLESS = {"MULTI", "EXEC", "PING", "SCRIPT", "INFO", "CLUSTER", "TIME"}


def runs(indices: Sequence[int], size: int) -> list[list[int]]:
    """indices cut into runs of at most size, in order."""
    return [list(indices[start:start + size]) for start in range(0, len(indices), size)]


def slot_groups(keys: Sequence[str], size: int) -> list[list[int]]:
    """The indices of keys grouped by hash slot, each group in order and cut into runs of size."""
    by_slot: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_slot.setdefault(key_slot(key.encode()), []).append(i)
    return [run for group in by_slot.values() for run in runs(group, size)]


def command_key(command: Sequence[Any]) -> str | None:
    """The key a command routes by (its first key), or None for a command without one."""
    name = str(command[0]).upper()
    if name in _KEYLESS or len(command) < 2:
        return None
    if name in ("EVAL", "EVALSHA"):
        return str(command[3]) if int(command[2]) > 0 else None
    if name == "LMPOP":
        return str(command[2])
    if name == "BLMPOP":
        return str(command[3])
    if name in ("XREAD", "XREADGROUP"):
        upper = [str(part).upper() for part in command]
        return str(command[upper.index("STREAMS") + 1])
    if name in ("XINFO", "XGROUP"):
        return str(command[2])
    return str(command[1])


def _decode(packed: bytes) -> list[str]:
    reader = hiredis.Reader(encoding="utf-8", errors="replace")
    reader.feed(packed)
    return reader.gets()


def _units(commands: Sequence[list[str]]) -> list[list[int]]:
    """Indices of the batch's commands grouped into what must go to one node together: each
    command alone, or a MULTI ... EXEC block whole."""
    units: list[list[int]] = []
    open_block: list[int] | None = None
    for i, command in enumerate(commands):
        name = str(command[0]).upper()
        if open_block is not None:
            open_block.append(i)
            if name in ("EXEC", "DISCARD"):
                units.append(open_block)
                open_block = None
        elif name == "MULTI":
            open_block = [i]
        else:
            units.append([i])
    if open_block is not None:
        units.append(open_block)
    return units


def _moved(reply: Any) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith(("MOVED", "ASK"))


class ClusterMux:
    """RedisMux's interface (execute, batch, batch_packed, connect_raw) over the cluster that the
    node at seed_url belongs to."""

    def __init__(self, seed_url: str, seed: RedisMux, make_mux: Callable[[str], RedisMux]) -> None:
        self._seed_url = seed_url
        self._seed = seed
        self._make_mux = make_mux
        self._starts: list[int] = []  # the slot ranges' first slots, sorted
        self._ranges: list[tuple[int, int, str]] = []  # (first, last, node url), in the same order
        self._nodes: dict[str, RedisMux] = {}
        self._mapping = asyncio.Lock()

    # -- the slot map ------------------------------------------------------------------------

    def _node_url(self, host: str, port: int) -> str:
        parts = urlsplit(self._seed_url)
        auth = parts.netloc.rpartition("@")[0]
        netloc = f"{auth}@{host}:{port}" if auth else f"{host}:{port}"
        return urlunsplit((parts.scheme, netloc, "", "", ""))

    async def refresh(self) -> None:
        """Read the slot map (CLUSTER SLOTS) from a node that answers."""
        async with self._mapping:
            seed_host = urlsplit(self._seed_url).hostname or "127.0.0.1"
            muxes = [self._seed, *self._nodes.values()]
            error: Exception | None = None
            for mux in muxes:
                try:
                    slots = await mux.execute("CLUSTER", "SLOTS")
                    break
                except Exception as exc:  # (that node is down: ask the next)
                    error = exc
            else:
                raise error or ResponseError("no cluster node answered CLUSTER SLOTS")
            ranges = sorted((int(first), int(last), self._node_url(master[0] or seed_host, int(master[1])))
                            for first, last, master, *_ in slots)
            self._ranges = ranges
            self._starts = [first for first, _, _ in ranges]

    def node_of(self, key: str | None) -> str:
        """The url of the master that holds key's slot (any master for no key)."""
        if key is None:
            return self._ranges[0][2]
        slot = key_slot(key.encode())
        i = bisect.bisect_right(self._starts, slot) - 1
        first, last, url = self._ranges[i]
        if not first <= slot <= last:
            raise ResponseError(f"CLUSTERDOWN slot {slot} is not served")
        return url

    def mux_of(self, url: str) -> RedisMux:
        mux = self._nodes.get(url)
        if mux is None:
            mux = self._nodes[url] = self._make_mux(url)
        return mux

    # -- commands ----------------------------------------------------------------------------

    async def execute(self, *command: Any) -> Any:
        if str(command[0]).upper() == "SCRIPT":  # SCRIPT LOAD: every master needs the script
            replies = await asyncio.gather(*(self.mux_of(url).execute(*command)
                                             for url in {url for _, _, url in self._ranges}))
            return replies[0]
        (reply,) = await self.batch([command])
        if isinstance(reply, ResponseError):
            raise reply
        return reply

    async def batch(self, commands: Sequence[Command], *, ordered: bool = False) -> list[Any]:
        return await self._run([list(c) for c in commands], [pack(c) for c in commands], ordered)

    async def batch_packed(self, packed: Sequence[bytes], *, ordered: bool = False) -> list[Any]:
        return await self._run([_decode(p) for p in packed], list(packed), ordered)

    async def _run(self, commands: list[list[Any]], packed: list[bytes], ordered: bool) -> list[Any]:
        results: list[Any] = [None] * len(commands)
        todo = list(range(len(commands)))
        for attempt in range(2):
            by_node: dict[str, list[int]] = {}
            for unit in _units([commands[i] for i in todo]):
                indices = [todo[i] for i in unit]
                key = next((k for k in (command_key(commands[i]) for i in indices) if k is not None), None)
                by_node.setdefault(self.node_of(key), []).extend(indices)
            parts = [(self.mux_of(url), indices) for url, indices in by_node.items()]
            if ordered:
                replies = [await mux.batch_packed([packed[i] for i in indices]) for mux, indices in parts]
            else:
                replies = await asyncio.gather(*(mux.batch_packed([packed[i] for i in indices])
                                                 for mux, indices in parts))
            for (_, indices), node_replies in zip(parts, replies, strict=True):
                for i, reply in zip(indices, node_replies, strict=True):
                    results[i] = reply
            todo = [i for i in todo if _moved(results[i])]
            if not todo or attempt:
                break
            await self.refresh()
        return results

    async def connect_raw(self, on_data: Callable[[bytes], None], key: str | None = None) -> RawConnection:
        return await self.mux_of(self.node_of(key)).connect_raw(on_data)

    async def close(self) -> None:
        for mux in self._nodes.values():
            await mux.close()
        self._nodes.clear()
