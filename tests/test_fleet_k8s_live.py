"""Opt-in: the Kubernetes backend against a real cluster. Runs only with `-m k8s_live` and a
KUBECONFIG (FAIRWAY_K8S_NAMESPACE, default "default", is where its Deployment of pause
containers lives for the test): read the scale, add one, watch it become ready, drain one."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

pytestmark = pytest.mark.k8s_live


@pytest.fixture
def live(request):
    if "k8s_live" not in (request.config.option.markexpr or "") or not os.environ.get("KUBECONFIG"):
        pytest.skip("opt-in: run with -m k8s_live and KUBECONFIG set")
    kubernetes = pytest.importorskip("kubernetes")
    from fairway.fleet.k8s import api_client

    client = api_client(os.environ["KUBECONFIG"])
    namespace = os.environ.get("FAIRWAY_K8S_NAMESPACE", "default")
    name = f"fairway-fleet-test-{uuid.uuid4().hex[:6]}"
    apps = kubernetes.client.AppsV1Api(client)
    labels = {"app": name}
    apps.create_namespaced_deployment(namespace, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels}, "spec": {"containers": [
                     {"name": "pause", "image": "registry.k8s.io/pause:3.10",
                      "resources": {"requests": {"cpu": "1m", "memory": "8Mi"}}}]}}}})
    yield client, namespace, name
    apps.delete_namespaced_deployment(name, namespace)


async def test_scale_up_watch_ready_and_drain_on_a_real_cluster(live):
    from fairway.fleet.k8s import KubernetesBackend

    client, namespace, name = live
    backend = KubernetesBackend(name, namespace, client)
    await backend.start()
    try:
        assert (await backend.state()).desired == 1
        await backend.add(1)
        for _ in range(240):
            state = await backend.state()
            if state.ready == 2:
                break
            await asyncio.sleep(0.5)
        assert state == type(state)(desired=2, ready=2)
        await backend.drain(None)
        assert (await backend.state()).desired == 1
    finally:
        await backend.close()
