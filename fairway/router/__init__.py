"""Router: which replica serves a reply. For now any live replica of the model, least loaded
first; prefix affinity, overflow and failover come with the router issue. It reads the replica
registry (fairway.replica.registry), which the replicas write."""

from fairway.router.router import NoReplica, Router

__all__ = ["NoReplica", "Router"]
