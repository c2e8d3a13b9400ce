"""KubernetesBackend: the replicas are a Deployment (deploy/k8s/replica.yaml), scaled through the
official client: read its scale subresource, patch it (with the resourceVersion read, so a scale
someone else made meanwhile is a 409 and is read again, not overwritten), and watch the
Deployment for its ready replicas. A drain scales down by one after marking the least loaded pod
as the one to delete (controller.kubernetes.io/pod-deletion-cost); Kubernetes then sends it
SIGTERM, its preStop waits for the replica's drain. A spot node reclaimed takes its pod away and
the Deployment's controller starts another at once: the scale stays, nothing to replace here.

The client is synchronous: each call runs in a thread, the watch in a daemon thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fairway.fleet.backend import Backend, BackendError, BackendState, BackendUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
REQUEST_TIMEOUT_S = 5.0
CONFLICT_RETRIES = 3


def api_client(kubeconfig: str | None = None) -> Any:
    """The ServiceAccount's credentials inside a cluster, else the kubeconfig (KUBECONFIG or
    ~/.kube/config, or the file given)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            raise config.ConfigException("a kubeconfig was given")
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return client.ApiClient(configuration)


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self, deployment: str, namespace: str = "default", client: Any = None) -> None:
        from kubernetes import client as k8s

        self.deployment = deployment
        self.namespace = namespace
        self._client = client if client is not None else api_client()
        self._apps = k8s.AppsV1Api(self._client)
        self._core = k8s.CoreV1Api(self._client)
        self._ready: int | None = None  # from the watch
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def _where(self) -> str:
        return f"Deployment {self.namespace}/{self.deployment}"

    async def start(self) -> None:
        self._watcher = threading.Thread(target=self._watch, name="fleet-k8s-watch", daemon=True)
        self._watcher.start()

    async def state(self) -> BackendState:
        scale = await self._call(self._apps.read_namespaced_deployment_scale, self.deployment, self.namespace)
        return BackendState(desired=scale.spec.replicas or 0, ready=self._ready or 0)

    async def add(self, n: int) -> None:
        await self._rescale(n)

    async def drain(self, replica_id: str | None) -> None:
        if replica_id is not None:  # the pod's name is its replica id (deploy/k8s/replica.yaml)
            try:
                await self._call(self._core.patch_namespaced_pod, replica_id, self.namespace,
                                 {"metadata": {"annotations": {DELETION_COST: "-1000"}}})
            except BackendError as exc:  # gone already, or not ours to mark: Kubernetes picks one
                log.warning("could not mark pod %s to go first (%s); scaling down anyway", replica_id, exc)
        await self._rescale(-1)

    async def close(self) -> None:
        self._stopping.set()

    async def _rescale(self, by: int) -> None:
        """desired + by, read and patched with the version read; a 409 (changed meanwhile) reads again."""
        for _ in range(CONFLICT_RETRIES):
            scale = await self._call(self._apps.read_namespaced_deployment_scale, self.deployment, self.namespace)
            replicas = max(0, (scale.spec.replicas or 0) + by)
            body = {"metadata": {"resourceVersion": scale.metadata.resource_version}, "spec": {"replicas": replicas}}
            try:
                await self._call(self._apps.patch_namespaced_deployment_scale, self.deployment, self.namespace, body)
                log.info("%s scaled to %d", self._where, replicas)
                return
            except _Conflict:
                log.info("%s changed while scaling it; reading it again", self._where)
        raise BackendError(f"{self._where} kept changing while the fleet scaled it ({CONFLICT_RETRIES} conflicts)")

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(_checked, method, self._where, *args)

    def _watch(self) -> None:
        """The Deployment's ready replicas as the API reports them, until close()."""
        from kubernetes import watch

        while not self._stopping.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(self._apps.list_namespaced_deployment, self.namespace,
                                           field_selector=f"metadata.name={self.deployment}", timeout_seconds=30):
                    status = event["object"].status
                    self._ready = (status.ready_replicas or 0) if status is not None else 0
                    if self._stopping.is_set():
                        break
            except Exception as exc:  # the API away for a while: watch again shortly
                log.warning("watching %s failed (%s); again in 2 s", self._where, exc)
                self._ready = None
                self._stopping.wait(2.0)
            finally:
                stream.stop()
            if not self._stopping.is_set():
                time.sleep(0.1)


class _Conflict(BackendError):
    pass


def _checked(method: Callable[..., T], where: str, *args: Any) -> T:
    """method(*args) with the API's answers as the backend's errors."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return method(*args, _request_timeout=REQUEST_TIMEOUT_S)
    except ApiException as exc:
        detail = _message(exc)
        if exc.status == 404:
            raise BackendError(f"{where}: not found ({detail}); apply deploy/k8s/ or name the right one "
                               "(--deployment, --k8s-namespace)") from None
        if exc.status == 409:
            raise _Conflict(f"{where}: conflict ({detail})") from None
        if exc.status == 422:
            raise BackendError(f"{where}: the API refused the change ({detail})") from None
        if exc.status in (401, 403):
            raise BackendError(f"{where}: not allowed ({detail}); the fleet manager's ServiceAccount needs the "
                               "Role in deploy/k8s/fleet.yaml") from None
        raise BackendUnavailable(f"{where}: the API answered {exc.status} ({detail})") from None
    except (HTTPError, OSError) as exc:
        raise BackendUnavailable(f"{where}: the Kubernetes API does not answer ({exc.__class__.__name__})") from None


def _message(exc: Any) -> str:
    import json

    try:
        return json.loads(exc.body).get("message") or exc.reason
    except (TypeError, ValueError, AttributeError):
        return str(exc.reason)
