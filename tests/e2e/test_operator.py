"""The operator end to end on the simulated TPU cluster: real API server, KCM, scheduler, kwok nodes,
JobSet and Kueue controllers. The operator runs as its own process (`python -m lorajob_operator`)."""

from __future__ import annotations

import json
import urllib.request
from datetime import datetime

import pytest
from lorajobs import condition, every_image, sample
from record import Record

from lorajob_devcluster import HANG_IMAGE, SLOW_IMAGE, failing_image
from lorajob_operator import api, jobsets, names
from lorajob_operator.settings import RenderSettings

pytestmark = [pytest.mark.cluster, pytest.mark.slow(minutes=4)]
PHASES = {"Pending", "Queued", "Converting", "Training", "Exporting", "Succeeded", "Failed", "Suspended"}
CLUSTER_QUEUE = "lorajob-cluster-queue"


def _ours(jobsets: list[dict], run: str) -> dict[str, dict]:
    labelled = [(js, js["metadata"].get("labels") or {}) for js in jobsets]
    return {labels[names.LABEL_PHASE]: js for js, labels in labelled if labels.get(names.LABEL_RUN) == run}


def _completed(jobset: dict) -> bool:
    return any(c["type"] == "Completed" and c["status"] == "True" for c in jobset.get("status", {}).get("conditions", []))


