"""Router: which replica serves a reply. For now any live replica of the model, least loaded
first; prefix affinity, overflow and failover come with the router issue."""

from fairway.router.registry import (
    InProcessRegistry,
    RedisRegistry,
    ReplicaInfo,
    ReplicaRegistry,
    make_registry,
)
from fairway.router.router import NoReplica, Router

__all__ = [
    "InProcessRegistry",
    "NoReplica",
    "RedisRegistry",
    "ReplicaInfo",
    "ReplicaRegistry",
    "Router",
    "make_registry",
]
