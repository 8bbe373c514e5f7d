"""In a burst the first JobSets go first: a new or edited LoRAJob's pass is handed out before follow-up passes,
and an update of fields no pass reads queues nothing."""

from __future__ import annotations

from builders import NAMESPACE, cluster_view, jobset, lorajob
from kubernetes import client

from lorajob_operator import caches
from lorajob_operator.controller.cluster import Cluster
from lorajob_operator.controller.loop import Controller
from lorajob_operator.controller.reconciler import Reconciler
from lorajob_operator.controller.work_queue import WorkQueue
from lorajob_operator.metrics import Metrics
from lorajob_operator.settings import OperatorSettings


def _drain(queue: WorkQueue, count: int) -> list:
    handed = []
    for _ in range(count):
        key, _ = queue.get()
        handed.append(key[1])
        queue.done(key)
    return handed


def test_an_urgent_key_is_handed_out_before_the_keys_queued_earlier():
    queue = WorkQueue()
    for name in ("a", "b"):
        queue.add((NAMESPACE, name))
    queue.add((NAMESPACE, "new"), urgent=True)
    queue.add((NAMESPACE, "b"), urgent=True)  # already waiting: moved ahead, not queued twice
    assert len(queue) == 3
    assert _drain(queue, 3) == ["new", "b", "a"]


def test_a_key_added_urgent_while_worked_on_goes_first_after_its_pass():
    queue = WorkQueue()
    queue.add((NAMESPACE, "edited"))
    key, _ = queue.get()
    queue.add((NAMESPACE, "other"))
    queue.add(key, urgent=True)
    queue.done(key)
    assert _drain(queue, 2) == ["edited", "other"]


def test_a_new_resource_version_of_the_same_slimmed_object_is_stored_but_is_no_change():
    store = caches.Store(caches.JOBSETS, caches._run_label)
    child = jobset(lorajob(), "convert", uid="js")
    assert store.upsert(child | {"metadata": child["metadata"] | {"resourceVersion": "5"}}) is not None
    version = store.version
    # The JobSet controller counting its jobs: a field the slimmed JobSet drops.
    counted = child | {"metadata": child["metadata"] | {"resourceVersion": "6"}, "status": {"replicatedJobsStatus": [{"active": 1}]}}
    assert store.upsert(counted) is None
    assert store.version == version
    (stored,) = store.items()
    assert stored["metadata"]["resourceVersion"] == "6"  # so an older event stays older
    assert store.upsert(child | {"metadata": child["metadata"] | {"resourceVersion": "5"}}) is None


def test_a_lorajob_no_pass_has_acted_on_is_queued_urgent():
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"
    controller = Controller(client.ApiClient(configuration), OperatorSettings(), [NAMESPACE], Metrics())
    controller._synced.set()
    observed = {"observedGeneration": 1, "phase": "Queued"}
    controller._on_change(caches.LORAJOBS, lorajob("running", status=observed))
    controller._on_change(caches.LORAJOBS, lorajob("edited", status=observed, generation=2))
    controller._on_change(caches.LORAJOBS, lorajob("new"))
    assert _drain(controller.queue, 3) == ["edited", "new", "running"]


class _RecordingApi:
    """In place of the client's CustomObjectsApi and CoreV1Api: records each write and answers as the API server
    would, with the object written."""

    def __init__(self, view: caches.Caches):
        self.view = view
        self.writes: list[tuple[str, str]] = []

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, **_):
        self.writes.append(("create " + plural, body["metadata"]["name"]))
        return body | {"metadata": body["metadata"] | {"uid": "js-uid", "resourceVersion": str(len(self.writes))}}

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body):
        self.writes.append(("status", name))
        stored = self.view.lorajob(namespace, name)
        return stored | {"metadata": stored["metadata"] | {"resourceVersion": str(100 + len(self.writes))}, "status": body["status"]}

    def create_namespaced_event(self, namespace, event):
        self.writes.append(("event", event["reason"]))


def test_a_new_lorajobs_pass_only_creates_its_jobset_and_the_pass_after_writes_its_status():
    body = lorajob(resourceVersion="1")
    view = cluster_view(body)
    cluster = Cluster(client.ApiClient(client.Configuration()))
    cluster.custom = cluster.core = recorded = _RecordingApi(view)
    reconciler = Reconciler(cluster, view, OperatorSettings())
    name = body["metadata"]["name"]

    reconciler.reconcile(NAMESPACE, name)
    assert recorded.writes == [("create jobsets", f"{name}-convert")]
    reconciler.reconcile(NAMESPACE, name)  # the JobSet's watch event queues this one
    assert recorded.writes[1:] == [("status", name), ("event", "Queued")]
    assert view.lorajob(NAMESPACE, name)["status"]["observedGeneration"] == 1
    reconciler.reconcile(NAMESPACE, name)
    assert len(recorded.writes) == 3
