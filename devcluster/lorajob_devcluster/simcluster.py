"""The full simulated TPU cluster: KCM, kube-scheduler, kwok fake nodes, JobSet and Kueue on loopback, and
Kueue's visibility API through kube-apiserver's aggregation layer (on this machine's address).

It runs on an existing `ControlPlane` (upgraded in place) so the same apiserver serves both the
apiserver-only tests and the end-to-end ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import ssl
import sys
import urllib.request
from pathlib import Path
from collections.abc import Callable, Iterator

import yaml

from . import build, kwok_stages, manifests, podrunner, topology
from .controlplane import ControlPlane, ControlPlaneConfig, condition_is_true, wait_for
from .documents import as_kubectl_input
from .process import ManagedProcess, free_loopback_port, host_ip

KUEUE_NAMESPACE = "kueue-system"
# Kueue loads these unconditionally when its internal cert management is off (cmd/kueue/main.go).
KUEUE_METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
KUEUE_VISIBILITY_CERT_DIR = Path("/visibility")
"""Where Kueue's visibility API server reads tls.crt/tls.key (fixed in Kueue, pkg/visibility/server.go)."""
KUEUE_VISIBILITY_SERVICE = "visibility-server"
VISIBILITY_READY_TIMEOUT = 60.0
COMPONENT_READY_TIMEOUT = 120.0
NODES_READY_TIMEOUT = 120.0
POD_CIDR = "10.244.0.0/16"
KWOK_NODE_IP = "127.0.0.1"
"""The fake nodes' InternalIP: the apiserver sends `pods/log` requests there, to kwok's server port."""

Starting = tuple[ManagedProcess, Callable[[], bool]]  # a launched process and its readiness probe


class SimClusterError(RuntimeError):
    """The simulated cluster could not be started; the message says which part failed."""


@dataclasses.dataclass(frozen=True)
class SimClusterConfig:
    node_pools: tuple[topology.NodePool, ...] = topology.DEFAULT_NODE_POOLS
    pod_timing: kwok_stages.PodTiming = kwok_stages.PodTiming()


def _replace_atomically(source: Path, destination: Path) -> None:
    """Clusters started at the same time share Kueue's fixed metrics-cert path: never expose a half-written file."""
    partial = destination.with_name(f".{destination.name}.{os.getpid()}")
    shutil.copyfile(source, partial)
    os.replace(partial, destination)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


