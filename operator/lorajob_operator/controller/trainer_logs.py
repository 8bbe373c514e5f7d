"""Reading the trainer's pod logs for status: the lead trainer's tail for progress, the checks step's log once."""

from __future__ import annotations

import logging

import urllib3
from kubernetes.client.exceptions import ApiException

from lorajob_operator.controller.cluster import Cluster, api_message
from lorajob_operator.reconcile.observed import Observed
from lorajob_operator.reconcile.trainer_output import checks_log_wanted, checks_step, train_log_wanted

log = logging.getLogger("lorajob.operator")


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
        text = f"{error.status} {api_message(error)}" if isinstance(error, ApiException) else str(error)
        level = logging.DEBUG if self._last_error.get(key) == text else logging.INFO
        self._last_error[key] = text
        log.log(level, "no progress for LoRAJob %s/%s: cannot read the trainer log of JobSet %s: %s", *key, jobset, text)

    def forget(self, key: tuple[str, str]) -> None:
        self._read_after_finish.pop(key, None)
        self._checks_read.pop(key, None)
        self._last_error.pop(key, None)
