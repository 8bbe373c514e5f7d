"""Deletions a watch missed: cached objects the API server no longer has, found by a metadata-only list.

After a watch's resourceVersion expires (410 Gone) kopf lists the resource again and delivers the objects that
exist, but no deletion of the ones removed while it was not watching. Left in the cache, such a LoRAJob would
keep getting passes and a deleted JobSet would look like a running step. Every `WatchSettings.sweep_seconds`
each cache is compared with a metadata-only list of its resource (uids only: no specs or statuses are sent),
and an object listed nowhere that is still what the cache held before the list was sent is dropped as if
its deletion had arrived. An object that changed since (a newer event, a re-creation under the same name)
was seen by a live watch and is kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lorajob_operator import caches
from lorajob_operator.caches import Caches
from lorajob_operator.controller.cluster import Cluster

log = logging.getLogger("lorajob.operator")


class Sweep:
    def __init__(self, cluster: Cluster, view: Caches, interval: float,
                 dropped: Callable[[caches.Resource, dict], None]):
        self.cluster = cluster
        self.view = view
        self.interval = interval
        self.dropped = dropped
        """Called with each object dropped (the controller queues the LoRAJobs whose pass read it)."""
        self._next = time.monotonic() + interval

    def due(self) -> None:
        """Sweeps when `interval` has passed since the last sweep (never when it is 0)."""
        if self.interval <= 0 or time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.interval
        self.run()

    def run(self) -> int:
        """One sweep of every cache; the number of objects dropped."""
        return sum(self._sweep(resource) for resource in caches.RESOURCES)

    def _sweep(self, resource: caches.Resource) -> int:
        cached = self.view.stores[resource].items()
        if not cached:
            return 0
        if resource.namespaced and self.view.namespaces is not None:
            scopes: list[str | None] = sorted({obj["metadata"]["namespace"] for obj in cached})
        else:
            scopes = [None]
        present: set[str] = set()
        for scope in scopes:
            present |= self.cluster.uids(resource, scope)
        dropped = 0
        for obj in cached:
            if obj["metadata"].get("uid") in present:
                continue
            removed = self.view.stores[resource].remove_unchanged(obj)
            if removed is not None:
                dropped += 1
                log.warning("dropped %s %s from the cache: the API server no longer has it (its deletion was "
                            "missed)", resource.name, "/".join(filter(None, caches.key_of(removed))))
                self.dropped(resource, removed)
        return dropped
