"""The operator's loop: caches (fed by kopf's watches), work queue, worker threads, resync and leadership
(`Controller`)."""

from __future__ import annotations

import collections
import logging
import threading
import time

from kubernetes import client

from lorajob_operator import api, caches
from lorajob_operator.caches import Caches, Key
from lorajob_operator.controller.cluster import Cluster
from lorajob_operator.controller.kueue_visibility import KueueVisibility
from lorajob_operator.controller.reconciler import Reconciler, unobserved
from lorajob_operator.controller.sweep import Sweep
from lorajob_operator.controller.work_queue import Resync, WorkQueue
from lorajob_operator.leader import LeaderElector, NoElection, NotLeader
from lorajob_operator.metrics import Metrics
from lorajob_operator.settings import OperatorSettings

log = logging.getLogger("lorajob.operator")


class Controller:
    """Caches, work queue, workers and resync: the operator's loop (kopf's watches feed it, watches.py).

    Every replica fills its caches; passes run only while `leadership` says this replica leads (its
    writes are refused otherwise, by the API client that `leadership.leading` gates). On becoming the
    leader it queues every LoRAJob, as after the first sync."""

    def __init__(self, api_client: client.ApiClient, settings: OperatorSettings, namespaces: list[str] | None,
                 metrics: Metrics, leadership: LeaderElector | NoElection | None = None):
        self.settings = settings
        self.metrics = metrics
        self.leadership = leadership or NoElection()
        self.caches = Caches(namespaces)
        cluster = Cluster(api_client)
        self.reconciler = Reconciler(cluster, self.caches, settings)
        self.kueue_visibility = KueueVisibility(cluster, self.caches)
        self.queue = WorkQueue()
        self.sweep = Sweep(cluster, self.caches, settings.watch.sweep_seconds, self._dropped)
        self.resync = Resync(self.caches, self.queue, settings.reconcile.resync_seconds, self._before_full_pass)
        self._synced = threading.Event()
        """Set once every cache has listed (`synced`): change events queue passes from then on."""
        self.running = threading.Event()
        """Set once the workers and the resync loop run."""
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"lorajob-worker-{index}", daemon=True)
            for index in range(settings.reconcile.workers)
        ]
        self._starting = threading.Lock()
        metrics.describe_state(self._state)

    def watched(self, resource: caches.Resource, event_type: str | None, obj: dict) -> None:
        """A watch event (watches.py): into the caches; a change queues the LoRAJobs whose pass reads it."""
        changed = self.caches.apply(resource, event_type, obj)
        if changed is not None:
            self._on_change(resource, changed)

    def synced(self) -> None:
        """Every cache has listed (watches.py): the workers and the resync start, and this replica campaigns.

        Not before: a pass over half-filled caches would re-create children, and a leader with half-filled
        ones would too."""
        if self._synced.is_set():
            return
        with self._starting:
            if self._synced.is_set() or self._stop.is_set():
                return
            self._synced.set()
        for thread in self._threads:
            thread.start()
        self.resync.start()
        log.info("caches synced: %s", ", ".join(f"{r.name}={len(s)}" for r, s in self.caches.stores.items()))
        self.leadership.start(self._lead, lambda: None)
        self.running.set()

    def _lead(self) -> None:
        """This replica has just become the leader: every LoRAJob gets a pass."""
        for body in self.caches.lorajobs():
            self.queue.add(caches.key_of(body), read_progress=True, urgent=unobserved(body))

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

    def alive(self) -> bool:
        """Every worker, the resync loop and the campaign run (kopf stops the operator when a watch fails)."""
        if not self.running.is_set():
            return True
        return self.resync.alive() and self.leadership.alive() and all(thread.is_alive() for thread in self._threads)

    def _on_change(self, resource: caches.Resource, obj: dict) -> None:
        """A cached object changed: queue the LoRAJobs whose pass reads it (a standby only caches it)."""
        if not self._synced.is_set() or not self.leadership.leading():
            return  # the first pass over every LoRAJob follows the sync, or this replica's leadership
        urgent = resource is caches.LORAJOBS and unobserved(obj)
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

    def _before_full_pass(self) -> None:
        """The sweep for missed deletions when due (every replica: each has caches), then Kueue's queue positions
        (the leader's: they end up in status)."""
        try:
            self.sweep.due()
        except Exception:
            log.exception("comparing the caches with the API server's lists failed")
        if not self.leadership.leading():
            return
        try:
            self.kueue_visibility.refresh()
        except Exception:
            log.exception("reading queue positions from Kueue's visibility API failed")

    def _dropped(self, resource: caches.Resource, obj: dict) -> None:
        """The sweep found `obj` deleted: as if its deletion had been watched."""
        self.metrics.cache_swept.labels(resource.name).inc()
        self._on_change(resource, obj)

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
            except Exception:
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
        return {
            "cache_objects": {resource.name: len(store) for resource, store in self.caches.stores.items()},
            "lorajobs": dict(phases),
            "work_queue_depth": {"": len(self.queue)},
            "leader": {"": float(self.leadership.leading())},
            "leadership_acquired": {"": float(self.leadership.transitions)},
        }


def _phase(body: dict) -> str | None:
    return (body.get("status") or {}).get("phase")


def _controllers(obj: dict, kind: str) -> list[Key]:
    """The (namespace, name) of the controller of `obj`, if it is of `kind`."""
    return [
        (obj["metadata"]["namespace"], owner["name"])
        for owner in obj["metadata"].get("ownerReferences") or []
        if owner.get("kind") == kind and owner.get("controller")
    ]
