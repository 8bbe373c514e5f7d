"""The reconcile reads the watch caches only: an unchanged LoRAJob costs no API request."""

from __future__ import annotations

import json
import threading
from datetime import datetime, UTC

import pytest
from builders import NAMESPACE, cluster_view, condition, jobset, lorajob, spec_dict, workload
from kubernetes import client

from lorajob_operator import caches
from lorajob_operator.controller.cluster import Cluster
from lorajob_operator.controller.loop import Controller
from lorajob_operator.controller.observe import observe
from lorajob_operator.controller.reconciler import Reconciler
from lorajob_operator.controller.work_queue import Resync, WorkQueue
from lorajob_operator.controller.writes import status_patch
from lorajob_operator.metrics import CountingRESTClient, Metrics
from lorajob_operator.reconcile.decide import decide
from lorajob_operator.reconcile.kueue import QueuePosition
from lorajob_operator.settings import OperatorSettings

SETTINGS = OperatorSettings()


def _nowhere_client(metrics: Metrics) -> client.ApiClient:
    """A client whose every request is counted, and fails (nothing listens on the discard port)."""
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"
    configuration.retries = 0
    api_client = client.ApiClient(configuration)
    api_client.rest_client = CountingRESTClient(configuration, metrics)
    return api_client


def _requests(metrics: Metrics) -> float:
    return sum(sample.value for family in metrics.api_requests.collect() for sample in family.samples
               if sample.name.endswith("_total"))


def _training_world() -> tuple[caches.Caches, dict]:
    """Caches holding a LoRAJob whose train step runs (convert done), admitted by Kueue, and all it reads."""
    body = lorajob(resourceVersion="10")
    view = cluster_view(body, namespace_labels={"team": "a"})
    stores = view.stores
    for phase, uid, conditions in (("convert", "js-convert", [condition("Completed")]), ("train", "js-train", [])):
        stores[caches.JOBSETS].upsert(jobset(body, phase, uid=uid, conditions=conditions) | {"kind": "JobSet"})
        admitted = workload(condition("QuotaReserved"), condition("Admitted"), cluster_queue="cq-tpu")
        admitted["metadata"] |= {"name": f"wl-{phase}", "namespace": NAMESPACE, "labels": {caches.KUEUE_JOB_UID_LABEL: uid}}
        stores[caches.WORKLOADS].upsert(admitted)
    return view, body


def test_a_reconcile_of_an_unchanged_lorajob_sends_no_request():
    metrics = Metrics()
    view, body = _training_world()
    reconciler = Reconciler(Cluster(_nowhere_client(metrics)), view, SETTINGS)

    # Its status is not written yet: the pass must write it (and here fails: the counter sees it).
    with pytest.raises(Exception):  # noqa: B017 - whatever the transport raises: no server is there
        reconciler.reconcile(NAMESPACE, body["metadata"]["name"])
    assert _requests(metrics) == 1

    now = datetime.now(UTC)
    status = decide(observe(view, body, now, SETTINGS.render), SETTINGS.reconcile).status
    assert status["phase"] == "Training"
    view.stores[caches.LORAJOBS].upsert(body | {"metadata": body["metadata"] | {"resourceVersion": "11"}, "status": status})
    for _ in range(3):
        assert reconciler.reconcile(NAMESPACE, body["metadata"]["name"]) is None
    assert _requests(metrics) == 1


def test_observe_reads_the_caches_only_and_finds_each_step_and_its_workload():
    view, body = _training_world()
    observed = observe(view, body, datetime.now(UTC), SETTINGS.render)
    assert sorted(observed.children) == ["convert", "train"]
    assert observed.children["convert"].completed
    assert observed.children["train"].workload.admitted
    assert observed.cluster_queue == "cq-tpu" and observed.problems == ()
    assert observed.namespace_labels == {"team": "a"}


