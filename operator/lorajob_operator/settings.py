"""Operator settings: admin defaults for rendering and the knobs of the reconcile loop.

Everything has a default that works on GKE; `OperatorSettings.from_env()` reads overrides from
`LORAJOB_*` environment variables (how the Helm chart and the tests configure the operator).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Images:
    trainer: str = "us-docker.pkg.dev/lorajob/lorajob/trainer:latest"
    """Runs the convert, train and export entry points unless the LoRAJob overrides it."""
    pathways_server: str = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:latest"
    """Pathways resource manager (on the head) and workers (on the TPU VMs)."""
    pathways_proxy: str = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:latest"


@dataclasses.dataclass(frozen=True)
class Resources:
    """Requests (= limits) of one container: Kueue charges them to the ClusterQueue's CPU flavor."""

    cpu: str
    memory: str

    def as_dict(self) -> dict:
        values = {"cpu": self.cpu, "memory": self.memory}
        return {"requests": dict(values), "limits": dict(values)}


@dataclasses.dataclass(frozen=True)
class PodResources:
    convert: Resources = Resources("8", "32Gi")
    """convert and export load a whole checkpoint on CPU."""
    export: Resources = Resources("8", "32Gi")
    pathways_head_user: Resources = Resources("8", "32Gi")
    """The trainer process on the Pathways head (it only drives the TPU workers)."""
    pathways_resource_manager: Resources = Resources("4", "8Gi")
    pathways_proxy: Resources = Resources("4", "16Gi")


@dataclasses.dataclass(frozen=True)
class RenderSettings:
    images: Images = Images()
    resources: PodResources = PodResources()
    cpu_node_pool: str = "cpu-np"
    """Node pool (cloud.google.com/gke-nodepool) of the Pathways head and the convert/export pods."""
    priority_class_name: str | None = None
    """Kubernetes PriorityClass of the pods (Kueue's priority is the separate priority-class label)."""


@dataclasses.dataclass(frozen=True)
class ReconcileSettings:
    resync_seconds: float = 10.0
    """Every LoRAJob is reconciled at least this often, even if no watch event arrives."""
    retry_backoff_seconds: float = 10.0
    """A failed step is retried after this delay, doubled on every further retry of the same step."""
    retry_backoff_max_seconds: float = 600.0
    blocked_recheck_seconds: float = 30.0
    """How often a LoRAJob blocked on a missing Secret or LocalQueue looks again."""
    workers: int = 16
    """Threads running reconcile passes (each waits on API calls most of the time)."""
    progress_log_lines: int = 100
    """Lines of the lead trainer's log read, once per resync, for the last progress line."""


@dataclasses.dataclass(frozen=True)
class WatchSettings:
    """kopf's watches that fill the operator's caches (watches.py, caches.py)."""

    server_timeout_seconds: int = 60
    """The API server ends each watch after this long; it is then resumed where it stopped (one request)."""
    client_timeout_seconds: int = 70
    """A watch silent for this long is taken for dead and restarted (it must exceed server_timeout_seconds,
    after which a healthy watch always ends): the bound within which a silently stalled watch is replaced."""
    connect_timeout_seconds: int = 10
    request_timeout_seconds: int = 30
    """Timeout of a list (kopf's other requests too)."""
    sweep_seconds: float = 600.0
    """How often each cache is compared with a metadata-only list of its resource, and the objects the API
    server no longer has are dropped: deletions a watch missed (after a re-list, kopf delivers none). 0: never."""


@dataclasses.dataclass(frozen=True)
class MetricsSettings:
    port: int = 8081
    """Port of the Prometheus endpoint (/metrics); 0 turns it off."""


