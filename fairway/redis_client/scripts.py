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


def pack_args(args: Sequence[Any]) -> bytes:
    """Arguments packed as a command packs them, without the command's header: a part of a call
    that script_call() assembles."""
    packed = pack(list(args))
    return packed[packed.index(b"\r\n") + 2:]


def args_format(args: Sequence[bytes | None]) -> bytes:
    """pack_args() as one bytes format, for a part packed once per token: the arguments given are
    packed in once, each None is a slot the caller fills with the argument's length and bytes,
    args_format(...) % (len(a), a, len(b), b, ...), in order."""
    return b"".join(_SLOT if arg is None else (_SLOT % (len(arg), arg)).replace(b"%", b"%%") for arg in args)


def script_call(script: Script, keys: Sequence[bytes], args: Sequence[bytes], num_keys: int, num_args: int) -> bytes:
    """One call of script assembled from packed parts (pack_args(), or args_format() filled in):
    the keys' parts, then the other arguments' parts, and how many arguments each holds. The same
    bytes as pack_call(); a call over several items (a script that appends many events) is one
    part per item, packed as each item comes."""
    count = b"%d" % num_keys
    return (b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%b\r\n$%d\r\n%b\r\n"
            % (num_keys + num_args + 3, script.sha.encode(), len(count), count)) + b"".join(keys) + b"".join(args)


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
