"""kopf's watches fill the operator's caches (caches.py) and wake its controller (controller.loop).

For each cached resource kopf lists it, watches it from there (in the watched namespaces; cluster-wide for
cluster-scoped resources), resumes a watch the API server ends, lists again after 410 Gone, replaces a
watch silent for `WatchSettings.client_timeout_seconds`, and hands the events of one object over in order.
Two handlers per resource take them:
- an index handler stores every listed or changed object and tells the controller of a change. It leaves
  kopf's own index empty: the controller's worker threads read the caches, and kopf's indexes, changed on
  its event loop without a lock, are not made to be read from threads. kopf calls no other handler before
  every index handler has seen every listed object;
- so the first call of an event handler tells the controller that its caches are complete (it comes with the
  namespaces' first events: there always are some); the event handler also drops a deleted object and tells
  of it. kopf's diffing of objects for change-detecting handlers is switched off (`NothingToDiff`).

A gap kopf does not cover: after a re-list (410 Gone) kopf delivers the objects that exist, but no deletion
of those that went while it was not watching; controller.sweep drops such objects from the caches.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from lorajob_operator import caches
from lorajob_operator.settings import WatchSettings


WORKER_IDLE_SECONDS = 0.3
"""How long kopf keeps an object's worker task (and with it the last event's full body) after its last event.
kopf's default, 5 s, held the full bodies of every object changed in the last 5 s of a 1,000-LoRAJob burst:
about 15 MiB more peak RSS. Our handlers return at once, so a worker has nothing to wait for; an object's next
event starts a new one."""


class NothingToDiff(kopf.DiffBaseStorage):
    """The essence kopf diffs for change-detecting handlers (on.create/update/...): none are registered, so
    there is nothing to diff, and kopf need not deep-copy every event's body to find that out."""

    def build(self, *, body: kopf.Body, extra_fields=None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        pass


def configure(settings: kopf.OperatorSettings, ours: WatchSettings) -> None:
    settings.persistence.diffbase_storage = NothingToDiff()
    settings.queueing.idle_timeout = WORKER_IDLE_SECONDS
    settings.watching.server_timeout = ours.server_timeout_seconds
    settings.watching.client_timeout = ours.client_timeout_seconds  # a healthy watch ends before (server_timeout)
    settings.watching.inactivity_timeout = ours.client_timeout_seconds
    settings.watching.connect_timeout = ours.connect_timeout_seconds
    settings.networking.request_timeout = ours.request_timeout_seconds
    # kopf logs every handler call at INFO: thousands of lines in a burst, and a share of the operator's CPU.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)


async def cache(body: kopf.Body, memo: kopf.Memo, param: caches.Resource, **_: Any) -> dict:
    memo.controller.watched(param, None, dict(body))
    return {}  # nothing for kopf's own index


async def see(event: kopf.RawEvent, memo: kopf.Memo, param: caches.Resource, **_: Any) -> None:
    memo.controller.synced()
    if event["type"] == "DELETED":
        memo.controller.watched(param, "DELETED", event["object"])


def deleted(event: kopf.RawEvent, **_: Any) -> bool:
    return event["type"] == "DELETED"


for _resource in caches.RESOURCES:
    kopf.index(_resource.group_version, _resource.plural, id=f"cache-{_resource.name}", param=_resource)(cache)
    # Every event of the namespaces (there are always some, so the first says the caches are complete; they
    # change rarely); of the other resources only deletions, so a burst costs one handler call per event.
    kopf.on.event(_resource.group_version, _resource.plural, id=f"see-{_resource.name}", param=_resource,
                  when=None if _resource is caches.NAMESPACES else deleted)(see)
