"""Where replicas run, behind one small interface: LocalBackend (processes on this machine,
local.py) and KubernetesBackend (a replica Deployment, k8s.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class BackendUnavailable(Exception):
    """The backend does not answer (the Kubernetes API is away): the fleet stays as it is."""


class BackendError(Exception):
    """The backend answered no (a Deployment that does not exist, a scale it refuses); the
    message says what. The fleet stays as it is, and says so."""


@dataclass(frozen=True)
class BackendState:
    desired: int  # replicas that are, or will be, serving (starting ones count; leaving ones do not)
    ready: int  # of them, ready (their /ready answers 200)


class Backend(ABC):
    name: str

    async def start(self) -> None:  # noqa: B027  (optional: a watch to start)
        """Start whatever the backend watches in the background."""

    @abstractmethod
    async def state(self) -> BackendState:
        """The replicas now; raises BackendUnavailable or BackendError."""

    @abstractmethod
    async def add(self, n: int) -> None:
        """Start n more replicas."""

    @abstractmethod
    async def drain(self, replica_id: str | None) -> None:
        """Take one replica away through its graceful drain (SIGTERM, or Kubernetes' preStop):
        replica_id is the one to prefer (the least loaded), None when there is no choice."""

    async def close(self) -> None:  # noqa: B027
        """Stop watching; a local backend's replicas are left running unless stop() is called."""
