"""The replica registry: each replica announces itself (model, window, load) every heartbeat;
an announcement expires after ttl_s, so a replica that stops heartbeating drops out of routing
without anyone having to notice it died. The registry also remembers every replica that ever
announced until a failover has handed on what its queue held (gone(), forget()), and lets one
process at a time take a gone replica's work over (claim_takeover).

The replica writes it and the router reads it, so it lives with the replica (the lower part).
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_TTL_S = 3.0  # a few missed heartbeats (1 s apart) and the replica is out


@dataclass
class ReplicaInfo:
    id: str
    model: str
    queue: str  # the bus queue it claims jobs from
    max_model_len: int  # context window: prompt and reply together
    max_prompt_tokens: int  # the longest prompt its KV cache could ever admit
    load: int = 0  # replies in flight
    capacity: int = 0  # replies it runs at once
    draining: bool = False  # leaving (SIGTERM): place nothing more here
    started_at: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> ReplicaInfo:
        data: dict[str, Any] = json.loads(raw)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


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
        """Replicas whose last announcement has not expired."""

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
        return [info for deadline, info in self._replicas.values() if deadline > now]

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
        # GETs, not one MGET: on a Redis Cluster the replicas' keys live in different slots.
        raws = await self._r.batch([["GET", self._key(i)] for i in ids])
        _raise_errors(raws)
        gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            await self._r.execute("SREM", self._set, *gone)
        return [ReplicaInfo.from_json(raw) for raw in raws if raw is not None]

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
