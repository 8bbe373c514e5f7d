"""One pass over one LoRAJob: observe (caches) -> decide (pure) -> writes."""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime, UTC

from lorajob_operator.caches import Caches
from lorajob_operator.controller.cluster import JOBSET, LORAJOB, Cluster
from lorajob_operator.controller.observe import observe
from lorajob_operator.controller.trainer_logs import TrainLogs
from lorajob_operator.controller.writes import Writes
from lorajob_operator.reconcile.decide import TERMINAL_PHASES, Decision, decide
from lorajob_operator.reconcile.observed import Observed
from lorajob_operator.settings import OperatorSettings

log = logging.getLogger("lorajob.operator")


class Reconciler:
    """One pass over one LoRAJob: observe (caches) -> decide -> apply (writes, put into the caches at once)."""

    def __init__(self, cluster: Cluster, view: Caches, settings: OperatorSettings):
        self.cluster = cluster
        self.view = view
        self.settings = settings
        self.train_logs = TrainLogs(cluster, settings.reconcile.progress_log_lines)
        self.writes = Writes(cluster, view, settings.render)

    def reconcile(self, namespace: str, name: str, read_progress: bool = False) -> float | None:
        """Returns when the LoRAJob wants to be looked at again (seconds), if sooner than a resync.

        `read_progress`: also read the lead trainer's log for status.progress, and the completed check or
        convert step's log for status.data and status.plan (the resync pass asks)."""
        key = (namespace, name)
        body = self.view.lorajob(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.train_logs.forget(key)
            return None
        now = datetime.now(UTC)
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
            rejection = self.writes.create_child(body, observed, create.phase, create.attempt)
            if rejection is not None:  # an observed fact like any other: decide says what it means
                blocked = dataclasses.replace(observed, problems=(*observed.problems, rejection))
                self._apply(body, blocked, decide(blocked, self.settings.reconcile))
                return
        if decision.create and not (decision.delete or decision.delete_self) and unobserved(body):
            # A new or edited LoRAJob's next JobSet: its status and events follow in the pass that the JobSet's
            # watch event queues behind the other new LoRAJobs, so a burst costs one request per LoRAJob up front.
            return
        if decision.status != observed.status:
            self.writes.status(observed, decision.status)
        if decision.annotations:
            self.writes.annotations(observed, decision.annotations)
        for event in decision.events:
            self.writes.event(body, event.type, event.reason, event.message)
        if decision.delete_self:
            log.info("deleting LoRAJob %s/%s: ttlSecondsAfterFinished has passed", namespace, name)
            self.writes.delete(LORAJOB, namespace, name, "Background")
            return
        for child in decision.delete:
            log.info("deleting JobSet %s/%s", namespace, child)
            self.writes.delete(JOBSET, namespace, child, "Foreground")


def unobserved(body: dict) -> bool:
    """No pass has acted on the LoRAJob's spec yet (it is new, or was edited since)."""
    return (body.get("status") or {}).get("observedGeneration") != body["metadata"].get("generation")
