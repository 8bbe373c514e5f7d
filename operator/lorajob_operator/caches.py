"""The caches of everything the reconcile reads, so that a pass over a LoRAJob reads memory only.

kopf's watches fill them (watches.py): each `Store` keeps a slimmed copy of every object of one resource
(`Resource.slim`: only the fields observe reads), with its strings interned, and tells a change from a new
resourceVersion of the same slimmed object. Secrets are not among them: the operator holds no right on
Secrets; the LoRAJob's first CPU step checks the token it names.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable

from lorajob_operator import api, names, policy
from lorajob_trainer.contract.records import TRACKERS

KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"


def _metadata(obj: dict, *fields: str, labels: Callable[[str], bool] = lambda _: True) -> dict:
    """Identity, the `labels` kept and `fields` of an object's metadata."""
    metadata = obj.get("metadata") or {}
    kept = {key: metadata[key] for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp") + fields if key in metadata}
    if metadata.get("labels"):
        kept["labels"] = {key: value for key, value in metadata["labels"].items() if labels(key)}
    return kept


def _ours(label: str) -> bool:
    return label.startswith(names.LABEL_PREFIX)


def _without_metadata(obj: dict, dropped: tuple[str, ...]) -> dict:
    return obj | {"metadata": {k: v for k, v in obj["metadata"].items() if k not in dropped}}


def _without_managed_fields(obj: dict) -> dict:
    return _without_metadata(obj, ("managedFields",))


_TRACKER_LINKS = frozenset(names.tracker_link(tracker) for tracker in TRACKERS)


def _slim_lorajob(obj: dict) -> dict:
    """All but managedFields and the annotations other than the operator's links to the tracker runs (no pass reads
    them; `kubectl apply` keeps a copy of the spec there)."""
    slim = _without_metadata(obj, ("managedFields", "annotations"))
    links = {key: value for key, value in (obj["metadata"].get("annotations") or {}).items() if key in _TRACKER_LINKS}
    if links:
        slim["metadata"]["annotations"] = links
    return slim


def _slim_jobset(obj: dict) -> dict:
    """What observe_child reads: identity and ownership, suspend, the replicated jobs' container names, conditions."""
    spec = obj.get("spec") or {}
    replicated = [
        {"name": job["name"], "template": {"spec": {"template": {"spec": {"containers": [
            {"name": container["name"]} for container in job["template"]["spec"]["template"]["spec"].get("containers") or []
        ]}}}}}
        for job in spec.get("replicatedJobs") or []
    ]
    return {
        "metadata": _metadata(obj, "ownerReferences", "deletionTimestamp", labels=_ours),
        "spec": {"suspend": spec.get("suspend"), "replicatedJobs": replicated},
        "status": {"conditions": (obj.get("status") or {}).get("conditions") or []},
    }


def _slim_workload(obj: dict) -> dict:
    """What observe reads, and what places a pending Workload in its ClusterQueue's order (`queue_positions`)."""
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    return {
        "metadata": _metadata(obj, "ownerReferences", labels=lambda label: label == KUEUE_JOB_UID_LABEL),
        "spec": {"queueName": spec.get("queueName"), "priority": spec.get("priority"), "active": spec.get("active")},
        "status": {
            "conditions": status.get("conditions") or [],
            "admission": {"clusterQueue": (status.get("admission") or {}).get("clusterQueue")},
            "resourceRequests": status.get("resourceRequests") or [],
        },
    }


def _slim_local_queue(obj: dict) -> dict:
    return {"metadata": _metadata(obj), "spec": {"clusterQueue": (obj.get("spec") or {}).get("clusterQueue")}}


def _slim_namespace(obj: dict) -> dict:
    return {"metadata": _metadata(obj)}


INTERNED_STRING_LENGTH = 36
"""Cached strings up to this length (every key; values such as condition types, reasons, names, timestamps,
uids) are interned: thousands of cached objects then share one copy of each."""


def _interned(value):
    """`value` (a decoded JSON object) with its keys and short strings interned."""
    if isinstance(value, dict):
        return {sys.intern(key): _interned(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_interned(item) for item in value]
    if isinstance(value, str) and len(value) <= INTERNED_STRING_LENGTH:
        return sys.intern(value)
    return value


@dataclasses.dataclass(frozen=True)
class Resource:
    name: str
    group_version: str
    """"v1" for the core group, else "<group>/<version>"."""
    plural: str
    slim: Callable[[dict], dict]
    namespaced: bool = True


LORAJOBS = Resource("lorajobs", f"{api.GROUP}/{api.VERSION}", api.PLURAL, _slim_lorajob)
JOBSETS = Resource("jobsets", names.JOBSET_API_VERSION, names.JOBSET_PLURAL, _slim_jobset)
WORKLOADS = Resource("workloads", names.KUEUE_API_VERSION, "workloads", _slim_workload)
LOCAL_QUEUES = Resource("localqueues", names.KUEUE_API_VERSION, "localqueues", _slim_local_queue)
POLICIES = Resource("lorajobpolicies", f"{api.GROUP}/{api.VERSION}", policy.PLURAL, _without_managed_fields, namespaced=False)
NAMESPACES = Resource("namespaces", "v1", "namespaces", _slim_namespace, namespaced=False)
RESOURCES = (LORAJOBS, JOBSETS, WORKLOADS, LOCAL_QUEUES, POLICIES, NAMESPACES)

Key = tuple[str, str]
"""(namespace, name); namespace "" for cluster-scoped objects."""


def key_of(obj: dict) -> Key:
    return obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _newer(candidate: dict, current: dict | None) -> bool:
    """resourceVersions are opaque, but etcd's are integers: compare them when both are."""
    if current is None:
        return True
    new, old = candidate["metadata"].get("resourceVersion", ""), current["metadata"].get("resourceVersion", "")
    return not (new.isdigit() and old.isdigit()) or int(new) >= int(old)


def _same_but_version(candidate: dict, current: dict | None) -> bool:
    if current is None:
        return False
    version = {"resourceVersion": current["metadata"].get("resourceVersion")}
    return candidate | {"metadata": candidate["metadata"] | version} == current


def _identity(obj: dict) -> tuple[str | None, str | None]:
    return obj["metadata"].get("uid"), obj["metadata"].get("resourceVersion")


class Store:
    """The objects of one resource (in the watched namespaces), by key; objects are replaced, never mutated."""

    def __init__(self, resource: Resource, index: Callable[[dict], Key | None] | None = None):
        self.resource = resource
        self._objects: dict[Key, dict] = {}
        self._index = index
        self._by_index: dict[Key, set[Key]] = {}
        self._lock = threading.Lock()
        self.version = 0
        """Bumped on every change (lets a reader memoize what it derives from all objects)."""

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, key: Key) -> dict | None:
        return self._objects.get(key)

    def items(self) -> list[dict]:
        with self._lock:
            return list(self._objects.values())

    def indexed(self, index_key: Key) -> list[dict]:
        with self._lock:
            return [self._objects[key] for key in self._by_index.get(index_key, ())]

    def upsert(self, obj: dict) -> dict | None:
        """Store `obj` unless a newer version is already stored; the stored object when it changed.

        A new resourceVersion whose slimmed object is otherwise the same is stored but is no change (None): an
        update of fields no pass reads (a LocalQueue's counts, a JobSet's replicated-job counts) queues nothing."""
        obj = _interned(self.resource.slim(obj))
        key = key_of(obj)
        with self._lock:
            current = self._objects.get(key)
            if not _newer(obj, current) or obj == current:
                return None
            if _same_but_version(obj, current):
                self._objects[key] = obj
                return None
            self._unindex(key, current)
            self._objects[key] = obj
            if self._index and (index_key := self._index(obj)) is not None:
                self._by_index.setdefault(index_key, set()).add(key)
            self.version += 1
            return obj

    def remove(self, obj: dict) -> dict | None:
        key = key_of(obj)
        with self._lock:
            current = self._objects.pop(key, None)
            self._unindex(key, current)
            self.version += 1
            return current

    def remove_unchanged(self, obj: dict) -> dict | None:
        """Remove `obj` if it is still what is stored (same uid and resourceVersion): the removed object, else None."""
        key = key_of(obj)
        with self._lock:
            current = self._objects.get(key)
            if current is None or _identity(current) != _identity(obj):
                return None
            del self._objects[key]
            self._unindex(key, current)
            self.version += 1
            return current

    def _unindex(self, key: Key, current: dict | None) -> None:
        if current is not None and self._index and (index_key := self._index(current)) is not None:
            keys = self._by_index.get(index_key, set())
            keys.discard(key)
            if not keys:
                self._by_index.pop(index_key, None)


def _run_label(obj: dict) -> Key | None:
    run = (obj["metadata"].get("labels") or {}).get(names.LABEL_RUN)
    return (obj["metadata"]["namespace"], run) if run else None


def _job_uid_label(obj: dict) -> Key | None:
    uid = (obj["metadata"].get("labels") or {}).get(KUEUE_JOB_UID_LABEL)
    return (obj["metadata"]["namespace"], uid) if uid else None


def _namespace_of(obj: dict) -> Key:
    return (obj["metadata"]["namespace"], "")


QUEUED_AGAIN_AT_EVICTION = ("PodsReadyTimeout", "AdmissionCheck")
"""Evicted reasons after which Kueue orders a Workload by the eviction's time instead of its creation."""


def _true_condition(obj: dict, condition_type: str) -> dict | None:
    return next(
        (c for c in obj.get("status", {}).get("conditions") or [] if c.get("type") == condition_type and c.get("status") == "True"),
        None,
    )


def _queue_order(workload: dict) -> tuple:
    """Kueue's order of the pending Workloads of a ClusterQueue (both queueing strategies): higher
    spec.priority first, then the earlier queue-ordering time; ties (same second) by namespace and name."""
    evicted = _true_condition(workload, "Evicted")
    queued_at = (
        evicted["lastTransitionTime"] if evicted and evicted.get("reason") in QUEUED_AGAIN_AT_EVICTION
        else workload["metadata"].get("creationTimestamp", "")
    )
    return -(workload["spec"].get("priority") or 0), queued_at, key_of(workload)


def is_pending(workload: dict) -> bool:
    """Active, without quota and not finished: waiting in its queue."""
    return not (workload["spec"].get("active") is False or _true_condition(workload, "QuotaReserved")
                or _true_condition(workload, "Finished"))


def queue_positions(workloads: list[dict], cluster_queue_of: Callable[[str, str], str | None]) -> dict[Key, int]:
    """The position in its ClusterQueue of every pending Workload (active, in a LocalQueue, without quota,
    not finished); position 1 is the one Kueue considers next."""
    pending: dict[str, list[dict]] = {}
    for workload in filter(is_pending, workloads):
        spec = workload["spec"]
        cluster_queue = spec.get("queueName") and cluster_queue_of(workload["metadata"]["namespace"], spec["queueName"])
        if cluster_queue:
            pending.setdefault(cluster_queue, []).append(workload)
    return {
        key_of(workload): position
        for queued in pending.values()
        for position, workload in enumerate(sorted(queued, key=_queue_order), start=1)
    }


class Caches:
    """The stores the reconcile reads; kopf's watches fill them through `apply` (watches.py)."""

    def __init__(self, namespaces: list[str] | None):
        self.namespaces = namespaces
        self.stores = {
            LORAJOBS: Store(LORAJOBS, _namespace_of),
            JOBSETS: Store(JOBSETS, _run_label),
            WORKLOADS: Store(WORKLOADS, _job_uid_label),
            LOCAL_QUEUES: Store(LOCAL_QUEUES),
            POLICIES: Store(POLICIES),
            NAMESPACES: Store(NAMESPACES),
        }
        self._policies: tuple[int, tuple[policy.LoRAJobPolicy, ...]] = (-1, ())
        self._queue_positions: tuple[tuple[int, int], dict[Key, tuple[int, int]]] = ((-1, -1), {})
        self.kueue_positions: dict[Key, int] = {}
        """Kueue's own positions of the pending Workloads (its visibility API), by Workload key; set at each
        resync (controller.kueue_visibility), empty where the cluster does not serve the API."""

    def apply(self, resource: Resource, event_type: str | None, obj: dict) -> dict | None:
        """A watch event of `resource` (`event_type` None: listed): the stored object when it changed (the
        removed one for DELETED), else None."""
        store = self.stores[resource]
        return store.remove(obj) if event_type == "DELETED" else store.upsert(obj)

    # --- what observe reads ---------------------------------------------------------------------

    def lorajob(self, namespace: str, name: str) -> dict | None:
        return self.stores[LORAJOBS].get((namespace, name))

    def lorajobs(self, namespace: str | None = None) -> list[dict]:
        store = self.stores[LORAJOBS]
        return store.items() if namespace is None else store.indexed((namespace, ""))

    def jobsets_of_run(self, namespace: str, run: str) -> list[dict]:
        return self.stores[JOBSETS].indexed((namespace, run))

    def jobset(self, namespace: str, name: str) -> dict | None:
        return self.stores[JOBSETS].get((namespace, name))

    def workloads_of(self, namespace: str, jobset_uid: str) -> list[dict]:
        return self.stores[WORKLOADS].indexed((namespace, jobset_uid))

    def local_queue(self, namespace: str, name: str) -> dict | None:
        return self.stores[LOCAL_QUEUES].get((namespace, name))

    def cluster_queue_of(self, namespace: str, local_queue: str) -> str | None:
        found = self.local_queue(namespace, local_queue)
        return None if found is None else found["spec"].get("clusterQueue")

    def kueue_position(self, namespace: str, workload: str) -> int | None:
        """Kueue's position of a Workload that is still pending (as of the last resync; None: not known)."""
        cached = self.stores[WORKLOADS].get((namespace, workload))
        return self.kueue_positions.get((namespace, workload)) if cached and is_pending(cached) else None

    def pending_local_queues(self) -> set[Key]:
        """(namespace, LocalQueue) of every pending Workload of the watched namespaces."""
        return {
            (workload["metadata"]["namespace"], workload["spec"]["queueName"])
            for workload in self.stores[WORKLOADS].items() if workload["spec"].get("queueName") and is_pending(workload)
        }

    def queue_position(self, namespace: str, workload: str) -> int | None:
        """The position of a pending Workload in its ClusterQueue (None: not pending), counting
        the Workloads of the watched namespaces; worked out once per change of any Workload or LocalQueue."""
        versions = (self.stores[WORKLOADS].version, self.stores[LOCAL_QUEUES].version)
        if self._queue_positions[0] != versions:
            self._queue_positions = (versions, queue_positions(self.stores[WORKLOADS].items(), self.cluster_queue_of))
        return self._queue_positions[1].get((namespace, workload))

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        found = self.stores[NAMESPACES].get(("", namespace))
        return dict((found or {}).get("metadata", {}).get("labels") or {})

    def policies(self) -> tuple[policy.LoRAJobPolicy, ...]:
        """Every LoRAJobPolicy, parsed once per change of any of them."""
        store = self.stores[POLICIES]
        version, parsed = self._policies
        if version != store.version:
            version = store.version
            parsed = tuple(policy.LoRAJobPolicy.from_object(obj) for obj in store.items())
            self._policies = (version, parsed)
        return parsed
