"""The Kubernetes backend with the official client against a loopback fake API server (kmock):
what it sends (method, path, content type, body) and how it takes 404, 409 and 422, a watch of
the Deployment's readiness, and a fleet manager that keeps the fleet as it is while the API is
away or refuses."""

from __future__ import annotations

import asyncio
import json

import kmock
import kubernetes
import pytest

from fairway.fleet import (
    BackendError,
    BackendUnavailable,
    FleetManager,
    ScalingBounds,
    ScalingPolicy,
    ScalingTarget,
)
from fairway.fleet.k8s import KubernetesBackend
from fairway.replica.registry import InProcessRegistry, ReplicaInfo
from fairway.usage import metrics

pytestmark = pytest.mark.kmock(cls=kmock.RawHandler)  # plain answers, as each test sets them
NS, NAME = "serving", "fairway-replica"
SCALE = f"/apis/apps/v1/namespaces/{NS}/deployments/{NAME}/scale"
PATCH_TYPE = "application/strategic-merge-patch+json"


def scale(replicas: int, version: str) -> dict:
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": NAME, "namespace": NS, "resourceVersion": version},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas}}


def status(code: int, reason: str, message: str) -> dict:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def backend_for(url) -> KubernetesBackend:
    configuration = kubernetes.client.Configuration()
    configuration.host = str(url).rstrip("/")
    return KubernetesBackend(NAME, NS, kubernetes.client.ApiClient(configuration))


def sent(request) -> tuple[str, str, str | None, object]:
    return (str(request.method.value).upper(), request.url.path, request.headers.get("Content-Type"),
            json.loads(request.body) if request.body else None)


async def test_adding_reads_the_scale_and_patches_it_with_the_version_read(kmock):
    kmock[f"get {SCALE}"] << scale(2, "41")
    kmock[f"patch {SCALE}"] << scale(3, "42")
    backend = backend_for(kmock.url)
    assert (await backend.state()).desired == 2
    await backend.add(1)
    assert [sent(r) for r in kmock["patch"]] == [
        ("PATCH", SCALE, PATCH_TYPE, {"metadata": {"resourceVersion": "41"}, "spec": {"replicas": 3}})]
    assert [sent(r)[:2] for r in kmock["get"]] == [("GET", SCALE)] * 2


async def test_a_conflict_reads_the_scale_again_and_patches_the_new_one(kmock):
    """Someone scaled meanwhile (409 on the version read): the backend adds to their count."""
    reads = iter([scale(2, "41"), scale(4, "43")])
    patches = iter([(409, status(409, "Conflict", "the object has been modified")), (200, scale(5, "44"))])
    kmock[f"get {SCALE}"] << (lambda: next(reads))
    kmock[f"patch {SCALE}"] << (lambda: answer(*next(patches)))
    await backend_for(kmock.url).add(1)
    bodies = [sent(r)[3] for r in kmock["patch"]]
    assert bodies == [{"metadata": {"resourceVersion": "41"}, "spec": {"replicas": 3}},
                      {"metadata": {"resourceVersion": "43"}, "spec": {"replicas": 5}}]


def answer(code: int, body: dict) -> kmock.Response:
    return kmock.Response(status=code, payload=body)


async def test_a_missing_deployment_is_a_clear_error(kmock):
    kmock[f"get {SCALE}"] << 404 << status(404, "NotFound", f'deployments.apps "{NAME}" not found')
    with pytest.raises(BackendError, match=f"Deployment {NS}/{NAME}: not found .*apply deploy/k8s/"):
        await backend_for(kmock.url).state()


async def test_a_refused_scale_says_what_the_api_said(kmock):
    kmock[f"get {SCALE}"] << scale(2, "41")
    kmock[f"patch {SCALE}"] << 422 << status(422, "Invalid", "spec.replicas: Invalid value: 99: exceeds quota")
    with pytest.raises(BackendError, match="refused the change .*exceeds quota"):
        await backend_for(kmock.url).add(97)


