"""In a burst the first JobSets go first: a new or edited LoRAJob's pass is handed out before follow-up passes,
and an update of fields no pass reads queues nothing."""

from __future__ import annotations

from builders import NAMESPACE, jobset, lorajob
from kubernetes import client

from lorajob_operator import caches
from lorajob_operator.kube import Controller, WorkQueue
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
