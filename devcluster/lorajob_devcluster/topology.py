"""The simulated cluster's node pools (kwok fake nodes) and the Kueue objects that queue work onto them."""

from __future__ import annotations

import dataclasses

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_RESOURCE = "google.com/tpu"
TPU_TAINT = {"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
KWOK_NODE_ANNOTATION = ("kwok.x-k8s.io/node", "fake")
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_API = "kueue.x-k8s.io/v1beta2"

CLUSTER_QUEUE_NAME = "lorajob-cluster-queue"
DEFAULT_LOCAL_QUEUE = "lorajob"
WORKLOAD_PRIORITIES = {"low": 100, "high": 1000}


@dataclasses.dataclass(frozen=True)
class NodePool:
    """A group of identical fake nodes; `flavor` is the Kueue ResourceFlavor that targets it."""

    name: str
    node_count: int
    cpu: int
    memory_gi: int
    tpu_chips_per_node: int = 0
    tpu_accelerator: str | None = None
    tpu_topology: str | None = None
    runs_pods: bool = False
    """Its pods run as real local processes (`podrunner`) instead of being played by kwok."""

    @property
    def is_tpu(self) -> bool:
        return self.tpu_chips_per_node > 0

    @property
    def flavor(self) -> str:
        return f"{self.tpu_accelerator}-{self.tpu_topology}" if self.is_tpu else self.name

    def flavor_labels(self) -> dict[str, str]:
        if self.is_tpu:
            return {ACCELERATOR_LABEL: self.tpu_accelerator, TOPOLOGY_LABEL: self.tpu_topology}
        return {NODEPOOL_LABEL: self.name}

    def node_labels(self, node_name: str) -> dict[str, str]:
        return {
            "type": "kwok",
            "kubernetes.io/hostname": node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            NODEPOOL_LABEL: self.name,
            **self.flavor_labels(),
        }

    def capacity(self) -> dict[str, str]:
        resources = {"cpu": str(self.cpu), "memory": f"{self.memory_gi}Gi", "pods": "110"}
        if self.is_tpu:
            resources[TPU_RESOURCE] = str(self.tpu_chips_per_node)
        return resources

    def node_names(self) -> list[str]:
        return [f"{self.name}-{index}" for index in range(self.node_count)]

    def nodes(self) -> list[dict]:
        return [
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "labels": self.node_labels(name),
                    "annotations": {KWOK_NODE_ANNOTATION[0]: KWOK_NODE_ANNOTATION[1], "node.alpha.kubernetes.io/ttl": "0"},
                },
                "spec": {"taints": [TPU_TAINT] if self.is_tpu else []},
                "status": {"capacity": self.capacity(), "allocatable": self.capacity()},
            }
            for name in self.node_names()
        ]

    def quota(self) -> dict[str, str]:
        """The whole pool as a ClusterQueue quota for this pool's flavor."""
        return {
            "cpu": str(self.cpu * self.node_count),
            "memory": f"{self.memory_gi * self.node_count}Gi",
            TPU_RESOURCE: str(self.tpu_chips_per_node * self.node_count),
        }


# One v6e-16 slice (4x4 = 16 chips on 4 hosts of 4 chips), one single-host v6e 2x2 and CPU nodes.
TPU_V6E_4X4 = NodePool("tpu-v6e-4x4-np", 4, cpu=180, memory_gi=720, tpu_chips_per_node=4, tpu_accelerator="tpu-v6e-slice", tpu_topology="4x4")
TPU_V6E_2X2 = NodePool("tpu-v6e-2x2-np", 1, cpu=180, memory_gi=720, tpu_chips_per_node=4, tpu_accelerator="tpu-v6e-slice", tpu_topology="2x2")
CPU_NP = NodePool("cpu-np", 3, cpu=64, memory_gi=256)  # fits an xpk-sized Pathways head (>= 49 vCPU)
# Pools whose pods really run (podrunner): convert/export on CPU, a 2-host v6e-8 slice for multi-host training.
LOCAL_CPU_NP = NodePool("local-cpu-np", 2, cpu=64, memory_gi=256, runs_pods=True)
LOCAL_V6E_2X4 = NodePool(
    "local-v6e-2x4-np", 2, cpu=180, memory_gi=720, tpu_chips_per_node=4, tpu_accelerator="tpu-v6e-slice",
    tpu_topology="2x4", runs_pods=True,
)
DEFAULT_NODE_POOLS = (CPU_NP, TPU_V6E_4X4, TPU_V6E_2X2, LOCAL_CPU_NP, LOCAL_V6E_2X4)


def resource_flavor(pool: NodePool) -> dict:
    spec: dict = {"nodeLabels": pool.flavor_labels()}
    if pool.is_tpu:
        spec["tolerations"] = [{"key": TPU_TAINT["key"], "operator": "Exists", "effect": TPU_TAINT["effect"]}]
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": pool.flavor}, "spec": spec}


def cluster_queue(pools: tuple[NodePool, ...]) -> dict:
    """One ClusterQueue over cpu, memory and TPU chips. CPU flavors come first and have no TPU quota,
    so CPU-only pods land on CPU nodes and TPU pods fall through to the TPU flavor matching their topology."""
    ordered = sorted(pools, key=lambda p: p.is_tpu)
    flavors = [
        {"name": pool.flavor, "resources": [{"name": n, "nominalQuota": q} for n, q in pool.quota().items()]}
        for pool in ordered
    ]
    return {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": CLUSTER_QUEUE_NAME},
        "spec": {
            "namespaceSelector": {},
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [{"coveredResources": ["cpu", "memory", TPU_RESOURCE], "flavors": flavors}],
            "preemption": {"withinClusterQueue": "LowerPriority"},
        },
    }


def workload_priority_classes() -> list[dict]:
    return [
        {"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value}
        for name, value in WORKLOAD_PRIORITIES.items()
    ]


def local_queue(namespace: str, name: str = DEFAULT_LOCAL_QUEUE) -> dict:
    return {
        "apiVersion": KUEUE_API,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": CLUSTER_QUEUE_NAME},
    }


def kueue_objects(pools: tuple[NodePool, ...]) -> list[dict]:
    return [*(resource_flavor(p) for p in pools), *workload_priority_classes(), cluster_queue(pools)]
