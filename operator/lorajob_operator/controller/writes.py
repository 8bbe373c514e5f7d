"""Carrying out a decision: the LoRAJob's status (a merge patch of what changed) and its links to the tracker runs
(annotations), JobSets created and deleted, events."""

from __future__ import annotations

import logging
from datetime import datetime, UTC

from kubernetes.client.exceptions import ApiException

from lorajob_operator import api, caches, jobsets, names
from lorajob_operator.caches import Caches
from lorajob_operator.controller.cluster import FIELD_MANAGER, JOBSET, LORAJOB, Cluster, api_message, is_missing
from lorajob_operator.reconcile.conditions import format_time
from lorajob_operator.reconcile.observed import Observed
from lorajob_operator.settings import RenderSettings

log = logging.getLogger("lorajob.operator")


def status_patch(old: dict, new: dict) -> dict:
    """The JSON merge patch that turns status `old` into `new`: a field `new` lacks is removed (null), also
    inside objects (a merge patch alone would keep it, e.g. the stall watchdog's status.progress.advancedTime)."""
    patch: dict = {key: None for key in old.keys() - new.keys()}
    for key, value in new.items():
        both_objects = isinstance(value, dict) and isinstance(old.get(key), dict)
        patch[key] = status_patch(old[key], value) if both_objects else value
    return patch


class Writes:
    """The writes a pass makes, each put into the caches at once (the watch event that follows is then no change)."""

    def __init__(self, cluster: Cluster, view: Caches, render_settings: RenderSettings):
        self.cluster = cluster
        self.view = view
        self.render_settings = render_settings

    def status(self, observed: Observed, status: dict) -> None:
        written = self.cluster.custom.patch_namespaced_custom_object_status(
            *LORAJOB[:2], observed.namespace, LORAJOB[2], observed.name, {"status": status_patch(observed.status, status)}
        )
        self.view.stores[caches.LORAJOBS].upsert(written)

    def annotations(self, observed: Observed, annotations: dict[str, str]) -> None:
        """Set these annotations on the LoRAJob: a merge patch of its metadata only (its spec is Git's)."""
        written = self.cluster.custom.patch_namespaced_custom_object(
            *LORAJOB[:2], observed.namespace, LORAJOB[2], observed.name, {"metadata": {"annotations": annotations}}
        )
        self.view.stores[caches.LORAJOBS].upsert(written)

    def delete(self, resource, namespace: str, name: str, propagation: str) -> None:
        try:
            self.cluster.custom.delete_namespaced_custom_object(
                *resource[:2], namespace, resource[2], name, propagation_policy=propagation
            )
        except ApiException as error:
            if not is_missing(error):
                raise

    def create_child(self, body: dict, observed: Observed, phase: str, attempt: int) -> tuple[str, str] | None:
        """Create the JobSet; (reason, message) when the API server refuses it for a reason the spec can fix."""
        owner = jobsets.Owner(observed.name, observed.namespace, body["metadata"]["uid"])
        jobset = jobsets.render_phase(phase, observed.effective_spec, owner, self.render_settings, attempt)
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
                if existing is None or names.LABEL_RUN in (existing["metadata"].get("labels") or {}):
                    return None  # ours or another LoRAJob's: the next pass reads it from the listing
                return ("NameTaken", f"a JobSet named {name} already exists and is not controlled by this LoRAJob; "
                        "delete it or set another spec.runName")
            if error.status in (400, 403, 422):
                return "JobSetRejected", f"the API server rejected JobSet {name}: {api_message(error)}"
            raise

    def event(self, body: dict, event_type: str, reason: str, message: str) -> None:
        metadata = body["metadata"]
        now = datetime.now(UTC)
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