def _https_healthz(port: int) -> bool:
    """KCM and the scheduler serve /healthz with a self-signed cert; only liveness matters here."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=context, timeout=2) as response:
        return response.status == 200


class SimCluster:
    """Helpers over a control plane that runs the full simulated cluster."""

    def __init__(self, plane: ControlPlane, config: SimClusterConfig):
        self.plane = plane
        self.config = config
        self.state_dir = plane.state_dir
        self.kubeconfig = plane.kubeconfig
        self.kubectl = plane.kubectl
        self.api_client = plane.api_client
        self.apply_documents = plane.apply_documents
        self.wait_condition = plane.wait_condition
        self.restart = plane.restart
        self.webhook_cert_dir = plane.state_dir / "webhook-certs"
        self.jobset_dir = build.component_module_dir("jobset")
        self.kueue_dir = build.component_module_dir("kueue")
        self.jobset_webhook_port = free_loopback_port()
        self.kueue_webhook_port = free_loopback_port()
        self.kueue_visibility_port = free_loopback_port()
        self.host_ip = host_ip()
        """This machine's non-loopback IPv4 address: an aggregated API server's endpoint may not be loopback.
        Without one the cluster does not serve Kueue's visibility API (the operator then works queue
        positions out itself)."""

    # --- lifecycle -------------------------------------------------------------------------

    @classmethod
    @contextlib.contextmanager
    def start(
        cls, config: SimClusterConfig = SimClusterConfig(), plane_config: ControlPlaneConfig = ControlPlaneConfig()
    ) -> Iterator[SimCluster]:
        """`with SimCluster.start() as cluster:` runs a fresh control plane plus the simulated cluster."""
        with ControlPlane.start(plane_config) as plane:
            yield cls.upgrade(plane, config)

    @classmethod
    def upgrade(cls, plane: ControlPlane, config: SimClusterConfig = SimClusterConfig()) -> SimCluster:
        """Start every simulated-cluster component on `plane`; they stop with `plane.stop()`.

        Independent steps overlap: the controllers start while the large CRDs are being established."""
        build.build()
        cluster = cls(plane, config)
        cluster._write_webhook_certs()
        starting = [*cluster._launch_kube_controllers(), cluster._launch_kwok(), *cluster._launch_pod_runner()]
        cluster._install_controller_crds()
        starting += [cluster._launch_jobset(), cluster._launch_kueue()]
        for process, ready in starting:
            plane.ready_probes[process.name] = ready
            process.wait_until(ready, COMPONENT_READY_TIMEOUT, "ready")
        cluster._register_webhooks()
        cluster._register_kueue_visibility_api()
        cluster._create_nodes()
        plane.apply_documents(topology.kueue_objects(config.node_pools))
        plane.wait_condition("clusterqueues.kueue.x-k8s.io", topology.CLUSTER_QUEUE_NAME, "Active")
        return cluster

    def _write_webhook_certs(self) -> None:
        """controller-runtime reads tls.crt/tls.key from its cert dir; Kueue also insists on its metrics and its
        visibility server's dirs."""
        for directory in (self.webhook_cert_dir, KUEUE_METRICS_CERT_DIR, KUEUE_VISIBILITY_CERT_DIR):
            try:
                directory.mkdir(parents=True, exist_ok=True)
                _replace_atomically(self.plane.pki.webhook.cert, directory / "tls.crt")
                _replace_atomically(self.plane.pki.webhook.key, directory / "tls.key")
            except PermissionError as error:
                raise SimClusterError(f"cannot write webhook certificates to {directory} ({error}); Kueue needs them there") from error

    def _launch_kube_controllers(self) -> list[Starting]:
        plane, kubeconfig = self.plane, str(self.plane.kubeconfig)
        delegated = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}"]
        kcm_port, scheduler_port = free_loopback_port(), free_loopback_port()
        kcm = plane.launch(
            "kube-controller-manager",
            [
                plane.binary("kube-controller-manager"),
                *delegated,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                f"--cert-dir={plane.state_dir / 'kcm-certs'}",
                f"--service-account-private-key-file={plane.pki.service_account_key}",
                f"--root-ca-file={plane.pki.ca.cert}",
                "--use-service-account-credentials=false",
                "--controllers=*",
            ],
        )
        scheduler = plane.launch(
            "kube-scheduler",
            [
                plane.binary("kube-scheduler"),
                *delegated,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={scheduler_port}",
                f"--cert-dir={plane.state_dir / 'scheduler-certs'}",
            ],
        )
        return [(kcm, lambda: _https_healthz(kcm_port)), (scheduler, lambda: _https_healthz(scheduler_port))]

    def _launch_kwok(self) -> Starting:
        plane = self.plane
        kwok_dir = build.component_module_dir("kwok")
        stages = kwok_stages.write_kwok_config(
            plane.state_dir / "kwok-stages.yaml", kwok_dir, self.config.pod_timing, self.runner_nodes
        )
        # One port for health checks and the kubelet API (logs) that the nodes advertise to the apiserver.
        server_port = free_loopback_port()
        annotation = "=".join(topology.KWOK_NODE_ANNOTATION)
        kwok = plane.launch(
            "kwok",
            [
                plane.binary("kwok"),
                f"--kubeconfig={plane.kubeconfig}",
                f"--config={stages}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={annotation}",
                f"--cidr={POD_CIDR}",
                f"--node-ip={KWOK_NODE_IP}",
                "--node-lease-duration-seconds=40",
                f"--server-address={KWOK_NODE_IP}:{server_port}",
                f"--node-port={server_port}",
                f"--enable-crds={','.join(kwok_stages.LOG_CRD_KINDS)}",
            ],
        )
        return kwok, lambda: _http_ok(f"http://127.0.0.1:{server_port}/healthz")

    @property
    def runner_nodes(self) -> tuple[str, ...]:
        """The nodes whose pods run as local processes."""
        return tuple(name for pool in self.config.node_pools if pool.runs_pods for name in pool.node_names())

    def _launch_pod_runner(self) -> list[Starting]:
        if not self.runner_nodes:
            return []
        state = self.plane.state_dir / "podrunner"
        nodes = [f"--node={name}" for name in self.runner_nodes]
        argv = [sys.executable, "-m", "lorajob_devcluster", "run-pods", f"--kubeconfig={self.plane.kubeconfig}", f"--state-dir={state}", *nodes]
        runner = self.plane.launch("podrunner", argv)
        return [(runner, lambda: (state / podrunner.READY_FILE).exists())]

    def _install_controller_crds(self) -> None:
        """JobSet's, Kueue's (converting through its loopback webhook) and kwok's log CRDs, created in one go."""
        ca = self.plane.pki.ca_pem()
        crds = [
            *manifests.jobset_crds(self.jobset_dir),
            *manifests.kueue_crds(self.kueue_dir, self.kueue_webhook_port, ca),
            *kwok_stages.log_crds(build.component_module_dir("kwok")),
        ]
        self.plane.kubectl("create", "-f", "-", input=as_kubectl_input(crds))
        self.plane.kubectl("create", "namespace", KUEUE_NAMESPACE)
        self.plane.wait_crds_established([crd["metadata"]["name"] for crd in crds])

    def _controller_config(self, name: str, document: dict) -> Path:
        path = self.plane.state_dir / f"{name}-config.yaml"
        path.write_text(yaml.safe_dump(document))
        return path

    def _controller_runtime_settings(self, webhook_port: int, health_port: int) -> dict:
        """Configuration fields JobSet and Kueue share (both are controller-runtime managers)."""
        return {
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(self.webhook_cert_dir)},
            "metrics": {"bindAddress": "0"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        }

    def _launch_jobset(self) -> Starting:
        health_port = free_loopback_port()
        config = self._controller_config(
            "jobset",
            {
                "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
                "kind": "Configuration",
                **self._controller_runtime_settings(self.jobset_webhook_port, health_port),
            },
        )
        jobset = self.plane.launch("jobset", [self.plane.binary("jobset"), f"--kubeconfig={self.plane.kubeconfig}", f"--config={config}"])
        return jobset, lambda: _http_ok(f"http://127.0.0.1:{health_port}/readyz")

    def _launch_kueue(self) -> Starting:
        health_port = free_loopback_port()
        config = self._controller_config(
            "kueue",
            {
                "apiVersion": "config.kueue.x-k8s.io/v1beta2",
                "kind": "Configuration",
                "namespace": KUEUE_NAMESPACE,
                **self._controller_runtime_settings(self.kueue_webhook_port, health_port),
                "integrations": {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset"]},
            },
        )
        kueue = self.plane.launch("kueue", [
            self.plane.binary("kueue"), f"--kubeconfig={self.plane.kubeconfig}", f"--config={config}",
            f"--visibility-server-port={self.kueue_visibility_port}",
        ])
        return kueue, lambda: _http_ok(f"http://127.0.0.1:{health_port}/readyz")

    def _register_webhooks(self) -> None:
        """Only once both controllers serve: the webhooks fail closed, so early registration blocks creates."""
        ca = self.plane.pki.ca_pem()
        self.plane.apply_documents(
            [
                *manifests.jobset_webhooks(self.jobset_dir, self.jobset_webhook_port, ca),
                *manifests.kueue_webhooks(self.kueue_dir, self.kueue_webhook_port, ca),
            ]
        )

    def _register_kueue_visibility_api(self) -> None:
        """Kueue's visibility API (pending Workloads in queue order) through kube-apiserver's aggregation layer:
        an APIService whose Service has one endpoint, Kueue's visibility server on this machine's address."""
        if self.host_ip is None:
            print("the simulated cluster does not serve Kueue's visibility API: this machine has no non-loopback "
                  "IPv4 address for its endpoint", file=sys.stderr)
            return
        self.plane.apply_documents(manifests.kueue_visibility_api(
            self.kueue_dir, KUEUE_NAMESPACE, KUEUE_VISIBILITY_SERVICE, self.host_ip, self.kueue_visibility_port
        ))
        self.plane.wait_condition("apiservices.apiregistration.k8s.io", manifests.KUEUE_VISIBILITY_API_SERVICE,
                                  "Available", timeout=VISIBILITY_READY_TIMEOUT)

    def _create_nodes(self) -> None:
        nodes = [node for pool in self.config.node_pools for node in pool.nodes()]
        self.plane.kubectl("create", "-f", "-", input=as_kubectl_input(nodes))
        names = {node["metadata"]["name"] for node in nodes}
        wait_for(lambda: self._usable_nodes() >= names, NODES_READY_TIMEOUT, f"nodes {sorted(names)} Ready and untainted")

    def _usable_nodes(self) -> set[str]:
        """Nodes that are Ready and no longer carry the not-ready taint KCM removes."""
        listing = self.get_json("nodes")
        usable = set()
        for node in listing["items"]:
            tainted = any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints") or [])
            if condition_is_true(node, "Ready") and not tainted:
                usable.add(node["metadata"]["name"])
        return usable

    # --- helpers for tests and the demo ----------------------------------------------------

    def create_namespace_with_queue(self, namespace: str, queue: str = topology.DEFAULT_LOCAL_QUEUE) -> str:
        """Create `namespace` (if missing) with a Kueue LocalQueue `queue` feeding the cluster queue."""
        existing = self.kubectl("get", "namespace", namespace, "--ignore-not-found", "-o", "name").stdout.strip()
        if not existing:
            self.kubectl("create", "namespace", namespace)
        self.plane.apply_documents([topology.local_queue(namespace, queue)])
        self.plane.wait_condition("localqueues.kueue.x-k8s.io", queue, "Active", namespace)
        return namespace

    def serve_container_logs(self, namespace: str, container: str, logs_file: Path) -> None:
        """`pods/log` of `container` in every pod of `namespace` answers from `logs_file` (write it with
        `kwok_stages.cri_log`); a missing file is an error of the log request, as for a real node."""
        self.plane.apply_documents([kwok_stages.cluster_logs(f"{namespace}-{container}", namespace, [container], logs_file)])

    def get_json(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def stop(self) -> None:
        self.plane.stop()
