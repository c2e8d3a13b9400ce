"""The replica registry: each replica announces itself (model, window, load) every heartbeat;
an announcement expires after ttl_s, so a replica that stops heartbeating drops out of routing
without anyone having to notice it died.

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
    sandbox_off: str = "this replica has no sandbox"  # why execute_code is off here; "": it runs
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

    async def close(self) -> None:  # noqa: B027  (optional hook: only Redis has connections)
        """Release connections; the in-process registry has none."""


class InProcessRegistry(ReplicaRegistry):
    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._replicas: dict[str, tuple[float, ReplicaInfo]] = {}

    async def announce(self, info: ReplicaInfo) -> None:
        self._replicas[info.id] = (time.monotonic() + self.ttl_s, info)

    async def withdraw(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def live(self) -> list[ReplicaInfo]:
        now = time.monotonic()
        return [info for deadline, info in self._replicas.values() if deadline > now]


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

    async def announce(self, info: ReplicaInfo) -> None:
        _raise_errors(await self._r.batch([["SET", self._key(info.id), info.to_json(), "PX", int(self.ttl_s * 1000)],
                                           ["SADD", self._set, info.id]]))

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