def test_cached_objects_share_their_field_names_and_short_values_and_drop_what_no_pass_reads():
    """Thousands of cached LoRAJobs, JobSets and Workloads hold one copy of each key and repeated value."""
    store = caches.Store(caches.WORKLOADS)
    first, second = (  # each decoded on its own, as watch events are: no strings shared yet
        store.upsert(json.loads(json.dumps(workload(condition("QuotaReserved", reason="QuotaReserved", message="m" * 80), name=name))))
        for name in ("w-1", "w-2")
    )
    (a,), (b,) = first["status"]["conditions"], second["status"]["conditions"]
    for key in ("type", "status", "reason", "lastTransitionTime"):
        (key_a,), (key_b,) = [k for k in a if k == key], [k for k in b if k == key]
        assert key_a is key_b and a[key] is b[key], key
    assert a["message"] == b["message"]  # a long message is kept as it is, not interned
    applied = lorajob() | {"metadata": lorajob()["metadata"] | {
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{...}"}, "managedFields": [{}]}}
    cached = caches.Store(caches.LORAJOBS).upsert(applied)
    assert "annotations" not in cached["metadata"] and "managedFields" not in cached["metadata"]
    assert cached["spec"] == applied["spec"]
    link = {"link.argocd.argoproj.io/mlflow-run": "MLflow run|https://mlflow.example.com/#/runs/1"}
    linked = applied | {"metadata": applied["metadata"] | {"annotations": {**applied["metadata"]["annotations"], **link}}}
    assert caches.Store(caches.LORAJOBS).upsert(linked)["metadata"]["annotations"] == link  # what decide compares with


def test_an_older_version_never_replaces_a_newer_one_and_a_deletion_drops_it_from_its_index():
    store = caches.Store(caches.JOBSETS, caches._run_label)
    body = lorajob()
    child = jobset(body, "train", uid="b")
    newer = child | {"metadata": child["metadata"] | {"resourceVersion": "7"}}
    older = newer | {"metadata": newer["metadata"] | {"resourceVersion": "5"}, "status": {"conditions": [condition("Failed")]}}
    assert store.upsert(newer) is not None
    assert store.upsert(older) is None
    (found,) = store.indexed((NAMESPACE, body["metadata"]["name"]))
    assert found["metadata"]["resourceVersion"] == "7"
    assert store.remove(child) == found
    assert len(store) == 0 and store.indexed((NAMESPACE, body["metadata"]["name"])) == []


def test_the_sweep_removes_only_what_is_still_stored_as_it_was_listed():
    """A newer version, or an object re-created under the same name, arrived after the sweep's snapshot: kept."""
    store = caches.Store(caches.JOBSETS, caches._run_label)
    listed = jobset(lorajob(), "train", uid="b")
    child = listed | {"metadata": listed["metadata"] | {"resourceVersion": "7"}}
    snapshot = store.upsert(child)
    for arrived in ({"resourceVersion": "8"}, {"uid": "c"}):
        store.upsert(child | {"metadata": child["metadata"] | arrived, "spec": {"suspend": True}})
        assert store.remove_unchanged(snapshot) is None and len(store) == 1
        store.remove(child)
        store.upsert(child)
    assert store.remove_unchanged(snapshot) == snapshot
    assert len(store) == 0 and store.indexed((NAMESPACE, lorajob()["metadata"]["name"])) == []


def test_the_work_queue_hands_a_key_to_one_worker_at_a_time_and_keeps_read_progress():
    queue = WorkQueue()
    key = (NAMESPACE, "a")
    queue.add(key)
    assert queue.get() == (key, False)
    queue.add(key, read_progress=True)  # while being worked on: queued again, not handed out
    queue.add(key)
    handed: list = []
    other = threading.Thread(target=lambda: handed.append(queue.get()))
    other.start()
    other.join(timeout=0.2)
    assert handed == [] and len(queue) == 1
    queue.done(key)
    other.join(timeout=5)
    assert handed == [(key, True)]
    queue.close()
    assert queue.get() is None


def test_a_pass_a_lorajob_asked_for_reads_the_trainer_log():
    """The stall watchdog's pass at its deadline judges the trainer's newest step, not the last resync's."""
    queue = WorkQueue()
    resync = Resync(caches.Caches([NAMESPACE]), queue, interval=3600)
    resync.schedule((NAMESPACE, "a"), 0)
    resync.start()
    try:
        assert queue.get() == ((NAMESPACE, "a"), True)
    finally:
        resync.stop()


def test_the_status_write_removes_what_the_decision_left_out():
    """A merge patch keeps fields it does not name: the write names each removed one, nested ones too."""
    old = {"phase": "Training", "progress": {"step": 3, "advancedTime": "2026-01-01T12:00:00Z"}, "conditions": [{"type": "A"}]}
    new = {"phase": "Training", "progress": {"step": 3, "loss": 1.0}, "conditions": []}
    assert status_patch(old, new) == {"phase": "Training", "progress": {"step": 3, "loss": 1.0, "advancedTime": None}, "conditions": []}
    assert status_patch({}, new) == new


def _pending(name: str, created: str, **kwargs) -> dict:
    return workload(condition("QuotaReserved", "False", "Pending", "waiting"), name=name, created=created, **kwargs)


def test_pending_workloads_are_placed_in_kueues_order_per_cluster_queue():
    cluster_queues = {(NAMESPACE, "lorajob"): "cq-tpu", (NAMESPACE, "cpu"): "cq-cpu"}
    evicted = _pending("requeued", "2026-01-01T00:00:00Z")
    evicted["status"]["conditions"].append(condition("Evicted", reason="PodsReadyTimeout", at="2026-01-01T00:10:00Z"))
    workloads = [
        _pending("b-later", "2026-01-01T00:02:00Z"),
        _pending("a-same-second", "2026-01-01T00:02:00Z"),
        _pending("urgent", "2026-01-01T00:05:00Z", priority=100),
        _pending("earliest", "2026-01-01T00:01:00Z"),
        evicted,
        _pending("other-queue", "2026-01-01T00:03:00Z", queue_name="cpu"),
        _pending("no-local-queue", "2026-01-01T00:00:00Z", queue_name="missing"),
        _pending("inactive", "2026-01-01T00:00:00Z") | {"spec": {"queueName": "lorajob", "active": False}},
        workload(condition("QuotaReserved"), condition("Admitted"), name="admitted", cluster_queue="cq-tpu"),
        workload(condition("QuotaReserved", "False"), condition("Finished"), name="finished"),
    ]
    positions = caches.queue_positions([caches.WORKLOADS.slim(w) for w in workloads], lambda ns, q: cluster_queues.get((ns, q)))
    assert positions == {
        (NAMESPACE, "urgent"): 1, (NAMESPACE, "earliest"): 2, (NAMESPACE, "a-same-second"): 3,
        (NAMESPACE, "b-later"): 4, (NAMESPACE, "requeued"): 5, (NAMESPACE, "other-queue"): 1,
    }


def test_observe_places_a_queued_step_from_the_caches_and_follows_the_queue_as_it_moves():
    body = lorajob(resourceVersion="10", spec=spec_dict(model={"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://b/ckpt/0/items"}))
    view = cluster_view(body)
    stores = view.stores
    stores[caches.JOBSETS].upsert(jobset(body, "train", uid="js-train", suspend=True))
    ours = _pending("ours", "2026-01-01T00:02:00Z")
    ours["metadata"]["labels"] = {caches.KUEUE_JOB_UID_LABEL: "js-train"}
    stores[caches.WORKLOADS].upsert(ours)
    ahead = _pending("someone-elses", "2026-01-01T00:01:00Z")
    stores[caches.WORKLOADS].upsert(ahead)

    def queue():
        return observe(view, body, datetime.now(UTC), SETTINGS.render).children["train"].workload.queue

    assert queue() == QueuePosition(2, (NAMESPACE,))
    admitted = workload(condition("QuotaReserved"), name="someone-elses", cluster_queue="cq-tpu")
    stores[caches.WORKLOADS].upsert(admitted | {"metadata": admitted["metadata"] | {"resourceVersion": "5"}})
    assert queue() == QueuePosition(1, (NAMESPACE,))


def test_kueues_own_position_comes_first_while_its_workload_is_pending_else_the_one_worked_out():
    body = lorajob(resourceVersion="10", spec=spec_dict(model={"name": "qwen3-0.6b", "maxtextCheckpoint": "gs://b/ckpt/0/items"}))
    view = cluster_view(body)
    view.stores[caches.JOBSETS].upsert(jobset(body, "train", uid="js-train", suspend=True))
    ours = _pending("ours", "2026-01-01T00:02:00Z")
    ours["metadata"]["labels"] = {caches.KUEUE_JOB_UID_LABEL: "js-train"}
    view.stores[caches.WORKLOADS].upsert(ours)
    assert view.pending_local_queues() == {(NAMESPACE, ours["spec"]["queueName"])}

    def queue():
        return observe(view, body, datetime.now(UTC), SETTINGS.render).children["train"].workload.queue

    assert queue() == QueuePosition(1, (NAMESPACE,))  # worked out: the only pending Workload the operator sees
    view.kueue_positions = {(NAMESPACE, "ours"): 7}  # Kueue counts the other namespaces' too
    assert queue() == QueuePosition(7, from_kueue=True)
    admitted = workload(condition("QuotaReserved"), name="ours", cluster_queue="cq-tpu")
    admitted["metadata"] |= {"resourceVersion": "5", "labels": ours["metadata"]["labels"]}
    view.stores[caches.WORKLOADS].upsert(admitted)
    assert queue() is None  # admitted since Kueue was last asked: its old position is not shown


def test_a_change_to_another_workload_queues_no_pass_the_resync_moves_the_queued_lorajobs_up():
    controller = Controller(_nowhere_client(Metrics()), SETTINGS, [NAMESPACE], Metrics())
    stores = controller.caches.stores
    for name, phase in (("waiting", "Queued"), ("running", "Training")):
        stores[caches.LORAJOBS].upsert(lorajob(name, status={"phase": phase}))
    unrelated = _pending("someone-elses", "2026-01-01T00:01:00Z")
    assert controller._affected(caches.WORKLOADS, unrelated) == []
