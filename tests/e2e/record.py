"""A watch-based record of every version of a namespace's JobSets and LoRAJobs (what existed, and when),
for tests that must judge a whole history rather than a final snapshot."""

from __future__ import annotations

import threading
import time

WATCH_SECONDS = 60
RECONNECT_PAUSE = 0.2
Versions = list[tuple[float, dict]]
"""(time.monotonic() when seen, object) for every version of some objects seen, in order."""


class Record:
    """Every version of the namespace's JobSets and LoRAJobs ever seen: a list, then a watch from its
    resourceVersion that survives kube-apiserver restarting (it resumes where it stopped, or lists again
    when that resourceVersion is gone; `relists` counts those)."""

    RESOURCES = {"jobsets": ("jobset.x-k8s.io", "v1alpha2"), "lorajobs": ("lorajob.dev", "v1alpha1")}

    def __init__(self, api_client, namespace: str):
        from kubernetes import client

        self._api = client.CustomObjectsApi(api_client)
        self.namespace = namespace
        self._seen: dict[str, Versions] = {plural: [] for plural in self.RESOURCES}
        self.relists = 0
        self.deleted: dict[str, dict[str, float]] = {plural: {} for plural in self.RESOURCES}
        """Per resource: uid -> time.time() (wall clock, to compare with the objects' timestamps) when its
        deletion was seen."""
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        self._listed = {plural: threading.Event() for plural in self.RESOURCES}
        self._watches: list = []
        self._threads = [threading.Thread(target=self._follow, args=(plural,), daemon=True) for plural in self.RESOURCES]

    def __enter__(self) -> Record:
        """Start watching; return once the first lists are in (what happens from then on is recorded)."""
        from lorajob_devcluster import wait_for

        for thread in self._threads:
            thread.start()
        wait_for(self.listed, 30, "the JobSet and LoRAJob watches listing")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def listed(self) -> bool:
        """Whether each resource's first list is in (the watches run from there)."""
        return all(event.is_set() for event in self._listed.values())

    def stop(self) -> None:
        """The watch threads end at their next event or timeout (they are daemons: nobody waits)."""
        self._stopped.set()
        for watch in list(self._watches):
            watch.stop()

    def _add(self, plural: str, obj: dict, at: float | None = None) -> None:
        with self._changed:
            self._seen[plural].append((time.monotonic() if at is None else at, obj))
            self._changed.notify_all()

    def _list(self, plural: str) -> str:
        group, version = self.RESOURCES[plural]
        listing = self._api.list_namespaced_custom_object(group, version, self.namespace, plural)
        listed_at = time.monotonic()  # one moment for the whole listing: the order of its items says nothing
        for obj in listing["items"]:
            self._add(plural, obj, listed_at)
        self._listed[plural].set()
        return listing["metadata"]["resourceVersion"]

    def _follow(self, plural: str) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        group, version = self.RESOURCES[plural]
        resource_version = None
        while not self._stopped.is_set():
            try:
                if resource_version is None:
                    resource_version = self._list(plural)
                stream = watch.Watch()
                self._watches.append(stream)
                for event in stream.stream(
                    self._api.list_namespaced_custom_object, group, version, self.namespace, plural,
                    resource_version=resource_version, allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS,
                ):
                    resource_version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._add(plural, event["object"])
                    if event["type"] == "DELETED":
                        self.deleted[plural][event["object"]["metadata"]["uid"]] = time.time()
            except ApiException as error:
                if error.status == 410:  # the resourceVersion is gone: list again
                    resource_version = None
                    self.relists += 1
                else:
                    self._stopped.wait(RECONNECT_PAUSE)
            except Exception:  # noqa: BLE001 - the API server is down or restarting: reconnect
                self._stopped.wait(RECONNECT_PAUSE)

    def versions(self, plural: str) -> Versions:
        with self._changed:
            return list(self._seen[plural])

    def latest(self, plural: str) -> dict[str, dict]:
        """The last version seen of each object, by name."""
        return {obj["metadata"]["name"]: obj for _, obj in self.versions(plural)}

    def phase_changes(self) -> list[tuple[float, str, str]]:
        """(time, LoRAJob, new phase) for every phase transition seen, in order."""
        changes, last = [], {}
        for at, obj in self.versions("lorajobs"):
            name, phase = obj["metadata"]["name"], (obj.get("status") or {}).get("phase")
            if phase and last.get(name) != phase:
                changes.append((at, name, phase))
                last[name] = phase
        return changes
