"""The replica registry: each replica announces itself every heartbeat (ReplicaSettings.heartbeat_s,
0.5 s): its model, region and window, its load, and a summary of the prefix blocks it caches. An
announcement expires after ttl_s (2 s), so a replica that stops heartbeating drops out of routing
in about 2 s without anyone having to notice it died. The registry also remembers every replica
that ever announced until a failover has handed on what its queue held (gone(), forget()), and
lets one process at a time take a gone replica's work over (claim_takeover).

The replica writes it and the router reads it, so it lives with the replica (the lower part).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any

from fairway.block_hash import BLOCK_SIZE
from fairway.replica.prefix_summary import PrefixSummary

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 2.0  # four missed heartbeats (0.5 s apart) and the replica is out
DEFAULT_REGION = "local"
REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a region's name: replicas', requests', keys'
# Never announced: what the registry that read an announcement knows about it.
_LOCAL_FIELDS = ("expires_at",)


@dataclass
class ReplicaInfo:
    """One announcement. Read tolerantly (from_json): a field an older replica does not send takes
    its default, one a newer replica sends and this one does not know is ignored."""

    id: str
    model: str
    queue: str  # the bus queue it claims jobs from
    max_model_len: int  # context window: prompt and reply together
    max_prompt_tokens: int  # the longest prompt its KV cache could ever admit
    load: int = 0  # replies in flight: running + waiting, all lanes (what routers compare)
    capacity: int = 0  # replies it runs at once
    sandbox_off: str = "this replica has no sandbox"  # why execute_code is off here; "": it runs
    draining: bool = False  # leaving (SIGTERM): place nothing more here
    started_at: float = field(default_factory=time.time)
    region: str = DEFAULT_REGION
    # Load per lane: generating (first token out), and waiting (claimed and not started, or still
    # in its queue); the engine's free KV blocks (idle cached blocks count: they are reusable); the
    # median TTFT of its recent replies (None before the first).
    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    free_kv_blocks: int = 0
    kv_blocks: int = 0
    ttft_s: float | None = None
    # Replies it finishes per second with its seats full, measured (seats.py; None before the
    # first ends): the router predicts a new reply's wait as the queue ahead of it over this.
    drain_rate: float | None = None
    mini_of: str = ""  # the main model whose mini pool it serves; "": the model's own pool
    ttft_p99_s: float | None = None  # the 99th percentile of its replies of the last 30 s (the fleet's target)
    # Jobs that reached its queue since it started: the new ones it claimed (not a failover's
    # continuations) plus those still queued. The fleet manager's arrivals are the growth of this
    # count over the fleet (fairway/fleet/signals.py).
    arrived: int = 0
    block_size: int = BLOCK_SIZE  # tokens per KV block: how the router hashes a prompt for this replica
    prefix: PrefixSummary | None = None  # the blocks it most recently used (prefix_summary.py)
    measured_at: float = field(default_factory=time.time)  # wall clock when the load above was taken
    health_url: str = ""  # its health endpoint (replica/health.py); "": none to probe
    # Local monotonic time the announcement expires, set by the registry that read it.
    expires_at: float = float("inf")

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _LOCAL_FIELDS}
        data["prefix"] = self.prefix.to_wire() if self.prefix is not None else None
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReplicaInfo:
        data: dict[str, Any] = json.loads(raw)
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k not in _LOCAL_FIELDS}
        known["prefix"] = PrefixSummary.from_wire(data["prefix"]) if data.get("prefix") else None
        for name in ("running", "waiting"):
            if not isinstance(known.get(name, {}), dict):
                known.pop(name)
        return cls(**known)


class ReplicaRegistry(ABC):
    ttl_s: float

    @abstractmethod
    async def announce(self, info: ReplicaInfo) -> None:
        """Register or refresh a replica for another ttl_s."""

    @abstractmethod
    async def withdraw(self, replica_id: str) -> None:
        """Leave at once (clean shutdown), rather than after ttl_s."""

    @abstractmethod
    async def live(self) -> list[ReplicaInfo]:
        """Replicas whose last announcement has not expired, each with its expires_at."""

    @abstractmethod
    async def gone(self) -> list[str]:
        """Replicas that announced, then expired or withdrew, and have not been forgotten: each
        may have left jobs in its queue for a failover to hand on."""

    @abstractmethod
    async def forget(self, replica_id: str) -> None:
        """Its queue has been handed on: no longer gone()."""

    @abstractmethod
    async def claim_takeover(self, replica_id: str, owner: str, ttl_s: float) -> bool:
        """Whether owner may hand on the gone replica's work now: True for one claimant at a
        time, for ttl_s (if it dies meanwhile, another claims it after that)."""

    async def close(self) -> None:  # noqa: B027  (optional hook: only Redis has connections)
        """Release connections; the in-process registry has none."""


class InProcessRegistry(ReplicaRegistry):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._replicas: dict[str, tuple[float, ReplicaInfo]] = {}
        self._known: set[str] = set()
        self._takeovers: dict[str, tuple[float, str]] = {}

    async def announce(self, info: ReplicaInfo) -> None:
        self._replicas[info.id] = (time.monotonic() + self.ttl_s, info)
        self._known.add(info.id)

    async def withdraw(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def live(self) -> list[ReplicaInfo]:
        now = time.monotonic()
        return [dataclasses.replace(info, expires_at=deadline)
                for deadline, info in self._replicas.values() if deadline > now]

    async def gone(self) -> list[str]:
        live = {info.id for info in await self.live()}
        return sorted(self._known - live)

    async def forget(self, replica_id: str) -> None:
        self._known.discard(replica_id)

    async def claim_takeover(self, replica_id: str, owner: str, ttl_s: float) -> bool:
        now = time.monotonic()
        until, holder = self._takeovers.get(replica_id, (0.0, ""))
        if until > now and holder != owner:
            return False
        self._takeovers[replica_id] = (now + ttl_s, owner)
        return True


class RedisRegistry(ReplicaRegistry):
    """One key per replica with a TTL (expiry is Redis's job, on Redis's clock), plus a set of
    ids so listing needs no SCAN; ids whose key expired are pruned from the set when seen."""

    def __init__(self, url: str, *, prefix: str = "fairway:", ttl_s: float = DEFAULT_TTL_S) -> None:
        from fairway.redis_client import RedisClient

        self.ttl_s = ttl_s
        self._prefix = prefix
        self._r = RedisClient(url)

    def _key(self, replica_id: str) -> str:
        return f"{self._prefix}replica:{replica_id}"

    @property
    def _set(self) -> str:
        return f"{self._prefix}replicas"

    @property
    def _known(self) -> str:
        return f"{self._prefix}replicas:known"

    async def announce(self, info: ReplicaInfo) -> None:
        _raise_errors(await self._r.batch([["SET", self._key(info.id), info.to_json(), "PX", int(self.ttl_s * 1000)],
                                           ["SADD", self._set, info.id], ["SADD", self._known, info.id]]))

    async def withdraw(self, replica_id: str) -> None:
        _raise_errors(await self._r.batch([["DEL", self._key(replica_id)], ["SREM", self._set, replica_id]]))

    async def live(self) -> list[ReplicaInfo]:
        ids = sorted(await self._r.execute("SMEMBERS", self._set))
        if not ids:
            return []
        asked = time.monotonic()
        # GETs, not one MGET: on a Redis Cluster the replicas' keys live in different slots. Each
        # with its PTTL, so a router's cached view can drop a replica the moment its key expires.
        results = await self._r.batch([cmd for i in ids for cmd in (["GET", self._key(i)], ["PTTL", self._key(i)])])
        _raise_errors(results)
        raws, ttls = results[0::2], results[1::2]
        gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            await self._r.execute("SREM", self._set, *gone)
        live = []
        for replica_id, raw, ttl_ms in zip(ids, raws, ttls, strict=True):
            if raw is None or int(ttl_ms) <= 0:
                continue
            try:
                info = ReplicaInfo.from_json(raw)
            except (TypeError, ValueError) as exc:  # one malformed announcement must not hide the others
                log.warning("ignoring replica %s's malformed announcement: %s", replica_id, exc)
                continue
            info.expires_at = asked + int(ttl_ms) / 1000
            live.append(info)
        return live

    async def gone(self) -> list[str]:
        ids = sorted(await self._r.execute("SMEMBERS", self._known))
        if not ids:
            return []
        exists = await self._r.batch([["EXISTS", self._key(i)] for i in ids])
        _raise_errors(exists)
        return [i for i, alive in zip(ids, exists, strict=True) if not alive]

    async def forget(self, replica_id: str) -> None:
        await self._r.execute("SREM", self._known, replica_id)

    async def claim_takeover(self, replica_id: str, owner: str, ttl_s: float) -> bool:
        key = f"{self._prefix}takeover:{replica_id}"
        if await self._r.execute("SET", key, owner, "NX", "PX", int(ttl_s * 1000)):
            return True
        return await self._r.execute("GET", key) == owner

    async def close(self) -> None:
        await self._r.close()


def _raise_errors(results: list[Any]) -> None:
    for result in results:
        if isinstance(result, Exception):
            raise result


def make_registry(url: str | None = None, **options: Any) -> ReplicaRegistry:
    """None or "memory://" -> in process (embedded server); a redis:// URL -> shared by processes."""
    if url is None or url in ("", "memory://"):
        return InProcessRegistry(**{k: v for k, v in options.items() if k == "ttl_s"})
    return RedisRegistry(url, **options)
