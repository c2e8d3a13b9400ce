"""The health probe: is a replica whose heartbeats stopped still there?

A replica heartbeats every 0.5 s and its announcement lives 2 s. Waiting out the 2 s before a
failover is the safe answer when nothing else is known; asking the replica is faster. The probe
opens its announced health endpoint (replica/health.py): a refused or reset connection means no
process listens there any more (it died; its port is closed), so the replica is out now. Any
other outcome (an answer, or no answer in time: a stalled machine, a slow network) decides
nothing, and the announcement's expiry stays the judge, so a probe alone never fails a replica
that may still be producing tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

from fairway.replica.registry import ReplicaInfo

PROBE_TIMEOUT_S = 0.5


async def is_dead(info: ReplicaInfo, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when nothing listens at the replica's health endpoint (it has one and the connection
    was refused or reset); False when it answered, or did not in time, or has no endpoint."""
    if not info.health_url:
        return False
    address = urlsplit(info.health_url)
    if address.hostname is None or address.port is None:
        return False
    writer: asyncio.StreamWriter | None = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.hostname, address.port), timeout_s)
        writer.write(b"GET /health HTTP/1.1\r\nHost: replica\r\nConnection: close\r\n\r\n")
        await asyncio.wait_for(reader.readline(), timeout_s)
        return False
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    except (TimeoutError, OSError):
        return False
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
