"""deploy/k8s/ validated as CI does: `kubernetes-validate --strict` against a pinned Kubernetes
(unknown fields are errors), and what the fleet relies on checked in the manifests themselves:
the replica's GPU, readiness on /ready, the drain before SIGTERM with the grace to finish it,
spot tolerations, and a fleet Role that allows exactly what its backend calls."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate  # noqa: F401  (the test extra's: a missing one fails here, never skips)
import yaml

KUBERNETES_VERSION = "1.33.0"  # the pinned version the manifests must validate against
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
VALIDATE = [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-k", KUBERNETES_VERSION]


def manifests() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


def test_every_manifest_validates_strictly():
    out = subprocess.run([*VALIDATE, *map(str, sorted(DEPLOY.glob("*.yaml")))], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_strict_validation_rejects_an_unknown_field(tmp_path):
    """The check above can fail: a misspelt field (a probe's `perodSeconds`) is an error."""
    broken = tmp_path / "replica.yaml"
    shutil.copy(DEPLOY / "replica.yaml", broken)
    broken.write_text(broken.read_text().replace("periodSeconds: 2", "perodSeconds: 2", 1))
    out = subprocess.run([*VALIDATE, str(broken)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "perodSeconds" in out.stdout + out.stderr


def test_the_replica_drains_before_it_is_stopped():
    replica = manifests()[("Deployment", "fairway-replica")]["spec"]["template"]["spec"]
    container = replica["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "/drain" in container["lifecycle"]["preStop"]["exec"]["command"][-1]
    grace = float(container["args"][container["args"].index("--drain-grace") + 1])
    assert replica["terminationGracePeriodSeconds"] >= grace + 10  # the drain, then the hand-off
    assert {t["key"] for t in replica["tolerations"]} >= {"cloud.google.com/gke-spot",
                                                          "kubernetes.azure.com/scalesetpriority"}
    assert "$(POD_NAME)" in container["args"]  # the replica id is the pod's name (the deletion cost)


def test_the_fleet_may_do_what_its_backend_calls_and_no_more():
    found = manifests()
    role = found[("Role", "fairway-fleet")]
    allowed = {(rule["apiGroups"][0], resource, verb) for rule in role["rules"] for resource in rule["resources"]
               for verb in rule["verbs"]}
    calls = {("apps", "deployments/scale", "get"), ("apps", "deployments/scale", "patch"),
             ("apps", "deployments", "list"), ("apps", "deployments", "watch"), ("", "pods", "patch")}
    assert calls <= allowed
    assert not {verb for _, _, verb in allowed} & {"create", "delete", "deletecollection", "*"}
    fleet = found[("Deployment", "fairway-fleet")]["spec"]
    assert fleet["replicas"] == 1 and fleet["template"]["spec"]["serviceAccountName"] == "fairway-fleet"
    args = fleet["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--deployment") + 1] == "fairway-replica"
