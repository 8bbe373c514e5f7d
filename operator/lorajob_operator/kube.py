"""The operator's I/O: the caches observe reads, the writes that carry out a `reconcile.decide.Decision`, and the loop.

`Controller` runs it all: watch-fed caches (caches.py), a work queue of LoRAJob keys fed by the caches'
change events and by `Resync`, and worker threads that run `Reconciler.reconcile` (one pass over one
LoRAJob; the queue never hands the same LoRAJob to two workers at once). A pass reads the caches only,
so a pass over a LoRAJob whose world has not changed sends no request at all; its own writes are put
into the caches at once (the watch event that follows is then no change). Only the resync pass and a
pass a LoRAJob asked for (a deadline) read the lead trainer's log for progress, so each log is read
about once per resync interval however many events arrive.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import time
from datetime import datetime, timezone

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lorajob_operator import api, caches, policy, render, rules
from lorajob_operator.caches import Caches, Key
from lorajob_operator.leader import LeaderElector, NoElection, NotLeader
from lorajob_operator.metrics import Metrics
from lorajob_operator.reconcile.conditions import format_time
from lorajob_operator.reconcile.decide import TERMINAL_PHASES, Decision, decide
from lorajob_operator.reconcile.kueue import QueuePosition
from lorajob_operator.reconcile.observed import Observed, effective_spec, observe_child
from lorajob_operator.reconcile.trainer_output import checks_log_wanted, checks_step, train_log_wanted
from lorajob_operator.settings import OperatorSettings, RenderSettings

log = logging.getLogger("lorajob.operator")

JOBSET = (render.JOBSET_GROUP, render.JOBSET_VERSION, render.JOBSET_PLURAL)
LORAJOB = (api.GROUP, api.VERSION, api.PLURAL)
FIELD_MANAGER = "lorajob-operator"
LOG_REQUEST_TIMEOUT_SECONDS = 10


def _missing(error: ApiException) -> bool:
    return error.status == 404


class Cluster:
    """Thin typed access to the objects the operator writes, and the reads no cache holds (pods, logs)."""

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

    def pods_of(self, jobset: str, namespace: str) -> list[dict]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"{render.JOBSET_NAME_LABEL}={jobset}")
        return [self.core.api_client.sanitize_for_serialization(pod) for pod in pods.items]

    def trainer_log_tail(self, namespace: str, pod_selector: str, lines: int | None) -> str | None:
        """The last `lines` lines (None: all) of the trainer container's log in the newest pod matching
        `pod_selector` (None: no such pod yet or any more)."""
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


def status_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch that turns status `old` into `new`: a field `new` lacks is removed (null), also
    inside objects (a merge patch alone would keep it, e.g. the stall watchdog's status.progress.advancedTime)."""
    patch: dict = {key: None for key in old.keys() - new.keys()}
    for key, value in new.items():
        both_objects = isinstance(value, dict) and isinstance(old.get(key), dict)
        patch[key] = status_patch(old[key], value) if both_objects else value
    return patch


def spec_problems(view: Caches, namespace: str, spec: api.LoRAJobSpec) -> tuple[list[tuple[str, str]], str | None]:
    """Problems only a look at the cluster reveals, and the ClusterQueue behind the LocalQueue."""
    problems = []
    cluster_queue = None
    queue = spec.scheduling.queue_name
    if queue:
        local_queue = view.local_queue(namespace, queue)
        if local_queue is None:
            problems.append((
                "LocalQueueNotFound",
                f"Kueue LocalQueue {queue} (spec.scheduling.queueName or a LoRAJobPolicy default) does not exist in namespace {namespace}; "
                "ask your admin for the queue name to use",
            ))
        else:
            cluster_queue = local_queue.get("spec", {}).get("clusterQueue")
    return problems, cluster_queue


def _newest_workload(view: Caches, namespace: str, jobset: dict) -> dict | None:
    workloads = view.workloads_of(namespace, jobset["metadata"]["uid"])
    return max(workloads, key=lambda w: w["metadata"]["creationTimestamp"], default=None)


def _queue_position(view: Caches, workload: dict | None) -> QueuePosition | None:
    found = workload and view.queue_position(workload["metadata"]["namespace"], workload["metadata"]["name"])
    return QueuePosition(found, namespaces=tuple(view.namespaces or ())) if found else None


