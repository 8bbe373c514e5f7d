"""The operator's I/O: read what exists into `reconcile.Observed`, carry out a `reconcile.Decision`.

`Reconciler.reconcile(namespace, name)` is the whole loop body; kopf's watch handlers and the
resync thread (handlers.py) only call it. Passes over one LoRAJob never overlap (a lock per object).
Only the resync thread's periodic pass reads the lead trainer's log for progress, so each LoRAJob's
log is read at most once per resync interval however many watch events arrive.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from datetime import datetime, timezone

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lorajob_operator import api, policy, render, rules
from lorajob_operator.reconcile import (
    JOBSET_NAME_LABEL,
    Decision,
    Observed,
    decide,
    effective_spec,
    format_time,
    observe_child,
    train_log_wanted,
)
from lorajob_operator.settings import OperatorSettings, RenderSettings

log = logging.getLogger("lorajob.operator")

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
WORKLOAD = ("kueue.x-k8s.io", "v1beta2", "workloads")
LOCAL_QUEUE = ("kueue.x-k8s.io", "v1beta2", "localqueues")
LORAJOB = (api.GROUP, api.VERSION, api.PLURAL)
LORAJOB_POLICY = (api.GROUP, api.VERSION, policy.PLURAL)
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
FIELD_MANAGER = "lorajob-operator"
LOG_REQUEST_TIMEOUT_SECONDS = 10


def _missing(error: ApiException) -> bool:
    return error.status == 404


class Cluster:
    """Thin typed access to the objects the operator reads and writes."""

    def __init__(self, api_client: client.ApiClient):
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    def get(self, resource: tuple[str, str, str], namespace: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(*resource[:2], namespace, resource[2], name)
        except ApiException as error:
            if _missing(error):
                return None
            raise

    def list(self, resource: tuple[str, str, str], namespace: str | None, selector: str = "") -> list[dict]:
        group, version, plural = resource
        if namespace is None:
            result = self.custom.list_cluster_custom_object(group, version, plural, label_selector=selector)
        else:
            result = self.custom.list_namespaced_custom_object(group, version, namespace, plural, label_selector=selector)
        return result["items"]

    def policies(self) -> tuple[policy.LoRAJobPolicy, ...]:
        """Every LoRAJobPolicy; none while its CRD is not installed."""
        try:
            objects = self.list(LORAJOB_POLICY, None)
        except ApiException as error:
            if _missing(error):
                return ()
            raise
        return tuple(policy.LoRAJobPolicy.from_object(obj) for obj in objects)

    def namespace_labels(self, namespace: str) -> dict[str, str]:
        return self.core.read_namespace(namespace).metadata.labels or {}

    def workloads_of(self, namespace: str, jobsets: list[dict]) -> dict[str, dict]:
        """The newest Kueue Workload of each JobSet, by JobSet uid (one list request)."""
        if not jobsets:
            return {}
        uids = ",".join(jobset["metadata"]["uid"] for jobset in jobsets)
        newest: dict[str, dict] = {}
        for workload in self.list(WORKLOAD, namespace, f"{KUEUE_JOB_UID_LABEL} in ({uids})"):
            uid = workload["metadata"]["labels"][KUEUE_JOB_UID_LABEL]
            if uid not in newest or workload["metadata"]["creationTimestamp"] > newest[uid]["metadata"]["creationTimestamp"]:
                newest[uid] = workload
        return newest

    def pods_of(self, jobset: dict) -> list[dict]:
        pods = self.core.list_namespaced_pod(
            jobset["metadata"]["namespace"], label_selector=f"{JOBSET_NAME_LABEL}={jobset['metadata']['name']}"
        )
        return [self.core.api_client.sanitize_for_serialization(pod) for pod in pods.items]

    def trainer_log_tail(self, namespace: str, pod_selector: str, lines: int) -> str | None:
        """The last `lines` lines of the trainer container's log in the newest pod matching `pod_selector`
        (None: no such pod yet or any more)."""
        pods = self.core.list_namespaced_pod(namespace, label_selector=pod_selector).items
        if not pods:
            return None
        pod = max(pods, key=lambda p: p.metadata.creation_timestamp)
        # Raw bytes: the client would otherwise try to decode a log that happens to be JSON as an object.
        response = self.core.read_namespaced_pod_log(
            pod.metadata.name, namespace, container=render.TRAINER_CONTAINER, tail_lines=lines,
            _preload_content=False, _request_timeout=LOG_REQUEST_TIMEOUT_SECONDS,
        )
        return response.data.decode("utf-8", errors="replace")

    def secret_keys(self, namespace: str, name: str) -> set[str] | None:
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as error:
            if _missing(error):
                return None
            raise
        return set(secret.data or {}) | set(secret.string_data or {})


def spec_problems(cluster: Cluster, namespace: str, spec: api.LoRAJobSpec) -> tuple[list[tuple[str, str]], str | None]:
    """Problems only a look at the cluster reveals, and the ClusterQueue behind the LocalQueue."""
    problems = []
    token = spec.credentials.hugging_face_token if spec.credentials else None
    if token is not None:
        keys = cluster.secret_keys(namespace, token.name)
        if keys is None:
            problems.append((
                "SecretNotFound",
                f"Secret {token.name} (spec.credentials.huggingFaceToken) does not exist in namespace {namespace}; create it",
            ))
        elif token.key not in keys:
            problems.append((
                "SecretKeyNotFound",
                f"Secret {token.name} has no key {token.key} (spec.credentials.huggingFaceToken.key); "
                f"its keys are {', '.join(sorted(keys)) or 'none'}",
            ))
    cluster_queue = None
    queue = spec.scheduling.queue_name
    if queue:
        local_queue = cluster.get(LOCAL_QUEUE, namespace, queue)
        if local_queue is None:
            problems.append((
                "LocalQueueNotFound",
                f"Kueue LocalQueue {queue} (spec.scheduling.queueName or a LoRAJobPolicy default) does not exist in namespace {namespace}; "
                "ask your admin for the queue name to use",
            ))
        else:
            cluster_queue = local_queue.get("spec", {}).get("clusterQueue")
    return problems, cluster_queue


def observe(cluster: Cluster, body: dict, now: datetime, render_settings: RenderSettings) -> Observed:
    metadata = body["metadata"]
    namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    spec, errors = render.parse_spec(body)
    children, problems, cluster_queue = {}, [], None
    policies, namespace_labels = cluster.policies(), cluster.namespace_labels(namespace)
    if spec is not None:
        defaults = policy.resolve_defaults(policies, namespace_labels, spec)
        problems, cluster_queue = spec_problems(cluster, namespace, effective_spec(spec, defaults))
        run = render.run_name(spec, name)
        names = {rules.child_name(run, phase): phase for phase in rules.phases(spec)}
        # A JobSet holding one of these names without our label is found when creating it fails (409).
        jobsets = [js for js in cluster.list(JOBSET, namespace, f"{render.LABEL_RUN}={run}") if js["metadata"]["name"] in names]
        workloads = cluster.workloads_of(namespace, jobsets)
        for jobset in jobsets:
            workload = workloads.get(jobset["metadata"]["uid"])
            child = observe_child(jobset, uid, workload)
            if child.failed and child.owned:  # only then are its pods worth reading: to name the failed container
                child = observe_child(jobset, uid, workload, cluster.pods_of(jobset))
            children[names[jobset["metadata"]["name"]]] = child
    return Observed(
        name=name,
        namespace=namespace,
        generation=metadata.get("generation", 0),
        spec=spec,
        spec_errors=errors,
        status=body.get("status") or {},
        children=children,
        problems=tuple(problems),
        cluster_queue=cluster_queue,
        now=now,
        policies=policies,
        namespace_labels=namespace_labels,
        render=render_settings,
    )


class TrainLogs:
    """Reads the lead trainer's log tail for status.progress; a log that cannot be read is logged and skipped."""

    def __init__(self, cluster: Cluster, lines: int):
        self.cluster = cluster
        self.lines = lines
        self._read_after_finish: dict[tuple[str, str], str] = {}
        """LoRAJob -> uid of its finished train JobSet whose log was read: once is enough."""
        self._last_error: dict[tuple[str, str], str] = {}

    def read(self, key: tuple[str, str], observed: Observed) -> str | None:
        train = observed.children.get("train")
        if not train_log_wanted(observed.status, train):
            return None
        if train.finished:
            if self._read_after_finish.get(key) == train.uid:
                return None
            self._read_after_finish[key] = train.uid
        try:
            tail = self.cluster.trainer_log_tail(observed.namespace, train.lead_pod_selector, self.lines)
        except (ApiException, urllib3.exceptions.HTTPError) as error:
            self._report(key, train.name, error)
            return None
        self._last_error.pop(key, None)
        return tail

    def _report(self, key: tuple[str, str], jobset: str, error: Exception) -> None:
        """Progress is best effort: say why it is missing, at INFO once per distinct error."""
        text = f"{error.status} {_api_message(error)}" if isinstance(error, ApiException) else str(error)
        level = logging.DEBUG if self._last_error.get(key) == text else logging.INFO
        self._last_error[key] = text
        log.log(level, "no progress for LoRAJob %s/%s: cannot read the trainer log of JobSet %s: %s", *key, jobset, text)

    def forget(self, key: tuple[str, str]) -> None:
        self._read_after_finish.pop(key, None)
        self._last_error.pop(key, None)


