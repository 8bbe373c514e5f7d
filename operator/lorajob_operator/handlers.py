"""kopf wiring: watch LoRAJobs and their JobSets, and hand every change to `Reconciler.reconcile`.

Only event handlers are used, so kopf writes nothing on the objects (no progress annotations, no
diff base, no finalizer): the state lives in the cluster and in LoRAJob status. A resync thread
re-lists all LoRAJobs periodically, which also covers a watch that silently died.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client, config

from lorajob_operator import api, render
from lorajob_operator.kube import Cluster, Reconciler, Resync
from lorajob_operator.settings import OperatorSettings

KOPF_ANNOTATION_PREFIX = "kopf.lorajob.dev"


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    ours = OperatorSettings.from_env()
    settings.watching.server_timeout = ours.watch.server_timeout_seconds
    settings.watching.client_timeout = ours.watch.client_timeout_seconds
    settings.watching.connect_timeout = ours.watch.connect_timeout_seconds
    settings.watching.inactivity_timeout = ours.watch.client_timeout_seconds
    settings.networking.request_timeout = ours.watch.request_timeout_seconds
    # Should a future handler need kopf's bookkeeping, it stays under our own prefix.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=KOPF_ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=KOPF_ANNOTATION_PREFIX)
    settings.persistence.finalizer = f"{KOPF_ANNOTATION_PREFIX}/finalizer"
    settings.posting.enabled = False  # our events are the phase transitions, posted by the reconciler
    # Handlers block on API calls; enough threads that one slow LoRAJob does not delay the others.
    settings.execution.max_workers = ours.reconcile.workers
    memo.reconciler = Reconciler(Cluster(_api_client()), ours)
    memo.resync = Resync(memo.reconciler, memo.namespaces)
    memo.jobset_states = {}  # JobSet uid -> _jobset_state; kopf runs one handler at a time per object
    memo.resync.start()
    logger.info("lorajob operator configured: %s", ours)


@kopf.on.cleanup()
def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.resync.stop()


def _reconcile(memo: kopf.Memo, namespace: str, name: str) -> None:
    memo.resync.schedule((namespace, name), memo.reconciler.reconcile(namespace, name))


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
def lorajob_changed(type: str, body: kopf.Body, name: str, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    # A MODIFIED event whose status already reflects the spec is our own status write: skip it
    # (the resync pass still looks at every LoRAJob).
    settled = body.status.get("observedGeneration") == body.metadata.get("generation")
    if type != "DELETED" and not (type == "MODIFIED" and settled):
        _reconcile(memo, namespace, name)


def _jobset_state(body: kopf.Body) -> tuple:
    """What the reconcile reads from a JobSet; replica counts and other status churn leave it unchanged."""
    conditions = tuple(sorted((c.get("type"), c.get("status")) for c in body.status.get("conditions") or []))
    return body.metadata.get("deletionTimestamp"), body.spec.get("suspend"), conditions


@kopf.on.event("jobset.x-k8s.io", "v1alpha2", "jobsets", labels={render.LABEL_RUN: kopf.PRESENT})
def jobset_changed(type: str, body: kopf.Body, namespace: str, memo: kopf.Memo, **_: Any) -> None:
    uid, state = body.metadata.get("uid"), _jobset_state(body)
    if type == "DELETED":
        memo.jobset_states.pop(uid, None)
    elif memo.jobset_states.get(uid) == state:
        return
    else:
        memo.jobset_states[uid] = state
    for owner in body.metadata.get("ownerReferences") or []:
        if owner.get("kind") == api.KIND and owner.get("controller"):
            _reconcile(memo, namespace, owner["name"])


@kopf.on.probe(id="resync")
def resync_alive(memo: kopf.Memo, **_: Any) -> str:
    if not memo.resync.alive():
        raise RuntimeError("the resync loop has stopped")
    return "ok"