def observe(
    view: Caches, body: dict, now: datetime, render_settings: RenderSettings,
    failed_pods: dict[str, list[dict]] | None = None,
) -> Observed:
    """What exists, from the caches only (pure: no request). `failed_pods`: the pods of failed children, by
    JobSet name, read by the caller when it wants the failed container named."""
    metadata = body["metadata"]
    namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    spec, errors = render.parse_spec(body)
    children, problems, cluster_queue = {}, [], None
    policies, namespace_labels = view.policies(), view.namespace_labels(namespace)
    if spec is not None:
        defaults = policy.resolve_defaults(policies, namespace_labels, spec)
        problems, cluster_queue = spec_problems(view, namespace, effective_spec(spec, defaults))
        run = render.run_name(spec, name)
        names = {rules.child_name(run, phase): phase for phase in rules.phases(spec)}
        # A JobSet holding one of these names without our label is found when creating it fails (409).
        for jobset in view.jobsets_of_run(namespace, run):
            jobset_name = jobset["metadata"]["name"]
            if jobset_name in names:
                workload = _newest_workload(view, namespace, jobset)
                children[names[jobset_name]] = observe_child(
                    jobset, uid, workload, (failed_pods or {}).get(jobset_name), _queue_position(view, workload)
                )
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
    """Reads the lead trainer's log tail for status.progress, and the check or convert pod's log once for
    status.data and status.plan; a log that cannot be read is logged and skipped."""

    def __init__(self, cluster: Cluster, lines: int):
        self.cluster = cluster
        self.lines = lines
        self._read_after_finish: dict[tuple[str, str], str] = {}
        """LoRAJob -> uid of its finished train JobSet whose log was read: once is enough."""
        self._checks_read: dict[tuple[str, str], str] = {}
        """LoRAJob -> uid of its completed check or convert JobSet whose log was read for the checks' figures."""
        self._last_error: dict[tuple[str, str], str] = {}

    def read_checks(self, key: tuple[str, str], observed: Observed) -> str | None:
        """The whole log of the completed check or convert step (the checks' lines come first), once per JobSet."""
        step = checks_step(observed.children)
        if not checks_log_wanted(observed.status, step) or self._checks_read.get(key) == step.uid:
            return None
        self._checks_read[key] = step.uid
        try:
            return self.cluster.trainer_log_tail(observed.namespace, step.lead_pod_selector, None)
        except (ApiException, urllib3.exceptions.HTTPError) as error:
            self._report(key, step.name, error)
            return None

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
        self._checks_read.pop(key, None)
        self._last_error.pop(key, None)


