"""The chart's RBAC is exactly what the operator uses: every call it makes is allowed for its
ServiceAccount, nothing else is, and the operator itself runs against the real API server with a
token of that ServiceAccount, started with the arguments of the chart's Deployment.

The release is switched to `operator.watchNamespaces: [ship-rbac]` for this module, so the checks
also cover the per-namespace bindings (allowed in the watched namespace, denied in any other);
test_helm.py covers the cluster-wide rendering. The fine-tuning API server (`api.enabled`, serving
ship-rbac) is on too: its ServiceAccount gets exactly the server's calls, in the served namespace only."""

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
from shipkit import (
    API_FULLNAME, API_SERVICE_ACCOUNT, CHART, FULLNAME, RELEASE, RELEASE_NAMESPACE, REPO, SERVICE_ACCOUNT, api_values,
    set_args,
)

pytestmark = pytest.mark.apiserver

NAMESPACE = "ship-rbac"
OTHER_NAMESPACE = "ship-rbac-unwatched"

# (verb, resource[.group][/subresource]): every API call in operator/lorajob_operator/controller/, and the
# list+watch behind each cache that kopf's watches fill (watches.py).
OPERATOR_CALLS = [
    ("list", "lorajobs.lorajob.dev"),  # cache
    ("watch", "lorajobs.lorajob.dev"),
    ("delete", "lorajobs.lorajob.dev"),  # ttlSecondsAfterFinished
    ("patch", "lorajobs.lorajob.dev"),  # the Argo CD links to the tracker runs (metadata.annotations only)
    ("patch", "lorajobs.lorajob.dev/status"),  # status written as a whole
    ("get", "jobsets.jobset.x-k8s.io"),  # who holds a step's name when creating it conflicts (409)
    ("list", "jobsets.jobset.x-k8s.io"),  # cache
    ("watch", "jobsets.jobset.x-k8s.io"),
    ("create", "jobsets.jobset.x-k8s.io"),  # one per phase (and per retry)
    ("delete", "jobsets.jobset.x-k8s.io"),  # suspend, retry
    ("list", "workloads.kueue.x-k8s.io"),  # cache: Kueue's Workload of each JobSet
    ("watch", "workloads.kueue.x-k8s.io"),
    ("list", "localqueues.kueue.x-k8s.io"),  # cache: does spec.scheduling.queueName exist
    ("watch", "localqueues.kueue.x-k8s.io"),
    ("get", "localqueues.visibility.kueue.x-k8s.io/pendingworkloads"),  # Kueue's queue positions
    ("list", "pods"),  # the failed container of a failed step; the train step's lead pod
    ("get", "pods/log"),  # the lead trainer's progress lines
    ("create", "events"),  # one per phase transition
]
CLUSTER_CALLS = [
    ("list", "lorajobpolicies.lorajob.dev"),  # cache: reconcile-time policy checks (policy.py)
    ("watch", "lorajobpolicies.lorajob.dev"),
    ("list", "namespaces"),  # cache: a namespace's labels, which policies select on
    ("watch", "namespaces"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),  # kopf watches CRDs (which resources exist)
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
]
LEASE_CALLS = [
    ("get", "leases.coordination.k8s.io"),  # leader election, in the release's namespace only (leader.py)
    ("update", "leases.coordination.k8s.io"),  # renew, take over, release
    ("create", "leases.coordination.k8s.io"),  # the first replica ever
]
NOT_ALLOWED = [
    ("update", "lorajobs.lorajob.dev"),  # the operator never writes spec (Git stays the truth; its patches are annotations)
    ("create", "lorajobs.lorajob.dev"),
    ("update", "lorajobs.lorajob.dev/status"),
    ("patch", "jobsets.jobset.x-k8s.io"),  # never fights Kueue over a created JobSet
    ("update", "jobsets.jobset.x-k8s.io"),
    ("patch", "workloads.kueue.x-k8s.io"),
    # Nothing on Secrets, in any namespace: the token reaches pods by an optional secretKeyRef and the first CPU
    # step checks it (test_no_role_of_the_chart_can_read_secrets below checks every verb).
    ("get", "secrets"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("create", "pods"),
    ("delete", "pods"),
    ("get", "configmaps"),
    ("create", "localqueues.kueue.x-k8s.io"),
    ("create", "lorajobpolicies.lorajob.dev"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ("impersonate", "serviceaccounts"),
]

# The fine-tuning API server's calls (operator/lorajob_operator/openai_api/server.py, Cluster), in a served namespace.
API_CALLS = [
    ("get", "lorajobs.lorajob.dev"),  # a job
    ("list", "lorajobs.lorajob.dev"),  # the jobs
    ("create", "lorajobs.lorajob.dev"),  # a new job
    ("patch", "lorajobs.lorajob.dev"),  # cancel, pause, resume
    ("list", "events"),  # a job's events
]
API_CLUSTER_CALLS = [
    ("create", "tokenreviews.authentication.k8s.io"),  # who the caller is (system:auth-delegator)
    ("create", "subjectaccessreviews.authorization.k8s.io"),  # what the caller may do there
    ("list", "lorajobpolicies.lorajob.dev"),  # the policies a request must meet
]
API_NAMESPACE_READ = ("get", "namespaces")  # the served namespaces' labels, by name (policies select on them)
API_NOT_ALLOWED = [
    ("list", "events.events.k8s.io"),  # it reads the core group's events only
    ("delete", "lorajobs.lorajob.dev"),
    ("deletecollection", "lorajobs.lorajob.dev"),
    ("update", "lorajobs.lorajob.dev"),
    ("watch", "lorajobs.lorajob.dev"),
    ("patch", "lorajobs.lorajob.dev/status"),
    ("get", "secrets"),
    ("list", "secrets"),
    ("get", "configmaps"),
    ("create", "events"),
    ("create", "pods"),
    ("get", "pods/log"),
    ("create", "jobsets.jobset.x-k8s.io"),
    ("create", "lorajobpolicies.lorajob.dev"),
    ("list", "namespaces"),
    ("create", "serviceaccounts/token"),
    ("impersonate", "users"),
    ("impersonate", "serviceaccounts"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
]


def allowed(kube, verb: str, resource: str, namespace: str | None, name: str | None = None,
            user: str = SERVICE_ACCOUNT) -> bool:
    """A SubjectAccessReview for a ServiceAccount, the operator's by default (no discovery: CRDs need not exist)."""
    kind, _, subresource = resource.partition("/")
    plural, _, group = kind.partition(".")
    attributes = {"verb": verb, "group": group, "resource": plural}
    attributes.update({"subresource": subresource} if subresource else {})
    attributes.update({"namespace": namespace} if namespace else {})
    attributes.update({"name": name} if name else {})
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": user,
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{user.split(':')[2]}", "system:authenticated"],
            "resourceAttributes": attributes,
        },
    }
    result = kube.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    return json.loads(result.stdout)["status"].get("allowed", False)


@pytest.fixture(scope="module")
def scoped_release(kube, installed_release):
    for namespace in (NAMESPACE, OTHER_NAMESPACE):
        kube.kubectl("create", "namespace", namespace, check=False)
    installed_release.run(
        "upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        *set_args(f"operator.watchNamespaces={{{NAMESPACE}}}", *api_values(NAMESPACE)),
    )
    yield installed_release
    installed_release.run("upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--reset-values")


@pytest.mark.parametrize("verb, resource", OPERATOR_CALLS, ids=lambda v: str(v))
def test_operator_calls_are_allowed_in_watched_namespaces_only(kube, scoped_release, verb, resource):
    assert allowed(kube, verb, resource, NAMESPACE)
    assert not allowed(kube, verb, resource, OTHER_NAMESPACE)


@pytest.mark.parametrize("verb, resource", CLUSTER_CALLS, ids=lambda v: str(v))
def test_cluster_scoped_calls_are_allowed(kube, scoped_release, verb, resource):
    assert allowed(kube, verb, resource, None)


@pytest.mark.parametrize("verb, resource", LEASE_CALLS, ids=lambda v: str(v))
def test_the_lease_is_reachable_in_the_release_namespace_only(kube, scoped_release, verb, resource):
    assert allowed(kube, verb, resource, RELEASE_NAMESPACE, name=FULLNAME)
    assert not allowed(kube, verb, resource, NAMESPACE, name=FULLNAME)
    if verb != "create":  # create cannot be limited to a name
        assert not allowed(kube, verb, resource, RELEASE_NAMESPACE, name="another-lease")


@pytest.mark.parametrize("verb, resource", NOT_ALLOWED, ids=lambda v: str(v))
def test_nothing_else_is_allowed(kube, scoped_release, verb, resource):
    assert not allowed(kube, verb, resource, NAMESPACE)


OPERATOR_ROLES = [("clusterrole", f"{FULLNAME}-namespaced"), ("clusterrole", f"{FULLNAME}-cluster"),
                  ("role", f"{FULLNAME}-leader", "-n", RELEASE_NAMESPACE)]
API_ROLES = [("clusterrole", "system:auth-delegator"), ("clusterrole", API_FULLNAME), ("role", API_FULLNAME, "-n", NAMESPACE)]


def _granted(kube, roles: list[tuple[str, ...]]) -> set[tuple[str, str]]:
    """(verb, resource) of each rule of these roles (resourceNames aside)."""
    granted = set()
    for kind, role, *where in roles:
        rules = json.loads(kube.kubectl("get", kind, role, *where, "-o", "json").stdout)["rules"]
        for rule in rules:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    base, _, sub = resource.partition("/")
                    name = f"{base}.{group}" if group else base
                    for verb in rule["verbs"]:
                        granted.add((verb, f"{name}/{sub}" if sub else name))
    return granted


def test_the_roles_grant_exactly_the_operator_calls(kube, scoped_release):
    assert _granted(kube, OPERATOR_ROLES) == set(OPERATOR_CALLS) | set(CLUSTER_CALLS) | set(LEASE_CALLS)


def test_no_role_of_the_chart_can_read_secrets(kube, scoped_release):
    granted = _granted(kube, OPERATOR_ROLES + API_ROLES)
    reaching = {(verb, resource) for verb, resource in granted if resource in ("secrets", "*") or verb == "*"}
    assert reaching == set()
    for user in (SERVICE_ACCOUNT, API_SERVICE_ACCOUNT):
        for namespace in (NAMESPACE, OTHER_NAMESPACE, None):
            assert not any(allowed(kube, verb, "secrets", namespace, user=user) for verb in ("get", "list", "watch"))


# --- The fine-tuning API server's ServiceAccount ---------------------------------------------------------


@pytest.mark.parametrize("verb, resource", API_CALLS, ids=lambda v: str(v))
def test_api_calls_are_allowed_in_served_namespaces_only(kube, scoped_release, verb, resource):
    assert allowed(kube, verb, resource, NAMESPACE, user=API_SERVICE_ACCOUNT)
    assert not allowed(kube, verb, resource, OTHER_NAMESPACE, user=API_SERVICE_ACCOUNT)


@pytest.mark.parametrize("verb, resource", API_CLUSTER_CALLS, ids=lambda v: str(v))
def test_api_cluster_scoped_calls_are_allowed(kube, scoped_release, verb, resource):
    assert allowed(kube, verb, resource, None, user=API_SERVICE_ACCOUNT)


def test_api_reads_the_served_namespaces_only(kube, scoped_release):
    verb, resource = API_NAMESPACE_READ
    assert allowed(kube, verb, resource, None, name=NAMESPACE, user=API_SERVICE_ACCOUNT)
    assert not allowed(kube, verb, resource, None, name=OTHER_NAMESPACE, user=API_SERVICE_ACCOUNT)
    assert not allowed(kube, verb, resource, None, name=RELEASE_NAMESPACE, user=API_SERVICE_ACCOUNT)


@pytest.mark.parametrize("verb, resource", API_NOT_ALLOWED, ids=lambda v: str(v))
def test_api_may_do_nothing_else(kube, scoped_release, verb, resource):
    for namespace in (NAMESPACE, None):
        assert not allowed(kube, verb, resource, namespace, user=API_SERVICE_ACCOUNT)


def test_the_api_roles_grant_exactly_the_servers_calls(kube, scoped_release):
    assert _granted(kube, API_ROLES) == set(API_CALLS) | set(API_CLUSTER_CALLS) | {API_NAMESPACE_READ}


def test_the_release_notes_say_how_to_reach_the_api(scoped_release):
    notes = scoped_release.run("get", "notes", RELEASE, "--namespace", RELEASE_NAMESPACE).stdout
    assert f"kubectl -n {RELEASE_NAMESPACE} port-forward svc/{API_FULLNAME} 8080:80" in notes
    assert f"kubectl create token SERVICE_ACCOUNT -n {NAMESPACE}" in notes
    assert f'OpenAI(base_url="http://localhost:8080/v1", api_key=os.environ["OPENAI_API_KEY"], project="{NAMESPACE}")' in notes


# --- The operator itself, with the ServiceAccount's identity ------------------------------------------


def _service_account_kubeconfig(kube, path: Path, account: str = FULLNAME) -> Path:
    """A kubeconfig holding a token of the release's ServiceAccount `account` (the operator's by default)."""
    token = kube.kubectl("create", "token", account, "-n", RELEASE_NAMESPACE, "--duration=1h").stdout.strip()
    return kube.write_kubeconfig(path, {"token": token})


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _deployment_args(release) -> list[str]:
    manifest = release.run("get", "manifest", RELEASE, "--namespace", RELEASE_NAMESPACE).stdout
    (deployment,) = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] == "Deployment" and d["metadata"]["name"] == FULLNAME]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    # The one variable the downward API fills is the replica's name in the Lease (the pod's name).
    return container["args"], {e["name"]: e.get("value", "operator-under-test") for e in container.get("env", [])}


