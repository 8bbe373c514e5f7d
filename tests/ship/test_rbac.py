"""The chart's RBAC is exactly what the operator uses: every call it makes is allowed for its
ServiceAccount, nothing else is, and the operator itself runs against the real API server with a
token of that ServiceAccount."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from lorajob_devcluster.process import free_loopback_port
from shipkit import FULLNAME, RELEASE_NAMESPACE, REPO, SERVICE_ACCOUNT

pytestmark = pytest.mark.apiserver

NAMESPACE = "ship-rbac"

# (verb, resource.group): every API call in operator/lorajob_operator/kube.py and handlers.py, and
# the list+watch behind each kopf watch. Namespaced ones are checked in a team namespace.
OPERATOR_CALLS = [
    ("get", "lorajobs.lorajob.dev"),  # Cluster.get before each reconcile pass
    ("list", "lorajobs.lorajob.dev"),  # kopf watch; Resync lists all
    ("watch", "lorajobs.lorajob.dev"),  # kopf watch
    ("delete", "lorajobs.lorajob.dev"),  # ttlSecondsAfterFinished
    ("patch", "lorajobs.lorajob.dev/status"),  # status written as a whole
    ("get", "jobsets.jobset.x-k8s.io"),  # the child of each phase
    ("list", "jobsets.jobset.x-k8s.io"),  # kopf watch on children
    ("watch", "jobsets.jobset.x-k8s.io"),
    ("create", "jobsets.jobset.x-k8s.io"),  # one per phase (and per retry)
    ("delete", "jobsets.jobset.x-k8s.io"),  # suspend, retry
    ("list", "workloads.kueue.x-k8s.io"),  # Kueue's Workload of a JobSet, by job-uid label
    ("get", "localqueues.kueue.x-k8s.io"),  # does spec.scheduling.queueName exist
    ("list", "pods"),  # the failed container of a failed step
    ("get", "secrets"),  # does the HF token Secret (and key) exist
    ("create", "events"),  # one per phase transition
]
CLUSTER_CALLS = [
    ("get", "lorajobpolicies.lorajob.dev"),  # reconcile-time policy checks (policy.py)
    ("list", "lorajobpolicies.lorajob.dev"),
    ("watch", "lorajobpolicies.lorajob.dev"),
    ("get", "namespaces"),  # a namespace's labels, which policies select on
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),  # kopf notices CRDs installed later
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
]
NOT_ALLOWED = [
    ("update", "lorajobs.lorajob.dev"),  # the operator never writes spec (Git stays the truth)
    ("patch", "lorajobs.lorajob.dev"),
    ("create", "lorajobs.lorajob.dev"),
    ("update", "lorajobs.lorajob.dev/status"),
    ("patch", "jobsets.jobset.x-k8s.io"),  # never fights Kueue over a created JobSet
    ("update", "jobsets.jobset.x-k8s.io"),
    ("patch", "workloads.kueue.x-k8s.io"),
    ("list", "secrets"),  # no reading of other Secrets in bulk
    ("watch", "secrets"),
    ("create", "pods"),
    ("delete", "pods"),
    ("get", "configmaps"),
    ("create", "localqueues.kueue.x-k8s.io"),
    ("list", "namespaces"),
    ("create", "lorajobpolicies.lorajob.dev"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("impersonate", "serviceaccounts"),
]


def can_i(kube, verb: str, resource: str, namespace: str | None) -> bool:
    scope = ["-n", namespace] if namespace else []
    result = kube.kubectl("auth", "can-i", verb, resource, f"--as={SERVICE_ACCOUNT}", *scope, check=False)
    answer = result.stdout.strip()
    assert answer in ("yes", "no"), result.stderr
    return answer == "yes"


@pytest.fixture(scope="module")
def team_namespace(kube, installed_release):
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    return NAMESPACE


@pytest.mark.parametrize("verb, resource", OPERATOR_CALLS, ids=lambda v: str(v))
def test_operator_calls_are_allowed_in_team_namespaces(kube, team_namespace, verb, resource):
    assert can_i(kube, verb, resource, team_namespace)


@pytest.mark.parametrize("verb, resource", CLUSTER_CALLS, ids=lambda v: str(v))
def test_cluster_scoped_calls_are_allowed(kube, installed_release, verb, resource):
    assert can_i(kube, verb, resource, None)


@pytest.mark.parametrize("verb, resource", NOT_ALLOWED, ids=lambda v: str(v))
def test_nothing_else_is_allowed(kube, team_namespace, verb, resource):
    assert not can_i(kube, verb, resource, team_namespace)


def _granted(kube) -> set[tuple[str, str]]:
    granted = set()
    for role in (f"{FULLNAME}-namespaced", f"{FULLNAME}-cluster"):
        rules = json.loads(kube.kubectl("get", "clusterrole", role, "-o", "json").stdout)["rules"]
        for rule in rules:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    base, _, sub = resource.partition("/")
                    name = f"{base}.{group}" if group else base
                    for verb in rule["verbs"]:
                        granted.add((verb, f"{name}/{sub}" if sub else name))
    return granted


def test_the_roles_grant_exactly_the_operator_calls(kube, installed_release):
    assert _granted(kube) == set(OPERATOR_CALLS) | set(CLUSTER_CALLS)


# --- The operator itself, with the ServiceAccount's identity ------------------------------------------


def _service_account_kubeconfig(kube, path: Path) -> Path:
    token = kube.kubectl("create", "token", FULLNAME, "-n", RELEASE_NAMESPACE, "--duration=1h").stdout.strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "dev", "cluster": {"server": kube.server, "certificate-authority": str(kube.pki.ca.cert)}}],
        "users": [{"name": "operator", "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "dev", "user": "operator"}}],
        "current-context": "operator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture
def operator_as_service_account(kube, team_namespace, tmp_path):
    kubeconfig = _service_account_kubeconfig(kube, tmp_path / "kubeconfig")
    assert kube.kubectl("auth", "whoami", f"--kubeconfig={kubeconfig}", "-o", "json").returncode == 0
    port = free_loopback_port()
    log = tmp_path / "operator.log"
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "LORAJOB_RECONCILE_RESYNC_SECONDS": "2"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "lorajob_operator", f"--liveness=http://127.0.0.1:{port}/healthz", "-n", team_namespace],
            cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
        )
    try:
        yield process, port, log
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_operator_works_with_only_the_charts_permissions(kube, operator_as_service_account):
    process, port, log = operator_as_service_account
    job = yaml.safe_load((REPO / "examples" / "qwen3-gsm8k.yaml").read_text())
    job["metadata"] = {"name": "rbac-probe", "namespace": NAMESPACE}
    kube.kubectl("apply", "-f", "-", input=json.dumps(job))
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, f"the operator exited:\n{log.read_text()[-4000:]}"
            stored = json.loads(kube.kubectl("get", "lorajob", "rbac-probe", "-n", NAMESPACE, "-o", "json").stdout)
            status = stored.get("status") or {}
            if status.get("observedGeneration") == stored["metadata"]["generation"] and status.get("phase"):
                break
            assert time.monotonic() < deadline, f"no status from the operator:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        assert _healthy(port), "the liveness endpoint the chart probes is not answering"
        events = json.loads(kube.kubectl("get", "events", "-n", NAMESPACE, "-o", "json").stdout)["items"]
        assert any(e["involvedObject"]["name"] == "rbac-probe" for e in events), "no event was posted"
        text = log.read_text()
        assert "Forbidden" not in text and " 403" not in text, text[-4000:]
    finally:
        kube.kubectl("delete", "lorajob", "rbac-probe", "-n", NAMESPACE, "--wait=false", check=False)