class Reconciler:
    """One pass over one LoRAJob: observe (caches) -> decide -> apply (writes, put into the caches at once)."""

    def __init__(self, cluster: Cluster, view: Caches, settings: OperatorSettings):
        self.cluster = cluster
        self.view = view
        self.settings = settings
        self.train_logs = TrainLogs(cluster, settings.reconcile.progress_log_lines)

    def reconcile(self, namespace: str, name: str, read_progress: bool = False) -> float | None:
        """Returns when the LoRAJob wants to be looked at again (seconds), if sooner than a resync.

        `read_progress`: also read the lead trainer's log for status.progress, and the completed check or
        convert step's log for status.data and status.plan (the resync pass asks)."""
        key = (namespace, name)
        body = self.view.lorajob(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.train_logs.forget(key)
            return None
        now = datetime.now(timezone.utc)
        observed = observe(self.view, body, now, self.settings.render)
        failed = [c for c in observed.children.values() if c.failed and c.owned]
        if failed and observed.status.get("phase") not in TERMINAL_PHASES:
            # Only then are its pods worth reading: to name the failed container.
            pods = {child.name: self.cluster.pods_of(child.name, namespace) for child in failed}
            observed = observe(self.view, body, now, self.settings.render, pods)
        if read_progress:
            observed = dataclasses.replace(
                observed, train_log=self.train_logs.read(key, observed), checks_log=self.train_logs.read_checks(key, observed)
            )
        decision = decide(observed, self.settings.reconcile)
        self._apply(body, observed, decision)
        return decision.requeue_after

    def _apply(self, body: dict, observed: Observed, decision: Decision) -> None:
        """Creations first (the next pass finds them either way), then status, which records a retry
        before its failed try is deleted, then deletions and events."""
        namespace, name = observed.namespace, observed.name
        for create in decision.create:
            rejection = self._create_child(body, observed, create.phase, create.attempt)
            if rejection is not None:  # an observed fact like any other: decide says what it means
                blocked = dataclasses.replace(observed, problems=(*observed.problems, rejection))
                self._apply(body, blocked, decide(blocked, self.settings.reconcile))
                return
        if decision.create and not (decision.delete or decision.delete_self) and _unobserved(body):
            # A new or edited LoRAJob's next JobSet: its status and events follow in the pass that the JobSet's
            # watch event queues behind the other new LoRAJobs, so a burst costs one request per LoRAJob up front.
            return
        if decision.status != observed.status:
            self._write_status(observed, decision.status)
        for event in decision.events:
            self._event(body, event.type, event.reason, event.message)
        if decision.delete_self:
            log.info("deleting LoRAJob %s/%s: ttlSecondsAfterFinished has passed", namespace, name)
            self._delete(LORAJOB, namespace, name, "Background")
            return
        for child in decision.delete:
            log.info("deleting JobSet %s/%s", namespace, child)
            self._delete(JOBSET, namespace, child, "Foreground")

    def _write_status(self, observed: Observed, status: dict) -> None:
        written = self.cluster.custom.patch_namespaced_custom_object_status(
            *LORAJOB[:2], observed.namespace, LORAJOB[2], observed.name, {"status": status_patch(observed.status, status)}
        )
        self.view.stores[caches.LORAJOBS].upsert(written)

    def _delete(self, resource, namespace: str, name: str, propagation: str) -> None:
        try:
            self.cluster.custom.delete_namespaced_custom_object(
                *resource[:2], namespace, resource[2], name, propagation_policy=propagation
            )
        except ApiException as error:
            if not _missing(error):
                raise

    def _create_child(self, body: dict, observed: Observed, phase: str, attempt: int) -> tuple[str, str] | None:
        """Create the JobSet; (reason, message) when the API server refuses it for a reason the spec can fix."""
        owner = render.Owner(observed.name, observed.namespace, body["metadata"]["uid"])
        jobset = render.render_phase(phase, observed.effective_spec, owner, self.settings.render, attempt)
        try:
            created = self.cluster.custom.create_namespaced_custom_object(
                *JOBSET[:2], observed.namespace, JOBSET[2], jobset, field_manager=FIELD_MANAGER
            )
            self.view.stores[caches.JOBSETS].upsert(created)
            log.info("created JobSet %s/%s (%s, try %d)", observed.namespace, jobset["metadata"]["name"], phase, attempt)
            return None
        except ApiException as error:
            name = jobset["metadata"]["name"]
            if error.status == 409:
                existing = self.cluster.get(JOBSET, observed.namespace, name)
                if existing is None or render.LABEL_RUN in (existing["metadata"].get("labels") or {}):
                    return None  # ours or another LoRAJob's: the next pass reads it from the listing
                return ("NameTaken", f"a JobSet named {name} already exists and is not controlled by this LoRAJob; "
                        "delete it or set another spec.runName")
            if error.status in (400, 403, 422):
                return "JobSetRejected", f"the API server rejected JobSet {name}: {_api_message(error)}"
            raise

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


class WorkQueue:
    """LoRAJob keys waiting for a pass, each at most once; a key being worked on is handed out again only
    after `done` (so passes over one LoRAJob never overlap). A key asked for with `read_progress` keeps it.

    A key added `urgent` (a LoRAJob whose spec no pass has acted on yet: new or edited) goes ahead of the
    others, which only follow up on children and time: in a burst the first JobSets are not queued behind
    the follow-ups of earlier LoRAJobs, and those follow-ups coalesce while they wait."""

    def __init__(self) -> None:
        self._urgent_order: collections.deque[Key] = collections.deque()
        self._order: collections.deque[Key] = collections.deque()
        self._waiting: dict[Key, bool] = {}
        """Key -> read_progress, for every key queued or re-added while being worked on."""
        self._urgent: set[Key] = set()
        """The waiting keys added urgent."""
        self._working: set[Key] = set()
        self._changed = threading.Condition()
        self._closed = False

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, key: Key, read_progress: bool = False, urgent: bool = False) -> None:
        with self._changed:
            if key in self._waiting:
                self._waiting[key] |= read_progress
                if urgent and key not in self._urgent:
                    self._urgent.add(key)
                    if key not in self._working:
                        self._order.remove(key)
                        self._urgent_order.append(key)
                return
            self._waiting[key] = read_progress
            if urgent:
                self._urgent.add(key)
            if key not in self._working:
                self._enqueue(key)

    def _enqueue(self, key: Key) -> None:
        (self._urgent_order if key in self._urgent else self._order).append(key)
        self._changed.notify()

    def get(self) -> tuple[Key, bool] | None:
        """The next key and its read_progress (blocks; None once closed)."""
        with self._changed:
            while not (self._urgent_order or self._order) and not self._closed:
                self._changed.wait()
            if self._closed:
                return None
            key = (self._urgent_order or self._order).popleft()
            self._urgent.discard(key)
            self._working.add(key)
            return key, self._waiting.pop(key)

    def done(self, key: Key) -> None:
        with self._changed:
            self._working.discard(key)
            if key in self._waiting:
                self._enqueue(key)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class Resync:
    """Queues every cached LoRAJob every `resync_seconds`, and single ones sooner when a pass asked to be
    looked at again (retry backoff, TTL, a blocked LoRAJob's recheck, the stall watchdog's deadline), both
    with read_progress.

    It reads the caches only: it re-runs decide on what the watches delivered, which catches an event
    whose pass was lost or failed, and drives time-based decisions (deadlines, TTL, backoff)."""

    def __init__(self, view: Caches, queue: WorkQueue, interval: float):
        self.view = view
        self.queue = queue
        self.interval = interval
        self.last_pass = 0.0
        self._due: dict[Key, float] = {}
        self._due_lock = threading.Lock()  # worker threads schedule while the loop reads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lorajob-resync", daemon=True)

    def start(self) -> None:
        self.last_pass = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def schedule(self, key: Key, after: float | None) -> None:
        if after is not None:
            with self._due_lock:
                self._due[key] = min(self._due.get(key, float("inf")), time.monotonic() + after)

    def _take_due(self, now: float) -> list[Key]:
        with self._due_lock:
            keys = [key for key, due in self._due.items() if due <= now]
            for key in keys:
                del self._due[key]
            return keys

    def _next_due(self) -> float:
        with self._due_lock:
            return min(self._due.values(), default=float("inf"))

    def alive(self) -> bool:
        return self._thread.is_alive() and time.monotonic() - self.last_pass < 5 * self.interval + 60

    def _run(self) -> None:
        next_full = time.monotonic() + self.interval
        while not self._stop.is_set():
            now = time.monotonic()
            for key in self._take_due(now):
                # With the log: the stall watchdog's deadline pass judges the trainer's newest step.
                self.queue.add(key, read_progress=True)
            if now >= next_full:
                for body in self.view.lorajobs():
                    self.queue.add(caches.key_of(body), read_progress=True)
                next_full = now + self.interval
                self.last_pass = now
            self._stop.wait(max(0.05, min(next_full, self._next_due()) - time.monotonic()))