@pytest.fixture
def operator_as_service_account(kube, scoped_release, tmp_path):
    """`python -m lorajob_operator` with the Deployment's arguments and settings, as the ServiceAccount."""
    kubeconfig = _service_account_kubeconfig(kube, tmp_path / "kubeconfig")
    assert kube.kubectl("auth", "whoami", f"--kubeconfig={kubeconfig}", "-o", "json").returncode == 0
    port = free_loopback_port()
    args, settings = _deployment_args(scoped_release)
    # Only the listen address changes: several test sessions may share this machine's port 8080.
    args = [f"--liveness=http://127.0.0.1:{port}/healthz" if a.startswith("--liveness=") else a for a in args]
    settings["LORAJOB_METRICS_PORT"] = str(free_loopback_port())  # and the metrics port, for the same reason
    log = tmp_path / "operator.log"
    env = {**os.environ, **settings, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "lorajob_operator", *args], cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
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


@pytest.mark.cluster
def test_operator_works_with_only_the_charts_permissions(kube, sim_cluster, operator_as_service_account):
    # sim_cluster: the operator lists JobSets and Workloads, whose CRDs only the full cluster installs.
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


@pytest.mark.cluster
def test_operator_creates_the_first_step_with_only_the_charts_permissions(sim_cluster, kube, operator_as_service_account):
    """On the simulated cluster (JobSet and Kueue installed) the operator, as its ServiceAccount, reads
    the LocalQueue and creates the first step's JobSet (it holds no right on the Secret the LoRAJob names)."""
    process, _port, log = operator_as_service_account
    sim_cluster.create_namespace_with_queue(NAMESPACE, "lorajob")
    kube.kubectl("create", "secret", "generic", "hf-token", "-n", NAMESPACE, "--from-literal=HF_TOKEN=test", check=False)
    job = yaml.safe_load((REPO / "examples" / "qwen3-gsm8k.yaml").read_text())
    job["metadata"] = {"name": "rbac-chain", "namespace": NAMESPACE}
    kube.kubectl("apply", "-f", "-", input=json.dumps(job))
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"the operator exited:\n{log.read_text()[-4000:]}"
            found = kube.kubectl("get", "jobsets.jobset.x-k8s.io", "rbac-chain-convert", "-n", NAMESPACE, "-o", "json", check=False)
            if found.returncode == 0:
                break
            assert time.monotonic() < deadline, f"no convert JobSet:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        (owner,) = json.loads(found.stdout)["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["controller"]) == ("LoRAJob", "rbac-chain", True)
        text = log.read_text()
        assert "Forbidden" not in text and " 403" not in text, text[-4000:]
    finally:
        kube.kubectl("delete", "lorajob", "rbac-chain", "-n", NAMESPACE, "--wait=false", check=False)


