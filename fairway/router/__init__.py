"""Router: which replica serves a reply, and failover: the replies of a replica that died or
drains carry on elsewhere (failover.py). Candidates are the live replicas of the model in the
requested region; the one with the most of the prompt's prefix cached wins unless it is
overloaded next to the least loaded (policy.py). It reads the replica registry
(fairway.replica.registry), which the replicas write every heartbeat."""

from fairway.router.failover import Failover, FailoverSettings
from fairway.router.policy import ROUTINGS, Choice, RouterSettings
from fairway.router.router import RETRY_AFTER_S, NoReplica, Router, region_fallback

__all__ = ["RETRY_AFTER_S", "ROUTINGS", "Choice", "Failover", "FailoverSettings", "NoReplica", "Router",
           "RouterSettings", "region_fallback"]
