"""Two operator replicas on the simulated cluster: the standby keeps its caches warm and writes nothing;
when the leader is SIGKILLed it takes over within the lease duration plus two looks, and LoRAJobs created
while no replica led are reconciled; a leader stopped gracefully hands the Lease over at once. (The
chaos run, test_chaos.py, kills leaders during bursts and running chains.)"""

from __future__ import annotations

import time
from datetime import datetime, UTC

import pytest
from conftest import FAST_OPERATOR
from lorajobs import sample

from lorajob_operator import names

pytestmark = pytest.mark.cluster

LEASE_SECONDS = float(FAST_OPERATOR["LORAJOB_LEADER_LEASE_DURATION_SECONDS"])
RETRY_SECONDS = float(FAST_OPERATOR["LORAJOB_LEADER_RETRY_PERIOD_SECONDS"])
TAKEOVER_BOUND_SECONDS = LEASE_SECONDS + 2 * RETRY_SECONDS
"""A standby sees the last renewal at most one look late and takes the Lease at most one look after it expired."""
SLACK_SECONDS = 3.0
"""Allowance for process scheduling and API round trips on a loaded machine."""
WRITE_VERBS = ("create", "patch", "update", "delete")


def _writes(replica) -> float:
    return sum(count for verb, count in replica.requests_by_verb().items() if verb in WRITE_VERBS)


def _succeeded_once(lorajobs, name: str) -> None:
    done = lorajobs.wait_phase(name, "Succeeded", timeout=120)
    assert set(done["status"]["restarts"].values()) == {0}, done["status"]["restarts"]
    ours = [js for js in lorajobs.jobsets() if js["metadata"]["labels"].get(names.LABEL_RUN) == name]
    assert sorted(js["metadata"]["labels"][names.LABEL_PHASE] for js in ours) == ["check", "train"]
    assert {js["metadata"]["labels"][names.LABEL_ATTEMPT] for js in ours} == {"0"}


def test_the_standby_writes_nothing_and_takes_over_a_killed_leader(lorajobs, replicas):
    leader = replicas.wait_for_leader()
    (standby,) = [r for r in replicas.replicas if r is not leader]
    lorajobs.apply(sample("before", train_only=True))
    lorajobs.wait("before", lambda obj: (obj.get("status") or {}).get("children"), "a first child", timeout=60)
    lorajobs.wait_until(lambda: standby.metrics().get('lorajob_operator_cache_objects{resource="jobsets"}', 0) >= 1,
                        "the standby's cache holding the JobSet", timeout=30)
    standby_metrics = standby.metrics()
    assert standby_metrics["lorajob_operator_leader"] == 0 and leader.metrics()["lorajob_operator_leader"] == 1
    assert standby_metrics['lorajob_operator_cache_objects{resource="lorajobs"}'] == 1
    assert _writes(standby) == 0, standby.requests_by_verb()

    leader.kill()
    killed = time.monotonic()
    lorajobs.apply(sample("during", train_only=True))  # created while no replica leads
    assert replicas.wait_for_leader(timeout=TAKEOVER_BOUND_SECONDS + SLACK_SECONDS) is standby
    took = time.monotonic() - killed
    assert took >= LEASE_SECONDS - 1, f"took over {took:.1f} s after the kill, before the Lease could expire"
    assert standby.metrics()["lorajob_operator_leadership_acquired_total"] == 1

    for name in ("before", "during"):
        _succeeded_once(lorajobs, name)
    assert "leading: " in standby.log_path.read_text()


def test_a_stopped_leader_hands_the_lease_over_at_once(lorajobs, replicas):
    leader = replicas.wait_for_leader()
    (standby,) = [r for r in replicas.replicas if r is not leader]
    stopped = datetime.now(UTC)  # the Lease's times are the replicas' wall clocks, on this machine
    leader.stop()  # SIGTERM, as a drain or a rolling update sends; returns once the process has exited
    assert replicas.wait_for_leader(timeout=TAKEOVER_BOUND_SECONDS + SLACK_SECONDS) is standby
    taken = datetime.fromisoformat(replicas.lease()["acquireTime"].replace("Z", "+00:00"))
    # Not released, the Lease would pass to the standby no sooner than its last renewal (at most one retry period
    # before the stop) plus its duration.
    assert (taken - stopped).total_seconds() < LEASE_SECONDS - RETRY_SECONDS, (
        "the standby waited for the Lease to expire: it was not released")
    assert "released the Lease" in leader.log_path.read_text()
    lorajobs.apply(sample("after", train_only=True))
    _succeeded_once(lorajobs, "after")
