"""Leader election over a coordination.k8s.io Lease, the way client-go's leaderelection does it.

Every replica keeps its caches warm; only the one holding the Lease reconciles, and the operator's API
client refuses every write while `LeaderElector.leading()` is false (controller.cluster.LeaderOnlyRESTClient), so a
standby, or a leader that lost its Lease, sends no write at all.

Safety rests on two local clocks, never on comparing clocks across nodes:
* a standby takes the Lease only after it has seen the same Lease record, unchanged, for the record's
  `leaseDurationSeconds` on its own monotonic clock;
* a leader counts itself leader until `renew_deadline_seconds` after it *sent* its last successful renewal,
  which is before the server stored it; as renew_deadline < lease duration, it has stopped writing before
  any standby could take the Lease, however late the standby looked.

A leader stopping gracefully releases the Lease (holder emptied), and a standby takes it at its next look.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from datetime import datetime, UTC
from pathlib import Path
from collections.abc import Callable

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lorajob_operator.settings import LeaderSettings

log = logging.getLogger("lorajob.operator.leader")

LEASE = ("coordination.k8s.io", "v1", "leases")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class NotLeader(RuntimeError):
    """A write was attempted while this replica does not hold the Lease."""


def lease_namespace(settings: LeaderSettings, watched: list[str] | None) -> str:
    if settings.lease_namespace:
        return settings.lease_namespace
    if SERVICE_ACCOUNT_NAMESPACE.is_file():
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    return watched[0] if watched else "default"


def identity(settings: LeaderSettings) -> str:
    return settings.identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def _micro_time(moment: datetime) -> str:
    """A Lease's MicroTime (RFC 3339 with exactly six fractional digits)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Campaigns for the Lease `settings.lease_name` in `namespace` as `name`, from its own thread; calls
    `on_started` when this replica becomes the leader and `on_stopped` when it stops being one."""

    def __init__(self, api_client: client.ApiClient, settings: LeaderSettings, namespace: str, name: str,
                 clock: Callable[[], float] = time.monotonic):
        self.custom = client.CustomObjectsApi(api_client)
        self.settings = settings
        self.namespace = namespace
        self.name = name
        self.clock = clock
        self.holder: str | None = None
        """The holder of the Lease as last read (this replica's name while it leads)."""
        self.transitions = 0
        """Times this replica became the leader."""
        self._valid_until = 0.0
        """clock() until which this replica counts itself leader (0: it is not)."""
        self._observed: tuple[str, float] | None = None
        """(resourceVersion of the Lease last read, clock() when that version was first seen)."""
        self._was_leading = False
        self._last_error: str | None = None
        self._on_started: Callable[[], None] = lambda: None
        self._on_stopped: Callable[[], None] = lambda: None
        self._stop = threading.Event()
        self._leadership = threading.Lock()
        """Held while _valid_until is extended, so that no renewal in flight outlives `stop`."""
        self._thread = threading.Thread(target=self._run, name="lorajob-leader", daemon=True)

    @property
    def lease(self) -> str:
        return f"{self.namespace}/{self.settings.lease_name}"

    def leading(self) -> bool:
        return self.clock() < self._valid_until

    def alive(self) -> bool:
        return self._thread.is_alive() or self._stop.is_set()

    def start(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        self._on_started, self._on_stopped = on_started, on_stopped
        self._thread.start()

    def stop(self) -> None:
        """Stops leading (writes are refused from now on) and campaigning; `release` then hands the Lease on."""
        with self._leadership:
            self._valid_until = 0.0
            self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.settings.renew_deadline_seconds + 5)

    def release(self) -> None:
        """Empties the Lease if this replica held it, so a standby takes it at its next look instead of
        waiting out the lease duration."""
        if not self._was_leading:
            return
        self._was_leading = False
        try:
            lease = self._read()
            if lease is None or lease["spec"].get("holderIdentity") != self.name:
                return
            now = _micro_time(datetime.now(UTC))
            lease["spec"] = {**lease["spec"], "holderIdentity": None, "leaseDurationSeconds": 1,
                             "renewTime": now, "acquireTime": now}
            self._replace(lease)
            log.info("released the Lease %s", self.lease)
        except (ApiException, urllib3.exceptions.HTTPError) as error:
            log.warning("could not release the Lease %s (a standby takes it when it expires): %s", self.lease, error)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            self._stop.wait(self.settings.retry_period_seconds)

    def _look(self) -> None:
        """One try to acquire or renew the Lease, and what follows for this replica's leadership."""
        sent = self.clock()
        try:
            held = self._acquire_or_renew(sent)
            self._last_error = None
        except (ApiException, urllib3.exceptions.HTTPError) as error:
            held = False
            text = f"{error.status} {error.reason}" if isinstance(error, ApiException) else str(error)
            if text != self._last_error:
                log.warning("cannot read or write the Lease %s: %s", self.lease, text)
            self._last_error = text
        with self._leadership:
            if held and not self._stop.is_set():
                self._valid_until = sent + self.settings.renew_deadline_seconds
            held = held and self.leading()
        if held:
            if not self._was_leading:
                self._was_leading = True
                self.transitions += 1
                log.info("leading: %s holds the Lease %s; reconciling", self.name, self.lease)
                self._on_started()
        elif self._was_leading and not self.leading() and not self._stop.is_set():
            # Once stopped, `release` hands the Lease on: a renewal answered after the stop is no loss of it.
            self._was_leading = False
            why = f"{self.holder} holds it now" if self.holder not in (None, self.name) else (
                f"no renewal succeeded for {self.settings.renew_deadline_seconds:g} s")
            log.warning("stopped leading: lost the Lease %s (%s); writing nothing until it is ours again", self.lease, why)
            self._on_stopped()

    def _acquire_or_renew(self, now: float) -> bool:
        lease = self._read()
        wall = _micro_time(datetime.now(UTC))
        mine = {"holderIdentity": self.name, "leaseDurationSeconds": self.settings.lease_duration_seconds, "renewTime": wall}
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.settings.lease_name, "namespace": self.namespace},
                    "spec": {**mine, "acquireTime": wall, "leaseTransitions": 0}}
            return self._write(lambda: self.custom.create_namespaced_custom_object(
                *LEASE[:2], self.namespace, LEASE[2], body, _request_timeout=self._timeout()))
        spec = lease.get("spec") or {}
        self.holder = spec.get("holderIdentity") or None
        version = lease["metadata"]["resourceVersion"]
        if self._observed is None or self._observed[0] != version:
            self._observed = (version, now)
        if self.holder not in (None, self.name):
            self._valid_until = 0.0  # someone else holds it: if this replica thought it led, it does no more
            if now < self._observed[1] + (spec.get("leaseDurationSeconds") or self.settings.lease_duration_seconds):
                return False
        if self.holder != self.name:
            mine |= {"acquireTime": wall, "leaseTransitions": (spec.get("leaseTransitions") or 0) + 1}
        lease["spec"] = {**spec, **mine}
        return self._write(lambda: self._replace(lease))

    def _write(self, send: Callable[[], dict]) -> bool:
        """Sends a create or replace of the Lease; False when another replica wrote it first (409)."""
        try:
            written = send()
        except ApiException as error:
            if error.status == 409:
                return False
            raise
        self.holder = self.name
        self._observed = (written["metadata"]["resourceVersion"], self.clock())
        return True

    def _read(self) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(
                *LEASE[:2], self.namespace, LEASE[2], self.settings.lease_name, _request_timeout=self._timeout())
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def _replace(self, lease: dict) -> dict:
        return self.custom.replace_namespaced_custom_object(
            *LEASE[:2], self.namespace, LEASE[2], self.settings.lease_name, lease, _request_timeout=self._timeout())

    def _timeout(self) -> float:
        return self.settings.renew_deadline_seconds


class NoElection:
    """Leader election turned off (`LORAJOB_LEADER_ENABLED=false`): this replica always leads."""

    transitions = 1
    holder = None

    def leading(self) -> bool:
        return True

    def alive(self) -> bool:
        return True

    def start(self, on_started: Callable[[], None], on_stopped: Callable[[], None]) -> None:
        on_started()

    def stop(self) -> None:
        pass

    def release(self) -> None:
        pass
