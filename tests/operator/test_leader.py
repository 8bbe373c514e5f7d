"""Leader election over a Lease on the real API server: one of two electors leads, the other writes
nothing; a released Lease passes at once, a crashed leader's only after the lease duration; a leader that
loses its Lease, or cannot renew it, stops leading before anyone else could start. A sampler checks
throughout that two electors never count themselves leader at the same moment."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from kubernetes import client

from lorajob_operator.leader import LEASE, LeaderElector
from lorajob_operator.metrics import READ_VERBS, CountingRESTClient, Metrics
from lorajob_operator.settings import LeaderSettings, OperatorSettings

pytestmark = pytest.mark.apiserver

NAMESPACE = "default"
FAST = dict(lease_duration_seconds=3, renew_deadline_seconds=2.0, retry_period_seconds=0.25)
"""Leader timing of these tests: a crashed leader is replaced after 3 s."""
SLACK_SECONDS = 3.0
"""Allowance for API round trips and thread scheduling on a loaded machine."""
_leases = itertools.count()


class Candidate:
    """An elector with its own counted client, recording when it started and stopped leading."""

    def __init__(self, kube, lease: str, name: str):
        self.metrics = Metrics()
        api_client = kube.api_client()
        api_client.rest_client = CountingRESTClient(api_client.configuration, self.metrics)
        self.api_client = api_client
        self.elector = LeaderElector(api_client, LeaderSettings(lease_name=lease, **FAST), NAMESPACE, name)
        self.started: list[float] = []
        self.stopped: list[float] = []

    def start(self) -> Candidate:
        self.elector.start(lambda: self.started.append(time.monotonic()), lambda: self.stopped.append(time.monotonic()))
        return self

    def writes(self) -> float:
        return sum(sample.value for family in self.metrics.api_requests.collect() for sample in family.samples
                   if sample.name.endswith("_total") and sample.labels["verb"] not in READ_VERBS)


class OverlapSampler:
    """Samples every 5 ms whether more than one elector counts itself leader."""

    def __init__(self, *candidates: Candidate):
        self.candidates = candidates
        self.overlaps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.overlaps += sum(c.elector.leading() for c in self.candidates) > 1

    def __enter__(self) -> OverlapSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def wait_until(predicate, timeout: float, what: str) -> float:
    """Waits for `predicate`; returns when it held (time.monotonic())."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:.1f} s: {what}"
        time.sleep(0.01)
    return time.monotonic()


@pytest.fixture
def pair(kube):
    """Two candidates for a fresh Lease: `a` leads, `b` has seen it and stands by."""
    lease = f"test-lease-{next(_leases)}-{time.time_ns() % 10**6}"
    a, b = Candidate(kube, lease, "a").start(), None
    try:
        wait_until(a.elector.leading, 10, "a leads")
        b = Candidate(kube, lease, "b").start()
        wait_until(lambda: b.elector.holder == "a", 10, "b has read the Lease")
        yield a, b, lease
    finally:
        for candidate in (a, b):
            if candidate is not None:
                candidate.elector.stop()
        client.CustomObjectsApi(kube.api_client()).delete_namespaced_custom_object(*LEASE[:2], NAMESPACE, LEASE[2], lease)


def _lease(kube, name: str) -> dict:
    return client.CustomObjectsApi(kube.api_client()).get_namespaced_custom_object(*LEASE[:2], NAMESPACE, LEASE[2], name)