async def test_a_drain_marks_the_least_loaded_pod_then_scales_down(kmock):
    pod = f"/api/v1/namespaces/{NS}/pods/{NAME}-abc12"
    kmock[f"patch {pod}"] << {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{NAME}-abc12"}}
    kmock[f"get {SCALE}"] << scale(3, "50")
    kmock[f"patch {SCALE}"] << scale(2, "51")
    await backend_for(kmock.url).drain(f"{NAME}-abc12")
    assert [sent(r) for r in kmock["patch"]] == [
        ("PATCH", pod, PATCH_TYPE, {"metadata": {"annotations": {"controller.kubernetes.io/pod-deletion-cost": "-1000"}}}),
        ("PATCH", SCALE, PATCH_TYPE, {"metadata": {"resourceVersion": "50"}, "spec": {"replicas": 2}})]


async def test_a_drain_of_a_pod_already_gone_still_scales_down(kmock):
    kmock[f"patch /api/v1/namespaces/{NS}/pods/gone"] << 404 << status(404, "NotFound", 'pods "gone" not found')
    kmock[f"get {SCALE}"] << scale(3, "50")
    kmock[f"patch {SCALE}"] << scale(2, "51")
    await backend_for(kmock.url).drain("gone")
    assert sent(kmock["patch"][-1])[3] == {"metadata": {"resourceVersion": "50"}, "spec": {"replicas": 2}}


async def test_readiness_comes_from_a_watch_of_the_deployment(kmock):
    kmock[f"get /apis/apps/v1/namespaces/{NS}/deployments"] << (deployment_event(1), deployment_event(2))
    kmock[f"get {SCALE}"] << scale(3, "9")
    backend = backend_for(kmock.url)
    await backend.start()
    try:
        for _ in range(100):
            state = await backend.state()
            if state.ready == 2:
                break
            await asyncio.sleep(0.05)
        assert state.desired == 3 and state.ready == 2
        # the watch thread's GET and state()'s scale read race: find the watch by its path
        watches = [r for r in kmock["get"] if r.url.path == f"/apis/apps/v1/namespaces/{NS}/deployments"]
        assert watches, [r.url.path for r in kmock["get"]]
        watch = watches[0]
        assert watch.params["watch"] in ("true", "True") and watch.params["fieldSelector"] == f"metadata.name={NAME}"
    finally:
        await backend.close()


def announce(registry: InProcessRegistry, replica_id: str, arrived: int) -> asyncio.Future:
    return asyncio.ensure_future(registry.announce(ReplicaInfo(replica_id, "m", f"q:{replica_id}", 1024, 1024,
                                                               arrived=arrived)))


async def test_the_fleet_holds_while_the_api_is_away_or_refuses(kmock):
    """A fleet of two with arrivals far above what they serve: no scale while the API refuses
    (404) or does not answer at all; the log and fairway:fleet_holding{source="backend"} say so."""
    registry = InProcessRegistry()
    policy = ScalingPolicy(ScalingBounds(1, 10, step=4, cooldown_s=0, idle_s=0), ScalingTarget(replica_rps=0.1))
    kmock[f"get {SCALE}"] << 404 << status(404, "NotFound", "gone")
    manager = FleetManager(backend_for(kmock.url), registry, policy)
    for n in range(3):
        await announce(registry, "a", 100 * n)
        await announce(registry, "b", 100 * n)
        assert await manager.tick() is None
    assert "not found" in manager.holding["backend"]
    assert metrics.FLEET_HOLDING.labels("backend")._value.get() == 1
    assert not kmock["patch"]  # nothing scaled

    away = FleetManager(backend_for("http://127.0.0.1:9"), registry, policy)  # nothing listens there
    assert await away.tick() is None
    assert "does not answer" in away.holding["backend"]
    with pytest.raises(BackendUnavailable):
        await backend_for("http://127.0.0.1:9").state()


def deployment_event(ready: int) -> dict:
    return {"type": "MODIFIED", "object": {"apiVersion": "apps/v1", "kind": "Deployment",
                                           "metadata": {"name": NAME, "namespace": NS, "resourceVersion": "9"},
                                           "spec": {"replicas": 3, "selector": {"matchLabels": {"app": NAME}},
                                                    "template": {"metadata": {"labels": {"app": NAME}}}},
                                           "status": {"readyReplicas": ready}}}


async def test_the_fleet_never_scales_down_on_missing_heartbeats(kmock):
    """Redis away, or reachable with no replica announcing while the Deployment has three ready:
    missing data, not an idle fleet. With idle_s 0 an idle fleet would drain at once; this one
    patches nothing and says why."""
    kmock[f"get /apis/apps/v1/namespaces/{NS}/deployments"] << (deployment_event(3),)
    kmock[f"get {SCALE}"] << scale(3, "9")
    policy = ScalingPolicy(ScalingBounds(1, 10, cooldown_s=0, idle_s=0), ScalingTarget(replica_rps=1.0))
    backend = backend_for(kmock.url)
    await backend.start()
    try:
        for _ in range(100):
            if (await backend.state()).ready == 3:
                break
            await asyncio.sleep(0.05)
        silent = FleetManager(backend, InProcessRegistry(), policy)
        for _ in range(3):
            assert await silent.tick() is None
        assert silent.holding == {"registry": "no replica announces itself while 3 are ready"}
        assert metrics.FLEET_HOLDING.labels("registry")._value.get() == 1

        from fairway.replica.registry import RedisRegistry

        gone = RedisRegistry("redis://127.0.0.1:9/0")  # nothing listens there
        try:
            away = FleetManager(backend, gone, policy)
            assert await away.tick() is None
            assert away.holding["registry"].startswith("the replica registry does not answer")
        finally:
            await gone.close()
        assert not kmock["patch"]
    finally:
        await backend.close()
