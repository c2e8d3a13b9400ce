"""Router: which replica serves a reply (router.py), and failover: the replies of a replica that
died or drains carry on elsewhere (failover.py). It reads the replica registry
(fairway.replica.registry), which the replicas write."""

from fairway.router.failover import Failover, FailoverSettings
from fairway.router.router import NoReplica, Router

__all__ = ["Failover", "FailoverSettings", "NoReplica", "Router"]