def test_one_leads_and_the_standby_writes_nothing(kube, pair):
    a, b, lease = pair
    with OverlapSampler(a, b) as sampler:
        renewals = _lease(kube, lease)["metadata"]["resourceVersion"]
        wait_until(lambda: _lease(kube, lease)["metadata"]["resourceVersion"] != renewals, 5, "a renews")
    assert a.elector.leading() and not b.elector.leading()
    assert b.writes() == 0 and b.started == []
    spec = _lease(kube, lease)["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == FAST["lease_duration_seconds"]
    assert sampler.overlaps == 0


def stopped_and_released(a: Candidate, b: Candidate) -> tuple[float, int]:
    """Stops `a` and releases its Lease: (seconds from the release until `b` leads, samples in which both led)."""
    with OverlapSampler(a, b) as sampler:
        a.elector.stop()
        released = time.monotonic()
        a.elector.release()
        took = wait_until(b.elector.leading, FAST["lease_duration_seconds"] + SLACK_SECONDS, "b leads")
    return took - released, sampler.overlaps


def test_a_released_lease_passes_at_the_standbys_next_look(kube, pair):
    a, b, lease = pair
    took, overlaps = stopped_and_released(a, b)
    assert took < FAST["lease_duration_seconds"], "b waited out the lease instead of taking the released one"
    assert overlaps == 0
    assert _lease(kube, lease)["spec"]["leaseTransitions"] == 1


def test_a_leader_stopped_during_a_renewal_still_releases_the_lease(kube, pair):
    """SIGTERM can arrive while a renewal is on the wire (often, on a loaded machine): that renewal's answer must
    not count as losing the Lease, or the release is skipped and the standby waits out the lease (seen in the
    suite: 4.5 s)."""
    a, b, lease = pair
    renewing, renew = threading.Event(), a.elector.custom.get_namespaced_custom_object

    def renewal_held_until_stopped(*args, **kwargs):
        renewing.set()
        wait_until(a.elector._stop.is_set, 10, "a is stopped")
        return renew(*args, **kwargs)

    a.elector.custom.get_namespaced_custom_object = renewal_held_until_stopped
    assert renewing.wait(5), "a renews"
    took, overlaps = stopped_and_released(a, b)
    assert took < FAST["lease_duration_seconds"], "a did not release the Lease it still held"
    assert overlaps == 0


def test_a_crashed_leaders_lease_passes_after_the_lease_duration_and_never_before(kube, pair):
    a, b, lease = pair
    last_renewal = _lease(kube, lease)["metadata"]["resourceVersion"]
    wait_until(lambda: _lease(kube, lease)["metadata"]["resourceVersion"] != last_renewal, 5, "a renews")
    with OverlapSampler(a, b) as sampler:
        a.elector.stop()  # a crash: no release
        crashed = time.monotonic()
        took = wait_until(b.elector.leading, FAST["lease_duration_seconds"] + SLACK_SECONDS, "b leads")
    # a's last renewal was at most one retry period before the crash.
    assert took - crashed >= FAST["lease_duration_seconds"] - FAST["retry_period_seconds"]
    assert sampler.overlaps == 0 and len(b.started) == 1


def test_a_leader_whose_lease_is_taken_stops_at_its_next_look(kube, pair):
    a, b, lease = pair
    body = _lease(kube, lease)
    body["spec"] |= {"holderIdentity": "intruder", "leaseDurationSeconds": 3600}
    client.CustomObjectsApi(kube.api_client()).replace_namespaced_custom_object(*LEASE[:2], NAMESPACE, LEASE[2], lease, body)
    taken = time.monotonic()
    stopped = wait_until(lambda: a.stopped, FAST["renew_deadline_seconds"] + SLACK_SECONDS, "a stops leading")
    assert stopped - taken < FAST["renew_deadline_seconds"], "a waited out its renew deadline instead of stopping at once"
    assert not a.elector.leading() and not b.elector.leading()
    assert a.elector.holder == "intruder"


def test_a_leader_that_cannot_renew_stops_before_a_standby_may_start(kube, pair):
    a, b, lease = pair
    with OverlapSampler(a, b) as sampler:
        a.api_client.configuration.host = "https://127.0.0.1:9"  # every renewal fails from now on
        stopped = wait_until(lambda: a.stopped, FAST["renew_deadline_seconds"] + SLACK_SECONDS, "a stops leading")
        took = wait_until(b.elector.leading, FAST["lease_duration_seconds"] + SLACK_SECONDS, "b leads")
    assert stopped < took and sampler.overlaps == 0  # (wait_until bounds how long after the cut a stopped)


def test_leader_timing_must_let_a_leader_stop_before_its_lease_passes():
    with pytest.raises(ValueError, match="RENEW_DEADLINE"):
        OperatorSettings.from_env({"LORAJOB_LEADER_RENEW_DEADLINE_SECONDS": "20"})
    assert OperatorSettings.from_env({"LORAJOB_LEADER_ENABLED": "false"}).leader.enabled is False