class Controller:
    """Caches, work queue, workers and resync: the whole operator loop (kopf only hosts it, handlers.py).

    Every replica fills its caches; passes run only while `leadership` says this replica leads (its
    writes are refused otherwise, by the API client that `leadership.leading` gates). On becoming the
    leader it queues every LoRAJob, as after the first sync."""

    def __init__(self, api_client: client.ApiClient, settings: OperatorSettings, namespaces: list[str] | None,
                 metrics: Metrics, leadership: LeaderElector | NoElection | None = None):
        self.api_client = api_client
        self.settings = settings
        self.metrics = metrics
        self.leadership = leadership or NoElection()
        self.caches = Caches(namespaces)
        self.reconciler = Reconciler(Cluster(api_client), self.caches, settings)
        self.queue = WorkQueue()
        self.resync = Resync(self.caches, self.queue, settings.reconcile.resync_seconds)
        self._synced = threading.Event()
        """Set once every cache has listed: change events queue passes from then on."""
        self._running = threading.Event()
        """Set once the workers and the resync loop run."""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"lorajob-worker-{index}", daemon=True)
            for index in range(settings.reconcile.workers)
        ]
        self._starter = threading.Thread(target=self._start_when_synced, name="lorajob-start", daemon=True)
        metrics.describe_state(self._state)

    def start(self) -> None:
        self.caches.start(self.api_client, self._on_change, self.settings.watch)
        self._starter.start()

    def _start_when_synced(self) -> None:
        """Workers start once every cache has listed: a pass over half-filled caches would re-create children."""
        if not self.caches.wait_synced(self._stop):
            return
        self._synced.set()
        for thread in self._threads:
            thread.start()
        self.resync.start()
        log.info("caches synced: %s", ", ".join(f"{r.name}={len(s)}" for r, s in self.caches.stores.items()))
        # Only a replica with full caches campaigns: a leader with half-filled ones would re-create children.
        self.leadership.start(self._lead, lambda: None)
        self._running.set()

    def _lead(self) -> None:
        """This replica has just become the leader: every LoRAJob gets a pass."""
        for body in self.caches.lorajobs():
            self.queue.add(caches.key_of(body), read_progress=True, urgent=_unobserved(body))

    def stop(self) -> None:
        """Stops writing first, then the passes; then hands the Lease on (a standby takes over at its next
        look) before the watches stop."""
        self._stop.set()
        self.leadership.stop()
        self.resync.stop()
        self.queue.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=10)
        self.leadership.release()
        self.caches.stop()

    def alive(self) -> bool:
        """Every watch, worker, the resync loop and the campaign run (until they start: every watch runs)."""
        if not self.caches.alive():
            return False
        if not self._running.is_set():
            return True
        return self.resync.alive() and self.leadership.alive() and all(thread.is_alive() for thread in self._threads)

    def _on_change(self, resource: caches.Resource, obj: dict) -> None:
        """A cached object changed: queue the LoRAJobs whose pass reads it (a standby only caches it)."""
        if not self._synced.is_set() or not self.leadership.leading():
            return  # the first pass over every LoRAJob follows the sync, or this replica's leadership
        urgent = resource is caches.LORAJOBS and _unobserved(obj)
        for key in self._affected(resource, obj):
            self.queue.add(key, urgent=urgent)

    def _affected(self, resource: caches.Resource, obj: dict) -> list[Key]:
        namespace, name = caches.key_of(obj)
        if resource is caches.LORAJOBS:
            return [(namespace, name)]
        if resource is caches.JOBSETS:
            return _controllers(obj, api.KIND)
        if resource is caches.WORKLOADS:
            # Only its own LoRAJob: the other queued LoRAJobs' positions follow at the resync, so a busy queue
            # costs one pass per LoRAJob per resync interval, not one per LoRAJob per Workload event.
            owners = [self.caches.jobset(namespace, jobset) for _, jobset in _controllers(obj, "JobSet")]
            return [key for owner in owners if owner is not None for key in _controllers(owner, api.KIND)]
        if resource is caches.NAMESPACES:
            namespace = name
        scope = None if resource is caches.POLICIES else namespace
        return [caches.key_of(body) for body in self.caches.lorajobs(scope)]

    def _work(self) -> None:
        while (item := self.queue.get()) is not None:
            key, read_progress = item
            if not self.leadership.leading():  # queued by the resync; the leader's first pass covers it
                self.queue.done(key)
                continue
            started = time.monotonic()
            try:
                after, result = self.reconciler.reconcile(*key, read_progress=read_progress), "ok"
            except NotLeader as refused:  # the Lease was lost during the pass; whoever holds it now redoes it
                log.info("pass over LoRAJob %s/%s stopped: %s", *key, refused)
                after, result = None, "not-leader"
            except Exception:  # noqa: BLE001 - one bad object must not stop the loop; it is retried
                log.exception("reconciling LoRAJob %s/%s failed", *key)
                after, result = self.settings.reconcile.blocked_recheck_seconds, "error"
            finally:
                self.queue.done(key)
            self.metrics.reconciles.labels(result).inc()
            self.metrics.reconcile_seconds.observe(time.monotonic() - started)
            self.resync.schedule(key, after)

    def _state(self) -> dict[str, dict[str, float]]:
        phases = collections.Counter(
            _phase(body) or "Unknown" for body in self.caches.lorajobs()
        )
        restarts = collections.Counter()
        for informer in self.caches.informers:
            restarts[informer.resource.name] += informer.restarts
        return {
            "cache_objects": {resource.name: len(store) for resource, store in self.caches.stores.items()},
            "lorajobs": dict(phases),
            "work_queue_depth": {"": len(self.queue)},
            "watch_restarts": dict(restarts),
            "leader": {"": float(self.leadership.leading())},
            "leadership_acquired": {"": float(self.leadership.transitions)},
        }


def _phase(body: dict) -> str | None:
    return (body.get("status") or {}).get("phase")


def _unobserved(body: dict) -> bool:
    """No pass has acted on the LoRAJob's spec yet (it is new, or was edited since)."""
    return (body.get("status") or {}).get("observedGeneration") != body["metadata"].get("generation")


def _controllers(obj: dict, kind: str) -> list[Key]:
    """The (namespace, name) of the controller of `obj`, if it is of `kind`."""
    return [
        (obj["metadata"]["namespace"], owner["name"])
        for owner in obj["metadata"].get("ownerReferences") or []
        if owner.get("kind") == kind and owner.get("controller")
    ]
