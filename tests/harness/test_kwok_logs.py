"""Container logs of simulated pods: kwok serves them from files, and the API server reaches kwok for
`pods/log` at the fake nodes' address, exactly as it reaches a kubelet."""

from __future__ import annotations

import pytest

from lorajob_devcluster import wait_for
from lorajob_devcluster.kwok_stages import cri_log
from lorajob_devcluster.topology import CPU_NP, NODEPOOL_LABEL

pytestmark = pytest.mark.cluster
NAMESPACE = "harness-logs"


def job(name: str) -> dict:
    containers = [{"name": "main", "image": "sim.lorajob.dev/run"}, {"name": "sidecar", "image": "sim.lorajob.dev/run"}]
    pod_spec = {"restartPolicy": "Never", "nodeSelector": {NODEPOOL_LABEL: CPU_NP.name}, "containers": containers}
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"backoffLimit": 0, "template": {"spec": pod_spec}},
    }


def test_a_pods_log_is_the_file_served_for_its_container_even_after_it_finished(sim_cluster, tmp_path):
    sim_cluster.kubectl("create", "namespace", NAMESPACE)
    log = tmp_path / "main.log"
    log.write_text(cri_log([f"line {number}" for number in range(1, 6)]) + cri_log(["a warning"], stream="stderr"))
    sim_cluster.serve_container_logs(NAMESPACE, "main", log)
    sim_cluster.apply_documents([job("logger")])
    pods = wait_for(
        lambda: [p for p in sim_cluster.get_json("pods", "-n", NAMESPACE)["items"] if p["status"].get("phase") == "Succeeded"],
        90, "the Job's pod Succeeded",
    )
    pod = pods[0]["metadata"]["name"]

    tail = sim_cluster.kubectl("logs", "-n", NAMESPACE, pod, "-c", "main", "--tail=2")
    assert tail.stdout == "line 5\na warning\n"
    log.write_text(log.read_text() + cri_log(["line 6"]))
    assert sim_cluster.kubectl("logs", "-n", NAMESPACE, pod, "-c", "main", "--tail=1").stdout == "line 6\n"

    other = sim_cluster.kubectl("logs", "-n", NAMESPACE, pod, "-c", "sidecar", check=False)
    assert other.returncode != 0 and 'no logs found for container "sidecar"' in other.stderr
    sim_cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
