"""The stall watchdog end to end: a trainer that prints a step and then hangs (kwok's hang image, with the
progress line served as its log) is restarted by scheduling.progressDeadlineSeconds as an infrastructure
failure with reason Stalled, and its next try runs."""

from __future__ import annotations

import pytest
from lorajobs import every_image, progress_line, sample

from lorajob_devcluster import HANG_IMAGE
from lorajob_devcluster.kwok_stages import cri_log
from lorajob_operator import names

pytestmark = pytest.mark.cluster
DEADLINE_SECONDS = 30
"""The smallest progressDeadlineSeconds the API takes."""


def _running_try(obj: dict, attempt: int) -> bool:
    status = obj.get("status", {})
    return (status.get("phase") == "Training" and status.get("restarts", {}).get("train") == attempt
            and "advancedTime" in (status.get("progress") or {}))


def test_a_trainer_that_hangs_is_restarted_as_stalled(lorajobs, operator, trainer_log):
    trainer_log.write_text(cri_log(["loading checkpoint", progress_line(3)]))
    lorajobs.apply(sample("hung", train_only=True, images=every_image(HANG_IMAGE), progressDeadlineSeconds=DEADLINE_SECONDS))
    first = lorajobs.wait("hung", lambda obj: _running_try(obj, 0) and obj["status"]["progress"].get("step") == 3,
                          "try 0 running at step 3", timeout=60)

    restarted = lorajobs.wait("hung", lambda obj: _running_try(obj, 1), "try 1 running", timeout=DEADLINE_SECONDS + 45)
    assert restarted["status"]["infrastructureRestarts"]["train"] == 1
    assert restarted["status"]["progress"]["advancedTime"] > first["status"]["progress"]["advancedTime"]
    (stalled,) = [event for event in lorajobs.events("hung") if event["reason"] == "Stalled"]
    assert stalled["type"] == "Warning"
    assert "the train step stalled (JobSet hung): no new step for " in stalled["message"]
    assert f"(last step 3; scheduling.progressDeadlineSeconds={DEADLINE_SECONDS}); an infrastructure failure" in stalled["message"]
    (jobset,) = [js for js in lorajobs.jobsets() if js["metadata"]["labels"][names.LABEL_PHASE] == "train"]
    assert jobset["metadata"]["labels"][names.LABEL_ATTEMPT] == "1"