class Reconciler:
    def __init__(self, cluster: Cluster, settings: OperatorSettings):
        self.cluster = cluster
        self.settings = settings
        self.train_logs = TrainLogs(cluster, settings.reconcile.progress_log_lines)
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(key, threading.Lock())

    def reconcile(self, namespace: str, name: str, read_progress: bool = False) -> float | None:
        """One pass over one LoRAJob; returns when it wants to be looked at again (seconds), if sooner than a resync.

        `read_progress`: also read the lead trainer's log for status.progress (the resync pass asks)."""
        started = time.monotonic()
        key = (namespace, name)
        with self._lock(key):
            body = self.cluster.get(LORAJOB, namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                self.train_logs.forget(key)
                return None
            observed = observe(self.cluster, body, datetime.now(timezone.utc), self.settings.render)
            if read_progress:
                observed = dataclasses.replace(observed, train_log=self.train_logs.read(key, observed))
            decision = decide(observed, self.settings.reconcile)
            self._apply(body, observed, decision)
        log.debug("reconciled %s/%s in %.0f ms: %s", namespace, name, 1000 * (time.monotonic() - started), decision.status.get("phase"))
        return decision.requeue_after

    def _apply(self, body: dict, observed: Observed, decision: Decision) -> None:
        """Creations first (the next pass finds them either way), then status, which records a retry
        before its failed try is deleted, then deletions and events."""
        namespace, name = observed.namespace, observed.name
        for create in decision.create:
            if not self._create_child(body, observed, create.phase, create.attempt):
                return  # blocked: _create_child wrote the status that says why
        if decision.status != observed.status:
            self.cluster.custom.patch_namespaced_custom_object_status(
                *LORAJOB[:2], namespace, LORAJOB[2], name, {"status": decision.status}
            )
        for event in decision.events:
            self._event(body, event.type, event.reason, event.message)
        if decision.delete_self:
            log.info("deleting LoRAJob %s/%s: ttlSecondsAfterFinished has passed", namespace, name)
            self._delete(LORAJOB, namespace, name, "Background")
            return
        for child in decision.delete:
            log.info("deleting JobSet %s/%s", namespace, child)
            self._delete(JOBSET, namespace, child, "Foreground")

    def _delete(self, resource, namespace: str, name: str, propagation: str) -> None:
        try:
            self.cluster.custom.delete_namespaced_custom_object(
                *resource[:2], namespace, resource[2], name, propagation_policy=propagation
            )
        except ApiException as error:
            if not _missing(error):
                raise

    def _create_child(self, body: dict, observed: Observed, phase: str, attempt: int) -> bool:
        """Create the JobSet; False when it cannot be (the LoRAJob's status then says why)."""
        owner = render.Owner(observed.name, observed.namespace, body["metadata"]["uid"])
        jobset = render.render_phase(phase, observed.effective_spec, owner, self.settings.render, attempt)
        try:
            self.cluster.custom.create_namespaced_custom_object(
                *JOBSET[:2], observed.namespace, JOBSET[2], jobset, field_manager=FIELD_MANAGER
            )
            log.info("created JobSet %s/%s (%s, try %d)", observed.namespace, jobset["metadata"]["name"], phase, attempt)
            return True
        except ApiException as error:
            name = jobset["metadata"]["name"]
            if error.status == 409:
                existing = self.cluster.get(JOBSET, observed.namespace, name)
                if existing is None or render.LABEL_RUN in (existing["metadata"].get("labels") or {}):
                    return True  # ours or another LoRAJob's: the next pass reads it from the listing
                self._report_blocked(
                    body, observed, "NameTaken",
                    f"a JobSet named {name} already exists and is not controlled by this LoRAJob; "
                    "delete it or set another spec.runName",
                )
            elif error.status in (400, 403, 422):
                self._report_blocked(body, observed, "JobSetRejected", f"the API server rejected JobSet {name}: {_api_message(error)}")
            else:
                raise
            return False

    def _report_blocked(self, body: dict, observed: Observed, reason: str, message: str) -> None:
        """A child could not be created: say why in status (the spec may need a change) and an event."""
        status = dict(observed.status)
        previous = [c for c in status.get("conditions") or [] if c.get("type") == "Blocked"]
        if previous and (previous[0].get("status"), previous[0].get("reason"), previous[0].get("message")) == ("True", reason, message):
            return  # already said
        conditions = [c for c in status.get("conditions") or [] if c.get("type") != "Blocked"]
        conditions.append({
            "type": "Blocked", "status": "True", "reason": reason, "message": message,
            "lastTransitionTime": format_time(observed.now), "observedGeneration": observed.generation,
        })
        status.update(phase=api.Phase.Pending.value, message=message, conditions=conditions)
        self.cluster.custom.patch_namespaced_custom_object_status(
            *LORAJOB[:2], observed.namespace, LORAJOB[2], observed.name, {"status": status}
        )
        self._event(body, "Warning", reason, message)

    def _event(self, body: dict, event_type: str, reason: str, message: str) -> None:
        metadata = body["metadata"]
        now = datetime.now(timezone.utc)
        event = {
            "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
            "involvedObject": {
                "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND, "name": metadata["name"],
                "namespace": metadata["namespace"], "uid": metadata["uid"],
                "resourceVersion": metadata.get("resourceVersion"),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "firstTimestamp": format_time(now),
            "lastTimestamp": format_time(now),
            "count": 1,
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": FIELD_MANAGER,
        }
        try:
            self.cluster.core.create_namespaced_event(metadata["namespace"], event)
        except ApiException as error:  # an event is best effort; the status already says it
            log.warning("could not post event %s on %s: %s", reason, metadata["name"], error.reason)


def _api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body).get("message", error.reason)
    except (TypeError, ValueError):
        return str(error.reason)


class Resync:
    """Reconciles every LoRAJob every `resync_seconds`, and single ones sooner when they asked to be.

    It keeps the operator correct when a watch silently stops delivering events, picks up Kueue
    Workload changes (not watched), and drives retry backoff and TTL deadlines.
    """

    def __init__(self, reconciler: Reconciler, namespaces: list[str] | None):
        self.reconciler = reconciler
        self.namespaces = namespaces
        self.last_pass = 0.0
        self._due: dict[tuple[str, str], float] = {}
        self._due_lock = threading.Lock()  # kopf's handler threads schedule while the loop reads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lorajob-resync", daemon=True)

    def start(self) -> None:
        self.last_pass = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def schedule(self, key: tuple[str, str], after: float | None) -> None:
        if after is not None:
            with self._due_lock:
                self._due[key] = min(self._due.get(key, float("inf")), time.monotonic() + after)

    def _take_due(self, now: float) -> list[tuple[str, str]]:
        with self._due_lock:
            keys = [key for key, due in self._due.items() if due <= now]
            for key in keys:
                del self._due[key]
            return keys

    def _next_due(self) -> float:
        with self._due_lock:
            return min(self._due.values(), default=float("inf"))

    def alive(self) -> bool:
        interval = self.reconciler.settings.reconcile.resync_seconds
        return self._thread.is_alive() and time.monotonic() - self.last_pass < 5 * interval + 60

    def _run(self) -> None:
        interval = self.reconciler.settings.reconcile.resync_seconds
        next_full = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            keys = self._take_due(now)
            full_pass = now >= next_full
            if full_pass:
                keys = sorted(set(keys) | set(self._all_keys()))
                next_full = now + interval
                self.last_pass = now
            for key in keys:
                self._reconcile(key, read_progress=full_pass)
            wake = min(next_full, self._next_due())
            self._stop.wait(max(0.05, wake - time.monotonic()))

    def _all_keys(self) -> list[tuple[str, str]]:
        try:
            objects = [
                obj for namespace in (self.namespaces or [None]) for obj in self.reconciler.cluster.list(LORAJOB, namespace)
            ]
        except Exception:  # noqa: BLE001 - a failed list is retried at the next interval
            log.exception("listing LoRAJobs failed")
            return []
        return [(obj["metadata"]["namespace"], obj["metadata"]["name"]) for obj in objects]

    def _reconcile(self, key: tuple[str, str], read_progress: bool) -> None:
        try:
            self.schedule(key, self.reconciler.reconcile(*key, read_progress=read_progress))
        except Exception:  # noqa: BLE001 - one bad object must not stop the loop; it is retried
            log.exception("reconciling LoRAJob %s/%s failed", *key)
            self.schedule(key, self.reconciler.settings.reconcile.blocked_recheck_seconds)
