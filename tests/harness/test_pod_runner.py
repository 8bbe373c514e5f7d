"""Pods on the runner's nodes run for real: the process is the container's command with its resolved
environment, its output is what `kubectl logs` shows, and its exit is the pod's status."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
from kubernetes import client, watch

from lorajob_devcluster import wait_for
from lorajob_devcluster.topology import LOCAL_CPU_NP, NODEPOOL_LABEL

pytestmark = pytest.mark.cluster

REPORT = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    # One stream (stderr) for both lines: the pod runner pumps stdout and stderr apart, so their order in the log
    # is the order the two pumps got them, not the order they were written.
    print(json.dumps({"argv": sys.argv[1:], "python": sys.executable, "cwd": os.getcwd(),
                      "env": {k: os.environ.get(k) for k in ("GREETING", "TOKEN", "APP", "NODE", "MISSING")}}),
          file=sys.stderr)
    Path(os.environ["SHARED"], "written-by-pod").write_text("hi")
    print("the last words", file=sys.stderr)
    sys.exit(3)
    """
)
IGNORE_SIGTERM = textwrap.dedent(
    """
    import os, signal, time
    from pathlib import Path
    marker = Path(os.environ["SHARED"], "sigterm")
    signal.signal(signal.SIGTERM, lambda *_: marker.write_text("received"))
    Path(os.environ["SHARED"], "ready").write_text("")
    while True:
        time.sleep(0.1)
    """
)


@pytest.fixture
def namespace(sim_cluster, request):
    name = "podrunner-" + request.node.name.removeprefix("test_a_").replace("_", "-")[:30].strip("-")
    sim_cluster.kubectl("create", "namespace", name)
    yield name
    sim_cluster.kubectl("delete", "namespace", name, "--wait=false")


def pod_spec(script: str, shared: Path, env: list[dict] = (), **extra) -> dict:
    container = {
        "name": "main", "image": "ignored.example/image", "command": ["python", "-c", script],
        "env": [{"name": "SHARED", "value": "/mnt/shared"}, *env],
        "volumeMounts": [{"name": "shared", "mountPath": "/mnt/shared"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return {
        "restartPolicy": "Never", "nodeSelector": {NODEPOOL_LABEL: LOCAL_CPU_NP.name}, "containers": [container],
        "volumes": [{"name": "shared", "hostPath": {"path": str(shared)}}], **extra,
    }


def pods(sim_cluster, namespace: str, **labels) -> list[dict]:
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    return sim_cluster.get_json("pods", "-n", namespace, "-l", selector)["items"]


def test_a_jobs_pod_runs_its_command_with_the_resolved_environment_and_reports_the_exit(sim_cluster, namespace, tmp_path):
    sim_cluster.kubectl("-n", namespace, "create", "secret", "generic", "creds", "--from-literal=token=s3cret")
    env = [
        {"name": "WHO", "value": "world"},
        {"name": "GREETING", "value": "hello $(WHO)"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    spec = pod_spec(REPORT, tmp_path, env)
    spec["containers"][0]["args"] = ["$(GREETING)", "$$(WHO)", "$(MISSING)"]
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "report", "namespace": namespace},
        "spec": {"backoffLimit": 0, "template": {"metadata": {"labels": {"app": "reporter"}}, "spec": spec}},
    }
    sim_cluster.apply_documents([job])
    pod = wait_for(
        lambda: next((p for p in pods(sim_cluster, namespace, app="reporter") if p["status"].get("phase") == "Failed"), None),
        120, "the Job's pod Failed",
    )

    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and terminated["reason"] == "Error"
    assert terminated["message"].endswith("the last words")
    logs = sim_cluster.kubectl("logs", "-n", namespace, pod["metadata"]["name"]).stdout.splitlines()
    assert logs[-1] == "the last words"
    report = json.loads(logs[0])
    assert report["argv"] == ["hello world", "$(WHO)", "$(MISSING)"]
    assert report["env"] == {"GREETING": "hello world", "TOKEN": "s3cret", "APP": "reporter",
                             "NODE": pod["spec"]["nodeName"], "MISSING": None}
    assert pod["spec"]["nodeName"] in LOCAL_CPU_NP.node_names()
    assert Path(report["python"]).parent == Path(sys.executable).parent, "`python` is this venv's interpreter"
    assert report["cwd"].endswith(f"/pods/{namespace}/{pod['metadata']['name']}/root")
    assert (tmp_path / "written-by-pod").read_text() == "hi", "the hostPath volume is mounted at its mountPath"
    wait_for(lambda: sim_cluster.get_json("job", "report", "-n", namespace)["status"].get("failed") == 1, 60,
             "the Job controller counting the failed pod")


def test_a_deleted_pod_gets_sigterm_then_sigkill_after_its_grace_period(sim_cluster, namespace, tmp_path):
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "stubborn", "namespace": namespace},
            "spec": pod_spec(IGNORE_SIGTERM, tmp_path, terminationGracePeriodSeconds=1)}
    sim_cluster.apply_documents([body])
    wait_for(lambda: (tmp_path / "ready").exists(), 60, "the process running with its SIGTERM handler")
    core = client.CoreV1Api(sim_cluster.api_client())
    version = core.read_namespaced_pod("stubborn", namespace).metadata.resource_version
    sim_cluster.kubectl("-n", namespace, "delete", "pod", "stubborn", "--wait=false")
    last = None  # the final status is only seen on the way out: watch it
    for event in watch.Watch().stream(core.list_namespaced_pod, namespace, field_selector="metadata.name=stubborn",
                                           resource_version=version, timeout_seconds=60):
        if event["type"] == "DELETED":
            break
        last = event["object"]
    assert (tmp_path / "sigterm").read_text() == "received"
    terminated = last.status.container_statuses[0].state.terminated
    assert terminated.exit_code == 137, "killed after the grace period"
    assert last.status.phase == "Failed"


def test_a_pod_whose_secret_is_missing_stays_pending_with_the_reason(sim_cluster, namespace, tmp_path):
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "absent", "key": "token"}}}]
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "unconfigured", "namespace": namespace},
            "spec": pod_spec(REPORT, tmp_path, env)}
    sim_cluster.apply_documents([body])

    def waiting() -> dict | None:
        statuses = sim_cluster.get_json("pod", "unconfigured", "-n", namespace)["status"].get("containerStatuses") or []
        return statuses[0]["state"].get("waiting") if statuses else None

    reason = wait_for(waiting, 60, "a waiting reason on the pod")
    assert reason["reason"] == "CreateContainerConfigError"
    assert f"secret {namespace}/absent" in reason["message"]
    assert not (tmp_path / "written-by-pod").exists()
