"""Failure classes end to end: the trainer's exit code on a kwok pod, through the Job and JobSet
controllers, decides whether the operator retries and on which budget."""

from __future__ import annotations

import pytest
from lorajobs import condition, sample

from lorajob_devcluster import failing_image
from lorajob_trainer.contract import exit_codes

pytestmark = pytest.mark.cluster


def test_a_user_error_fails_the_lorajob_at_once(lorajobs, operator):
    lorajobs.apply(sample("bad-data", train_only=True, images={"trainer": failing_image(exit_codes.DATA)}, retryLimit=2))
    failed = lorajobs.wait_phase("bad-data", "Failed", timeout=150)
    reason = condition(failed, "Failed")
    assert reason["reason"] == "InvalidData", reason
    assert f"exited with code {exit_codes.DATA}" in reason["message"] and "not retried" in reason["message"]
    assert failed["status"]["restarts"]["train"] == 0
    assert [e["reason"] for e in lorajobs.events("bad-data") if e["reason"] == "Retrying"] == []


def test_a_container_killed_by_a_signal_retries_on_the_infrastructure_budget(lorajobs, operator):
    body = sample("killed", train_only=True, images={"trainer": failing_image(137)}, retryLimit=0,
                  infrastructureRetryLimit=1)
    lorajobs.apply(body)
    failed = lorajobs.wait_phase("killed", "Failed", timeout=240)
    assert failed["status"]["restarts"]["train"] == 1
    assert failed["status"]["infrastructureRestarts"]["train"] == 1
    message = condition(failed, "Failed")["message"]
    assert "an infrastructure failure" in message and "giving up after 1 retry" in message, message