@dataclasses.dataclass(frozen=True)
class LeaderSettings:
    """Leader election over a coordination.k8s.io Lease (leader.py): of the replicas, the one holding the
    Lease reconciles; the others keep their caches warm and write nothing."""

    enabled: bool = True
    """Off: this replica reconciles without a Lease (only safe with one replica)."""
    lease_name: str = "lorajob-operator"
    lease_namespace: str | None = None
    """Default: the namespace of the pod's ServiceAccount; outside a pod the first watched namespace, else default."""
    identity: str | None = None
    """This replica's name in the Lease (the chart gives the pod name). Default: host name and a random suffix."""
    lease_duration_seconds: int = 15
    """A standby takes the Lease once it has seen no renewal for this long (a crashed leader's replacement time)."""
    renew_deadline_seconds: float = 10.0
    """A leader that has not renewed for this long stops writing; shorter than the lease duration, so it has
    stopped before any standby could take the Lease."""
    retry_period_seconds: float = 2.0
    """How often the leader renews and a standby looks at the Lease."""


@dataclasses.dataclass(frozen=True)
class OperatorSettings:
    render: RenderSettings = RenderSettings()
    reconcile: ReconcileSettings = ReconcileSettings()
    watch: WatchSettings = WatchSettings()
    metrics: MetricsSettings = MetricsSettings()
    leader: LeaderSettings = LeaderSettings()

    def __post_init__(self) -> None:
        leader = self.leader
        if not 0 < leader.retry_period_seconds < leader.renew_deadline_seconds < leader.lease_duration_seconds:
            raise ValueError(
                "leader election needs 0 < LORAJOB_LEADER_RETRY_PERIOD_SECONDS "
                f"({leader.retry_period_seconds}) < LORAJOB_LEADER_RENEW_DEADLINE_SECONDS ({leader.renew_deadline_seconds}) "
                f"< LORAJOB_LEADER_LEASE_DURATION_SECONDS ({leader.lease_duration_seconds}): a leader must stop writing "
                "before a standby may take its Lease, and renew more than once within its deadline"
            )
        if self.watch.client_timeout_seconds <= self.watch.server_timeout_seconds:
            raise ValueError(
                f"LORAJOB_WATCH_CLIENT_TIMEOUT_SECONDS ({self.watch.client_timeout_seconds}) must exceed "
                f"LORAJOB_WATCH_SERVER_TIMEOUT_SECONDS ({self.watch.server_timeout_seconds}): a healthy watch "
                "is silent until the server ends it"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorSettings:
        """Settings with overrides from `LORAJOB_<SECTION>_<FIELD>` variables (upper case, dots as `_`).

        For example LORAJOB_RENDER_IMAGES_TRAINER=..., LORAJOB_RENDER_RESOURCES_CONVERT_CPU=2 or
        LORAJOB_RECONCILE_RESYNC_SECONDS=5. An unknown LORAJOB_ variable is an error (a typo never
        silently keeps a default).
        """
        environ = dict(os.environ if environ is None else environ)
        return _with_env(cls(), "LORAJOB", environ)


def _with_env(obj: Any, prefix: str, environ: dict[str, str]) -> Any:
    changes = {}
    for field in dataclasses.fields(obj):
        key = f"{prefix}_{field.name.upper()}"
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            changes[field.name] = _with_env(value, key, environ)
        elif key in environ:
            changes[field.name] = _parse(key, environ[key], value)
    unknown = [k for k in environ if k.startswith(prefix + "_") and not _known(obj, prefix, k)]
    if unknown and prefix == "LORAJOB":
        raise ValueError(f"unknown operator setting(s): {', '.join(sorted(unknown))}")
    return dataclasses.replace(obj, **changes)


def _known(obj: Any, prefix: str, key: str) -> bool:
    for field in dataclasses.fields(obj):
        name = f"{prefix}_{field.name.upper()}"
        value = getattr(obj, field.name)
        if key == name and not dataclasses.is_dataclass(value):
            return True
        if dataclasses.is_dataclass(value) and key.startswith(name + "_") and _known(value, name, key):
            return True
    return False


def _parse(key: str, raw: str, current: Any) -> Any:
    if isinstance(current, bool):
        return raw.lower() in ("1", "true", "yes")
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    return raw or None
