"""The chart's optional Kueue objects, installed by `helm upgrade` into the simulated cluster, where the
real Kueue controller (with its webhooks) must accept them and activate the ClusterQueue."""

from __future__ import annotations

import json

import pytest

from shipkit import CHART, RELEASE, RELEASE_NAMESPACE

pytestmark = pytest.mark.cluster

NAMESPACE = "ship-kueue-team"
# Names distinct from the simulated cluster's own Kueue objects; labels matching its kwok node pools.
KUEUE_VALUES = {
    "kueue": {
        "enabled": True,
        "cpuFlavor": {"name": "ship-cpu", "nodePool": "cpu-np", "quota": {"cpu": "64", "memory": "256Gi"}},
        "tpuFlavors": [
            {"name": "ship-v6e-4x4", "accelerator": "tpu-v6e-slice", "topology": "4x4",
             "quota": {"tpu": "16", "cpu": "720", "memory": "2880Gi"}},
        ],
        "clusterQueue": {"name": "ship-lorajob"},
        "localQueues": [{"namespace": NAMESPACE, "name": "ship-queue"}],
        "workloadPriorityClasses": [{"name": "ship-low", "value": 10}, {"name": "ship-high", "value": 20}],
    }
}


@pytest.fixture(scope="module")
def with_kueue_objects(sim_cluster, installed_release, tmp_path_factory):
    sim_cluster.kubectl("create", "namespace", NAMESPACE, check=False)
    values = tmp_path_factory.mktemp("values") / "kueue.json"
    values.write_text(json.dumps(KUEUE_VALUES))
    installed_release.run("upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "-f", str(values))
    yield sim_cluster
    installed_release.run("upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--reset-values")


def test_kueue_activates_the_cluster_queue_and_local_queue(with_kueue_objects):
    cluster = with_kueue_objects
    cluster.kubectl("wait", "--for=condition=Active", "--timeout=60s", "clusterqueues.kueue.x-k8s.io/ship-lorajob")
    cluster.kubectl("wait", "--for=condition=Active", "--timeout=60s", "-n", NAMESPACE, "localqueues.kueue.x-k8s.io/ship-queue")
    flavors = cluster.get_json("resourceflavors.kueue.x-k8s.io")["items"]
    assert {"ship-cpu", "ship-v6e-4x4"} <= {f["metadata"]["name"] for f in flavors}
    priorities = cluster.get_json("workloadpriorityclasses.kueue.x-k8s.io")["items"]
    assert {p["metadata"]["name"]: p["value"] for p in priorities if p["metadata"]["name"].startswith("ship-")} == {
        "ship-low": 10, "ship-high": 20,
    }


def test_upgrade_back_to_defaults_removes_them(with_kueue_objects, installed_release):
    cluster = with_kueue_objects
    installed_release.run("upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--reset-values")
    # Kueue's finalizer lets the ClusterQueue go once nothing uses it.
    cluster.kubectl("wait", "--for=delete", "--timeout=60s", "clusterqueues.kueue.x-k8s.io/ship-lorajob")
    cluster.kubectl("wait", "--for=delete", "--timeout=60s", "resourceflavors.kueue.x-k8s.io/ship-v6e-4x4")
