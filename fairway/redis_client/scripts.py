"""Lua scripts run by their sha over a RedisMux, all of a batch's calls in one round trip."""

from __future__ import annotations

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


_SLOT = b"$%d\r\n%b\r\n"  # one argument: its length, then its bytes


def call_format(script: Script, numkeys: int, args: Sequence[bytes | None]) -> bytes:
    """A call of script as one bytes format, for a call made once per token (keys first in args):
    the arguments given are packed in once, each None is a slot the caller fills with the
    argument's length and bytes, call_format(...) % (len(a), a, len(b), b, ...), in order. The
    same bytes as pack_call(), in one formatting step instead of one per argument."""
    return _call_head(script.sha, len(args), numkeys) + b"".join(
        _SLOT if arg is None else (_SLOT % (len(arg), arg)).replace(b"%", b"%%") for arg in args)


def _call_head(sha: str, num_args: int, numkeys: int) -> bytes:
    """EVALSHA, the sha and numkeys, packed."""
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
