"""Local Kubernetes for lorajob tests and the demo: real etcd, kube-apiserver, KCM, kube-scheduler,
kwok fake TPU nodes, JobSet and Kueue, all built from the Go module proxy and run on loopback."""

from . import build
from .controlplane import ControlPlane, ControlPlaneConfig, KubectlError, condition_is_true, wait_for
from .kwok_stages import HANG_IMAGE, RUN_DURATION_ANNOTATION, SLOW_IMAGE, PodTiming, failing_image
from .process import ComponentFailed
from .simcluster import SimCluster, SimClusterConfig, SimClusterError

__all__ = [
    "build",
    "ComponentFailed",
    "ControlPlane",
    "ControlPlaneConfig",
    "HANG_IMAGE",
    "KubectlError",
    "PodTiming",
    "RUN_DURATION_ANNOTATION",
    "SLOW_IMAGE",
    "SimCluster",
    "SimClusterConfig",
    "SimClusterError",
    "condition_is_true",
    "failing_image",
    "wait_for",
]
