"""Lua scripts run by their sha over a RedisMux, all of a batch's calls in one round trip."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import NoScriptError

from fairway.redis_client.mux import RedisMux, pack


@dataclass(frozen=True)
class Script:
    """A Lua script; its sha is what EVALSHA names (Redis computes the same SHA-1)."""

    script: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.script.encode()).hexdigest())


def pack_call(script: Script, keys: Sequence[str], args: Sequence[Any]) -> bytes:
    """One call of script, packed: run_packed_scripts() takes a list of them."""
    return pack(["EVALSHA", script.sha, len(keys), *keys, *args])


def pack_call_bytes(script: Script, args: Sequence[bytes], numkeys: int) -> bytes:
    """pack_call() for arguments that are bytes already (keys first): the same bytes, packed
    without looking at each argument's type, for a call made once per token."""
    return _call_head(script.sha, len(args), numkeys) + b"".join([b"$%d\r\n%b\r\n" % (len(arg), arg) for arg in args])


@functools.lru_cache(maxsize=64)
def _call_head(sha: str, num_args: int, numkeys: int) -> bytes:
    """EVALSHA, the sha and numkeys, packed once per script and shape (not once per token)."""
    count = b"%d" % numkeys
    return (b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n" % (num_args + 3, sha.encode())
            + b"$%d\r\n%b\r\n" % (len(count), count))


async def run_scripts(mux: RedisMux, script: Script,
                      calls: Sequence[tuple[Sequence[str], Sequence[Any]]]) -> list[Any]:
    """Run script once per (keys, args), all in one pipelined round trip on mux; a call that failed
    has its error in its place. Reloads the script if Redis lost it (a restart, SCRIPT FLUSH): such
    calls did not run, so running them again is safe. Transport errors are raised."""
    return await run_packed_scripts(mux, script, [pack_call(script, keys, args) for keys, args in calls])


async def run_packed_scripts(mux: RedisMux, script: Script, calls: Sequence[bytes]) -> list[Any]:
    """run_scripts() of calls packed by pack_call() (a caller that repeats them packs them once)."""
    if not calls:
        return []
    results = await mux.batch_packed(calls)
    lost = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
    if lost:
        await mux.execute("SCRIPT", "LOAD", script.script)
        for i, result in zip(lost, await mux.batch_packed([calls[i] for i in lost]), strict=True):
            results[i] = result
    return results
