"""Control-plane chaos at CI scale: 6 LoRAJobs through convert -> train -> export while the leader of two
operator replicas is SIGKILLed 3 times (a standby takes over) and kube-apiserver, JobSet and Kueue are each
SIGKILLed and restarted once, at seeded random moments (LORAJOB_CHAOS_SEED picks another run; a failure
names its seed). The large run is bench/chaos.py. The checks themselves are tested first, on hand-made histories."""

from __future__ import annotations

import itertools
import os

import pytest
from chaos import OPERATOR, RESTARTABLE, plan, problems, run
from lorajobs import sample

from lorajob_operator import api, names, rules

SEED = int(os.environ.get("LORAJOB_CHAOS_SEED", "12"))
RUN = "a"
RUN_UID = "uid-a"
SPEC = sample(RUN)["spec"]
STEPS = rules.phases(api.LoRAJobSpec.model_validate(SPEC))  # convert, train, export


def _lorajob(phase: str, **status) -> dict:
    conditions = [{"type": "Succeeded", "status": "True", "observedGeneration": 1}] if phase == "Succeeded" else []
    return {"metadata": {"name": RUN, "uid": RUN_UID, "generation": 1}, "spec": SPEC,
            "status": {"phase": phase, "observedGeneration": 1, "conditions": conditions,
                       "children": {step: names.child_name(RUN, step) for step in STEPS},
                       "restarts": dict.fromkeys(rules.PHASES, 0),
                       "startTime": "2026-01-01T00:00:00Z", "completionTime": "2026-01-01T00:01:00Z", **status}}


def _server_time(second: int) -> str:
    return f"2026-01-01T00:00:{second:02d}Z"


def _jobset(step: str, uid: str, completed: bool, attempt: int = 0, owner_uid: str = RUN_UID,
            created: int = 0, completed_at: int = 0) -> dict:
    """`created`, `completed_at`: the API server's seconds of its creation and of its Completed condition."""
    labels = {names.LABEL_RUN: RUN, names.LABEL_PHASE: step, names.LABEL_ATTEMPT: str(attempt)}
    done = [{"type": "Completed", "status": "True", "lastTransitionTime": _server_time(completed_at)}]
    return {"kind": "JobSet",
            "metadata": {"name": names.child_name(RUN, step), "uid": uid, "labels": labels,
                         "creationTimestamp": _server_time(created),
                         "ownerReferences": [{"kind": "LoRAJob", "name": RUN, "uid": owner_uid, "controller": True}]},
            "status": {"conditions": done if completed else []}}


def _good() -> tuple[list, list]:
    """A chain as the recorder sees it; its clock doubles as the API server's seconds."""
    clock = itertools.count()
    jobsets, lorajobs = [], [(next(clock), _lorajob("Queued"))]
    for step, phase in zip(STEPS, ("Converting", "Training", "Exporting"), strict=True):
        created = next(clock)
        jobsets.append((created, _jobset(step, f"uid-{step}", completed=False, created=created)))
        lorajobs.append((next(clock), _lorajob(phase)))
        done = next(clock)
        jobsets.append((done, _jobset(step, f"uid-{step}", completed=True, created=created, completed_at=done)))
    lorajobs.append((next(clock), _lorajob("Succeeded")))
    return jobsets, lorajobs


def test_a_clean_history_has_no_problems():
    assert problems(*_good(), [RUN], [_jobset("train", "uid-train", True)]) == []


@pytest.mark.parametrize("break_it, expected", [
    (lambda js, lj: js.append((99, _jobset("train", "uid-train-2", True))),
     "2 JobSets were created for LoRAJob a step train attempt 0"),
    (lambda js, lj: js.append((99, _jobset("convert", "uid-convert-1", False, attempt=1))),
     "LoRAJob a: step convert ran again after it completed"),
    (lambda js, lj: js.insert(0, (-1, _jobset("export", "uid-early", False))),
     "LoRAJob a: step export started before step train completed"),
    (lambda js, lj: js.append((99, _jobset("export", "uid-export", True, owner_uid="someone-else"))),
     "JobSet a-to-hf (uid-export) is not controlled by its LoRAJob"),
    (lambda js, lj: lj.insert(-1, (98, _lorajob("Converting"))), "LoRAJob a went back to Converting"),
    (lambda js, lj: lj.append((99, _lorajob("Succeeded", observedGeneration=0))), "LoRAJob a: observedGeneration 0"),
    (lambda js, lj: lj.append((99, _lorajob("Succeeded", restarts={"convert": 1, "train": 0, "export": 0}))),
     "LoRAJob a step convert: JobSets of attempts [0], status.restarts 1"),
    (lambda js, lj: lj.append((99, _lorajob("Training"))), "LoRAJob a left Succeeded for Training"),
])
def test_each_broken_rule_is_reported(break_it, expected):
    jobsets, lorajobs = _good()
    break_it(jobsets, lorajobs)
    found = problems(jobsets, lorajobs, [RUN], [])
    assert any(line.startswith(expected) for line in found), found


def test_a_listing_after_a_watch_gap_shows_steps_at_once_in_any_order_and_only_the_servers_clock_judges_them():
    """The recorder missed the convert step's completion and the train step's creation (kube-apiserver
    restarting) and lists both at one moment, the train JobSet first (names sort so)."""
    jobsets, lorajobs = _good()
    convert_done, train_created, train_done = jobsets[1], jobsets[2], jobsets[3]
    listed_at = train_created[0]
    jobsets[1:3] = [(listed_at, train_created[1]), (listed_at, convert_done[1])]
    assert problems(jobsets, lorajobs, [RUN], []) == []
    created_too_early = _jobset("train", "uid-train", False, created=convert_done[0] - 1)
    jobsets[1] = (listed_at, created_too_early)
    jobsets[3] = (train_done[0], train_done[1] | {"metadata": created_too_early["metadata"]})
    found = problems(jobsets, lorajobs, [RUN], [])
    assert any(line.startswith("LoRAJob a: step train started before step convert completed") for line in found), found


def test_an_orphaned_child_is_reported():
    workload = {"kind": "Workload", "metadata": {"name": "w", "uid": "uid-w", "ownerReferences": [
        {"kind": "JobSet", "name": "gone", "uid": "uid-gone", "controller": True}]}}
    assert problems(*_good(), [RUN], [workload]) == ["orphaned Workload w: its JobSet gone is gone"]


def test_the_plan_is_seeded():
    assert plan(SEED, 3) == plan(SEED, 3)
    assert sorted(fault.target for fault in plan(SEED, 3)) == sorted([OPERATOR] * 3 + list(RESTARTABLE))


@pytest.mark.slow
@pytest.mark.cluster
def test_lorajobs_survive_leader_kills_and_control_plane_restarts(sim_cluster, namespace, replicas):
    outcome = run(sim_cluster, namespace, replicas, SEED, jobs=6, operator_kills=3, timeout=300)

    assert sorted(item.fault.target for item in outcome.injected) == sorted([OPERATOR] * 3 + list(RESTARTABLE))
    assert set(outcome.record.latest("lorajobs")) == set(outcome.names)
