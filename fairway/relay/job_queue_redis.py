"""RedisJobQueue: a stream per lane and one for the lane's front, {prefix}jobs:{<queue>}:<lane>
(and :<lane>:front), each with one consumer group whose one consumer is the queue's. A claim is
one script (claim.lua below) that reads the first stream with new entries, paid's front, paid,
free's front, free ... in order; an entry stays in its stream, pending, until ack() (XACK +
XDEL), so a stream holds exactly its queue's unfinished jobs. The queue's hash tag keeps its
streams in one Redis Cluster slot, which the script needs.

A claim that finds nothing waits with a plain XREAD BLOCK from each stream's last entry: it
claims nothing itself (a group read over several streams could take entries from more than one
lane at once), it only wakes the claimer, which runs the script again. A claim that took the last
waiting job also returns where each stream's group has read to, so the next claim (a replica's
claim loop, idle between jobs) starts with that wait instead of a script that would find nothing:
an XREAD from those ids returns at once if anything came in since.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from fairway.domain import LANE_ORDER, Lane
from fairway.redis_client import Command, RedisClient, Script, field_pairs
from fairway.relay.job_queue import DEFAULT_QUEUE, ClaimedJob, JobQueue, Part, decode_job, encode_job
from fairway.relay.redis_guard import guard

_GROUP = "replicas"
# (lane, front?) in the order a claim reads them
_STREAMS = [(lane, front) for lane in LANE_ORDER for front in (True, False)]

# KEYS: the queue's streams in claim order. ARGV: group, consumer, count. Returns {index, entries}
# of the first stream with new entries, or {0, last ids}: where an XREAD should wait from. With
# entries, and none left to read in any stream, {index, entries, read to}: the group's last
# delivered id per stream (where the next claim's XREAD waits from).
_CLAIM = Script("""
local function after(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, bm = tonumber(am), tonumber(bm)
  return am > bm or (am == bm and tonumber(as) > tonumber(bs))
end
local function read_to(key)
  if redis.call('EXISTS', key) == 0 then return '0-0' end
  local delivered = nil
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    for j = 1, #group, 2 do
      if group[j] == 'name' and group[j + 1] ~= ARGV[1] then break end
      if group[j] == 'last-delivered-id' then delivered = group[j + 1] end
    end
  end
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  if last == nil then return delivered or '0-0' end
  if delivered == nil or after(last[1], delivered) then return nil end
  return delivered
end
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local read = {'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS', key, '>'}
    local got = redis.pcall(unpack(read))
    if type(got) == 'table' and got.err then
      redis.call('XGROUP', 'CREATE', key, ARGV[1], '0')
      got = redis.call(unpack(read))
    end
    if got then
      local ids = {}
      for k, other in ipairs(KEYS) do
        ids[k] = read_to(other)
        if ids[k] == nil then return {i, got[1][2]} end
      end
      return {i, got[1][2], ids}
    end
  end
end
local last = {}
for i, key in ipairs(KEYS) do
  local entry = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  last[i] = entry and entry[1] or '0-0'
end
return {0, last}
""")


class RedisJobQueue(JobQueue):
    def __init__(self, client: RedisClient, *, prefix: str = "fairway:") -> None:
        self._client = client
        self._prefix = prefix
        # Per claim's streams: ids after which nothing waited when a claim emptied them (the next
        # claim of the same streams waits from there first).
        self._read_to: dict[tuple[str, ...], list[str]] = {}

    def _keys(self, queue: str) -> list[str]:
        return [f"{self._prefix}jobs:{{{queue}}}:{lane}" + (":front" if front else "") for lane, front in _STREAMS]

    def submit_command(self, job: dict[str, Any], lane: Lane | str, queue: str,
                       front: bool = False) -> tuple[str, Command]:
        """A new job's id and the command that queues it (for a caller that pipelines it)."""
        job_id = secrets.token_hex(16)
        key = self._keys(queue)[_STREAMS.index((Lane(lane), front))]
        return job_id, ["XADD", key, "*", "j", encode_job(job_id, job)]

    async def submit(self, job: dict[str, Any], lane: Lane | str = Lane.FREE, *, queue: str = DEFAULT_QUEUE,
                     front: bool = False) -> str:
        job_id, command = self.submit_command(job, lane, queue, front)
        with guard():
            await self._client.execute(*command)
        return job_id

    async def claim_many(self, *, queue: str = DEFAULT_QUEUE, max_count: int,
                         timeout: float | None = 0.0, lanes: Sequence[Lane] = LANE_ORDER) -> list[ClaimedJob]:
        every = self._keys(queue)
        # The streams of these lanes in claim order, each by its index among all (the receipt's).
        streams = [_STREAMS.index((lane, front)) for lane in lanes for front in (True, False)]
        keys = [every[i] for i in streams]
        deadline = None if timeout is None else time.monotonic() + timeout
        shape = tuple(keys)
        last = self._read_to.pop(shape, None)  # (taken either way: a claim that does not wait looks itself)
        if timeout == 0:
            last = None
        with guard():
            while True:
                if last is None:
                    result, = await self._client.run_scripts(_CLAIM, [(keys, [_GROUP, queue, max_count])])
                    if isinstance(result, Exception):
                        raise result
                    index, found, *emptied = result
                    if index:
                        if emptied:
                            self._read_to[shape] = emptied[0]
                        return [_claimed(every, streams[index - 1], entry) for entry in found]
                    last = found
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    self._read_to[shape] = last  # (nothing came in: still where to wait from)
                    return []
                woke = await self._client.blocking(
                    lambda wait, ids=last: ["XREAD", "BLOCK", max(1, int(wait * 1000)), "STREAMS", *keys, *ids],
                    remaining)
                if woke is None:
                    self._read_to[shape] = last
                    return []
                last = None

    def ack_commands(self, claimed: Sequence[ClaimedJob], queue: str) -> list[Command]:
        """ack() as commands, for a caller that pipelines them with others (their replies go to
        raise_if_not_acked())."""
        keys = self._keys(queue)
        commands: list[Command] = []
        for c in claimed:
            index, _, entry_id = c.receipt.partition(":")
            key = keys[int(index)]
            commands += [["XACK", key, _GROUP, entry_id], ["XDEL", key, entry_id]]
        return commands

    async def ack(self, claimed: Sequence[ClaimedJob], *, queue: str = DEFAULT_QUEUE) -> None:
        commands = self.ack_commands(claimed, queue)
        if not commands:
            return
        with guard():
            self.raise_if_not_acked(await self._client.batch(commands))

    @staticmethod
    def raise_if_not_acked(results: Sequence[Any]) -> None:
        """The first error among ack_commands' replies (a queue deleted meanwhile, NOGROUP, is none)."""
        for result in results:
            if isinstance(result, Exception) and not str(result).startswith("NOGROUP"):
                raise result

    async def unfinished(self, *, queue: str = DEFAULT_QUEUE, part: Part = "all") -> list[ClaimedJob]:
        claimed, waiting = await self._split(queue)
        return {"all": claimed + waiting, "claimed": claimed, "waiting": waiting}[part]

    async def delete(self, *, queue: str = DEFAULT_QUEUE) -> None:
        with guard():
            await self._client.execute("DEL", *self._keys(queue))

    async def depth(self, *, queue: str = DEFAULT_QUEUE) -> dict[Lane, int]:
        # Entries minus those claimed, per stream: counts only (a replica asks every heartbeat).
        keys = self._keys(queue)
        with guard():
            counts = await self._client.batch([c for key in keys for c in (["XLEN", key], ["XPENDING", key, _GROUP])])
        depth = {lane: 0 for lane in LANE_ORDER}
        for i, (lane, _) in enumerate(_STREAMS):
            entries, pending = counts[2 * i], counts[2 * i + 1]
            if isinstance(entries, Exception):
                raise entries
            claimed = 0 if isinstance(pending, Exception) else int(pending[0])  # NOGROUP: none claimed
            depth[lane] += max(0, int(entries) - claimed)
        return depth

    async def _split(self, queue: str) -> tuple[list[ClaimedJob], list[ClaimedJob]]:
        """The queue's entries: those claimed (pending in the group), and those waiting."""
        keys = self._keys(queue)
        with guard():
            ranges = await self._client.batch([["XRANGE", key, "-", "+"] for key in keys])
            pending = await self._client.batch([["XPENDING", key, _GROUP, "-", "+", 1 << 20] for key in keys])
        claimed: list[ClaimedJob] = []
        waiting: list[ClaimedJob] = []
        for index, (entries, taken) in enumerate(zip(ranges, pending, strict=True)):
            if isinstance(entries, Exception):
                raise entries
            taken_ids = set() if isinstance(taken, ResponseError) else {p[0] for p in taken}  # NOGROUP: none
            for entry in entries:
                (claimed if entry[0] in taken_ids else waiting).append(_claimed(keys, index, entry))
        return claimed, waiting


def _claimed(keys: list[str], index: int, entry: list[Any]) -> ClaimedJob:
    """A stream entry as a claimed job; one that is not ours carries {} (the worker drops it)."""
    entry_id, fields = entry[0], entry[1]
    lane, receipt = _STREAMS[index][0], f"{index}:{entry_id}"
    try:
        return decode_job(field_pairs(fields)["j"], lane, receipt)
    except (KeyError, ValueError, TypeError):
        return ClaimedJob("", lane, {}, receipt)