def test_full_chain_runs_convert_train_export_to_success(lorajobs, operator):
    lorajobs.apply(sample("chain"))
    done = lorajobs.wait_phase("chain", "Succeeded", timeout=180)

    children = _ours(lorajobs.jobsets(), "chain")
    assert sorted(children) == ["convert", "export", "train"]
    assert all(_completed(js) for js in children.values())
    assert {js["metadata"]["name"] for js in children.values()} == {"chain-convert", "chain", "chain-to-hf"}
    for js in children.values():
        (ref,) = js["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == ("LoRAJob", "chain", done["metadata"]["uid"], True)
        assert js["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "lorajob"

    status = done["status"]
    assert status["startTime"] == children["convert"]["metadata"]["creationTimestamp"]  # the first step's creation
    assert status["observedGeneration"] == done["metadata"]["generation"]
    assert status["children"] == {"convert": "chain-convert", "train": "chain", "export": "chain-to-hf"}
    assert status["restarts"] == {"check": 0, "convert": 0, "train": 0, "export": 0}
    assert status["startTime"] <= status["completionTime"]
    assert status["outputs"]["adapterPath"] == "gs://my-bucket/lorajob/chain/huggingface"
    assert condition(done, "Succeeded")["status"] == "True"
    assert condition(done, "Running")["status"] == "False"  # nothing runs or holds quota any more

    reasons = [event["reason"] for event in lorajobs.events("chain")]
    # The pass that creates the first JobSet writes no status and no event (bursts): when Kueue admits the step
    # before the next pass, that pass's first event is already Converting.
    assert reasons[0] in ("Queued", "Converting") and reasons[-1] == "Succeeded" and set(reasons) <= PHASES, reasons
    assert "Training" in reasons or "Exporting" in reasons, reasons


def _waiting(position: str) -> str:
    """How the Queued message of a `sample` train step behind a full v6e-16 slice starts, `position` in the
    ClusterQueue (the flavor follows when Kueue's message names the quota that is short)."""
    return f"train step: {position} in ClusterQueue {CLUSTER_QUEUE}; waiting for 16 google.com/tpu"


def _message(obj: dict) -> str:
    return (obj.get("status") or {}).get("message") or ""


@pytest.mark.slow
def test_jobs_wait_in_kueue_in_order_until_the_first_releases_the_tpu_slice(lorajobs, operator):
    lorajobs.apply(sample("first", train_only=True, images=every_image(SLOW_IMAGE)))
    lorajobs.wait_phase("first", "Training", timeout=60)
    lorajobs.apply(sample("second", train_only=True))
    lorajobs.wait("second", lambda obj: _message(obj).startswith(_waiting("1st")), "second queued 1st", timeout=60)
    lorajobs.apply(sample("third", train_only=True))  # its Workload is created after the second's: it queues behind it

    third = lorajobs.wait("third", lambda obj: _message(obj).startswith(_waiting("2nd")), "third queued 2nd", timeout=60)
    assert _message(lorajobs.get("second")).startswith(_waiting("1st"))
    # Details for `kubectl describe`: what the position counts, then Kueue's own words. The position is Kueue's own
    # (its visibility API, read at the resync) once the operator has asked; before that, worked out from the caches.
    assert lorajobs.cluster.host_ip, "the simulated cluster serves Kueue's visibility API only on a non-loopback address"
    third = lorajobs.wait("third", lambda obj: "visibility API" in (condition(obj, "Queued") or {}).get("message", ""),
                          "third placed by Kueue's visibility API", timeout=30)
    assert _message(third).startswith(_waiting("2nd")) and _message(lorajobs.get("second")).startswith(_waiting("1st"))
    reason = condition(third, "Queued")
    assert (reason["status"], reason["reason"]) == ("True", "WaitingForQuota")
    assert reason["message"].startswith(third["status"]["message"]), reason["message"]
    assert (
        "; Kueue's position (its visibility API), counting the pending Workloads of every namespace; "
        "Kueue: couldn't assign flavors"
    ) in reason["message"], reason["message"]
    wide = lorajobs.kubectl("get", "lj", "third", "-o", "wide").stdout
    assert _waiting("2nd") in wide, wide
    second = _ours(lorajobs.jobsets(), "second")["train"]
    kueue_says = condition(_workload(lorajobs, "second"), "QuotaReserved")
    assert (kueue_says["status"], kueue_says["reason"]) == ("False", "Pending")
    assert second["spec"]["suspend"] is True  # suspended by Kueue, never resumed by us
    assert lorajobs.get("first")["status"]["phase"] == "Training"

    for name, timeout in (("first", 120), ("second", 90), ("third", 90)):
        lorajobs.wait_phase(name, "Succeeded", timeout=timeout)
        assert sorted(_ours(lorajobs.jobsets(), name)) == ["check", "train"]  # a MaxText base: checked, no convert
    # The order is Kueue's own record (the operator notes completionTime when it observes, which may lag under load):
    # each train step got the slice only once the one before it had finished and released it.
    for before, after in (("first", "second"), ("second", "third")):
        released = condition(_workload(lorajobs, before), "Finished")["lastTransitionTime"]
        admitted = condition(_workload(lorajobs, after), "QuotaReserved")
        assert admitted["status"] == "True" and admitted["lastTransitionTime"] >= released, (before, after)


def _workload(lorajobs, run: str) -> dict:
    """Kueue's Workload for a LoRAJob's train step."""
    train = _ours(lorajobs.jobsets(), run)["train"]
    (workload,) = json.loads(lorajobs.kubectl(
        "get", "workloads.kueue.x-k8s.io", "-l", f"kueue.x-k8s.io/job-uid={train['metadata']['uid']}", "-o", "json",
    ).stdout)["items"]
    return workload


def test_a_failing_train_step_fails_the_job_with_the_reason_and_never_exports(lorajobs, operator):
    body = sample("broken", images={"trainer": failing_image(42)}, retryLimit=1)
    body["spec"]["model"] = {"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://my-bucket/qwen3/0/items"}  # check, then train
    lorajobs.apply(body)
    failed = lorajobs.wait_phase("broken", "Failed", timeout=150)

    reason = condition(failed, "Failed")
    assert reason["reason"] == "TrainFailed"
    assert "container trainer exited with code 42" in reason["message"], reason["message"]
    assert "pathways-head" in reason["message"] and "giving up after 1 retry" in reason["message"]
    assert failed["status"]["restarts"]["train"] == 1
    children = _ours(lorajobs.jobsets(), "broken")
    assert sorted(children) == ["check", "train"]
    assert children["train"]["metadata"]["labels"][names.LABEL_ATTEMPT] == "1"
    assert [e["type"] for e in lorajobs.events("broken") if e["reason"] == "Failed"] == ["Warning"]


def test_operator_killed_mid_chain_resumes_with_exactly_one_jobset_per_step(lorajobs, start_operator):
    first = start_operator()
    lorajobs.apply(sample("restart"))
    lorajobs.wait_until(lambda: "convert" in _ours(lorajobs.jobsets(), "restart"), "the convert JobSet", timeout=60, interval=0.2)
    first.kill()
    at_kill = _ours(lorajobs.jobsets(), "restart")
    assert sorted(at_kill) == ["convert"] and not _completed(at_kill["convert"])  # killed mid-step
    # While no operator runs, convert finishes; the new operator must go on from there.
    lorajobs.wait_until(lambda: _completed(_ours(lorajobs.jobsets(), "restart")["convert"]), "convert completed", timeout=60)
    start_operator()
    lorajobs.wait_phase("restart", "Succeeded", timeout=180)

    children = _ours(lorajobs.jobsets(), "restart")
    assert sorted(children) == ["convert", "export", "train"]
    assert children["convert"]["metadata"]["uid"] == at_kill["convert"]["metadata"]["uid"]  # taken over, not re-created
    assert all(js["metadata"]["labels"][names.LABEL_ATTEMPT] == "0" for js in children.values())
    workloads = lorajobs.kubectl("get", "workloads.kueue.x-k8s.io", "-o", "name").stdout.split()
    assert len(workloads) == 3, workloads  # one Kueue Workload per step: no duplicate ever existed


def test_suspend_deletes_the_running_step_and_resume_recreates_it(lorajobs, operator):
    lorajobs.apply(sample("pause", train_only=True, images=every_image(HANG_IMAGE)))
    lorajobs.wait_phase("pause", "Training", timeout=60)
    before = _ours(lorajobs.jobsets(), "pause")["train"]["metadata"]["uid"]

    lorajobs.patch_spec("pause", {"suspend": True})
    suspended = lorajobs.wait_phase("pause", "Suspended", timeout=60)
    assert condition(suspended, "Suspended")["status"] == "True"
    lorajobs.wait_until(lambda: "train" not in _ours(lorajobs.jobsets(), "pause"), "the train JobSet deleted", timeout=60)
    assert not [p for p in lorajobs.pods() if p["metadata"]["labels"].get(names.LABEL_RUN) == "pause"
                and p["metadata"]["labels"].get(names.LABEL_PHASE) == "train"]

    lorajobs.patch_spec("pause", {"suspend": False})
    resumed = lorajobs.wait_phase("pause", "Training", timeout=60)
    resume = condition(resumed, "Suspended")
    assert (resume["status"], resume["reason"]) == ("False", "Resumed")
    after = _ours(lorajobs.jobsets(), "pause")["train"]
    assert after["metadata"]["uid"] != before
    assert after["metadata"]["labels"][names.LABEL_ATTEMPT] == "0"  # a pause is not a retry
    assert resumed["status"]["restarts"]["train"] == 0


def test_deleting_a_lorajob_deletes_its_children(lorajobs, operator):
    lorajobs.apply(sample("gone", train_only=True, images=every_image(HANG_IMAGE)))
    lorajobs.wait_phase("gone", "Training", timeout=60)
    assert _ours(lorajobs.jobsets(), "gone")

    lorajobs.delete("gone")
    lorajobs.wait_until(lambda: lorajobs.get("gone") is None and not _ours(lorajobs.jobsets(), "gone"), "LoRAJob and JobSet gone", timeout=60)
    lorajobs.wait_until(
        lambda: not [p for p in lorajobs.pods() if p["metadata"]["labels"].get(names.LABEL_RUN) == "gone"],
        "pods garbage-collected", timeout=60,
    )


def test_a_jobset_name_taken_by_someone_else_blocks_with_a_warning_until_it_is_freed(lorajobs, operator):
    """The API server refuses the create (409, not ours): an observed fact that decide turns into Blocked."""
    body = sample("taken", train_only=True)
    spec = api.LoRAJobSpec.model_validate(body["spec"])
    foreign = jobsets.render_phase("train", spec, jobsets.Owner("someone", lorajobs.namespace, "0"), RenderSettings(), 0)
    foreign["metadata"] = {"name": "taken"}  # no owner, no lorajob labels
    lorajobs.kubectl("create", "-f", "-", input=json.dumps(foreign))
    lorajobs.apply(body)
    blocked = lorajobs.wait("taken", lambda obj: condition(obj, "Blocked").get("status") == "True", "Blocked", timeout=30)
    assert condition(blocked, "Blocked")["reason"] == "NameTaken"
    assert blocked["status"]["phase"] == "Pending" and "already exists and is not controlled" in blocked["status"]["message"]
    lorajobs.wait_until(lambda: any(e["reason"] == "NameTaken" and e["type"] == "Warning" for e in lorajobs.events("taken")),
                        "a NameTaken warning event", timeout=30)

    lorajobs.kubectl("delete", "jobsets.jobset.x-k8s.io", "taken", "--wait=true")
    lorajobs.wait("taken", lambda obj: condition(obj, "Blocked").get("status") == "False", "unblocked", timeout=60)
    lorajobs.wait_until(lambda: _ours(lorajobs.jobsets(), "taken"), "its own JobSet created", timeout=60)


def test_a_lorajob_that_starts_without_convert_has_its_start_and_its_deadline(lorajobs, operator):
    """startTime is the first step's creation whichever pass records it (the pass creating a new LoRAJob's first
    JobSet writes no status), so activeDeadlineSeconds counts from it and fires while the train step runs."""
    lorajobs.apply(sample("deadline", train_only=True, images=every_image(HANG_IMAGE), activeDeadlineSeconds=20))
    failed = lorajobs.wait_phase("deadline", "Failed", timeout=90)
    assert condition(failed, "Failed")["reason"] == "DeadlineExceeded"
    children = _ours(lorajobs.jobsets(), "deadline")
    assert failed["status"]["startTime"] == children["check"]["metadata"]["creationTimestamp"]


def test_ttl_after_finished_deletes_the_lorajob_and_its_children_once_it_succeeded_and_the_ttl_passed(
    sim_cluster, namespace, lorajobs, operator,
):
    ttl = 3
    with Record(sim_cluster.api_client(), namespace) as record:
        lorajobs.apply(sample("short", train_only=True, ttlSecondsAfterFinished=ttl))
        lorajobs.wait_until(lambda: record.deleted["lorajobs"], "the LoRAJob deleted after its TTL", timeout=120)
    lorajobs.wait_until(lambda: not _ours(lorajobs.jobsets(), "short"), "its JobSet garbage-collected", timeout=60)

    phases = [obj.get("status", {}).get("phase") for _, obj in record.versions("lorajobs")]
    last = record.versions("lorajobs")[-1][1]
    assert phases[-1] == "Succeeded", phases  # the version deleted had finished
    (deleted_at,) = record.deleted["lorajobs"].values()
    completed = datetime.fromisoformat(last["status"]["completionTime"].replace("Z", "+00:00")).timestamp()
    assert deleted_at >= completed + ttl, (deleted_at - completed, phases)


def test_the_liveness_endpoint_answers(operator):
    with urllib.request.urlopen(operator.health_url, timeout=5) as response:
        assert response.status == 200