def test_the_api_server_serves_a_tenant_with_only_the_charts_permissions(kube, scoped_release, tmp_path):
    """`lorajob api` as the chart's API ServiceAccount: every call a tenant's requests make succeeds with the chart's
    grants (a Forbidden from the API server would be a 500 here), and an unserved namespace stays refused."""
    import openai

    from lorajob_operator.local import ApiServerProcess
    from lorajob_operator.openai_api import CALLER_RULES

    kubeconfig = _service_account_kubeconfig(kube, tmp_path / "kubeconfig", API_FULLNAME)
    (values,) = [v for v in api_values(NAMESPACE) if v.startswith("json:api.config=")]
    config = json.loads(values.removeprefix("json:api.config=")) | {"storage": str(tmp_path / "storage")}
    tenant = kube.service_account_token(NAMESPACE, "ship-tenant", CALLER_RULES)
    with ApiServerProcess(kubeconfig, config, tmp_path) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant, max_retries=0)  # project: its namespace
        line = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
        training = client.files.create(file=("t.jsonl", (json.dumps(line) + "\n").encode() * 8), purpose="fine-tune")
        job = client.fine_tuning.jobs.create(model="qwen3-0.6b", training_file=training.id)
        assert kube.kubectl("get", "lorajob", job.id, "-n", NAMESPACE, "-o", "name").stdout.strip()
        assert client.fine_tuning.jobs.retrieve(job.id).status == "validating_files"
        assert [j.id for j in client.fine_tuning.jobs.list().data] == [job.id]
        assert client.fine_tuning.jobs.list_events(job.id).data[-1].message == "Created fine-tuning job"
        assert client.fine_tuning.jobs.checkpoints.list(job.id).data == []
        assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
        with pytest.raises(openai.PermissionDeniedError, match="not served"):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key=tenant, project=OTHER_NAMESPACE,
                          max_retries=0).fine_tuning.jobs.list()
        log = server.log_path.read_text()
        assert "Forbidden" not in log and " 500 " not in log, log[-4000:]
