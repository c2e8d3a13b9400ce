"""The health probe: is a replica whose heartbeats stopped still there?

A replica heartbeats every 0.5 s and its announcement lives 2 s. Waiting out the 2 s before a
failover is the safe answer when nothing else is known; asking the replica is faster. The probe
opens its announced health endpoint (replica/health.py): a refused or reset connection means no
process listens there any more (it died; its port is closed), so the replica is out now. Any
other outcome (an answer, or no answer in time: a stalled machine, a slow network) decides
nothing, and the announcement's expiry stays the judge, so a probe alone never fails a replica
that may still be producing tokens.

The other question, asked of a replica whose announcement is gone: does it still serve? An
announcement lapses without its replica going when Redis restarts under it (the downtime outlasts
every announcement's ttl at once) or the replica loses Redis for a moment; its /ready answering
200 says it is there and will announce again on its next heartbeat (router/failover.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

from fairway.replica.registry import ReplicaInfo

PROBE_TIMEOUT_S = 0.5


REFUSED = -1  # what _ask returns when nothing listens at the endpoint


async def is_dead(info: ReplicaInfo, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when nothing listens at the replica's health endpoint (it has one and the connection
    was refused or reset); False when it answered, or did not in time, or has no endpoint."""
    return await _ask(info, "/health", timeout_s) == REFUSED


async def is_serving(info: ReplicaInfo, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when the replica's /ready answers 200: its process runs and serves (not draining,
    not stopping). False for anything else, including no answer in time."""
    return await _ask(info, "/ready", timeout_s) == 200


async def _ask(info: ReplicaInfo, path: str, timeout_s: float) -> int | None:
    """The status of GET path at the replica's health endpoint; REFUSED when the connection was
    refused or reset; None when nothing could be told (no endpoint, no answer in time, an answer
    that is not HTTP)."""
    if not info.health_url:
        return None
    address = urlsplit(info.health_url)
    if address.hostname is None or address.port is None:
        return None
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.hostname, address.port), timeout_s)
        writer.write(b"GET %s HTTP/1.1\r\nHost: replica\r\nConnection: close\r\n\r\n" % path.encode())
        status_line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (ConnectionRefusedError, ConnectionResetError):
        return REFUSED
    except (TimeoutError, OSError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    parts = status_line.split(b" ", 2)
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
