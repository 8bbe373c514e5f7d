"""What drives the operator: watch events alone (resync effectively off), or the cache-based resync alone
(every change event lost), each takes a LoRAJob through its whole chain to Succeeded on the simulated cluster."""

from __future__ import annotations

import pytest
from in_process import kopf_operator
from lorajobs import sample

from lorajob_devcluster.process import free_loopback_port
from lorajob_operator import handlers
from lorajob_operator.controller.loop import Controller

pytestmark = pytest.mark.cluster
RESYNC_OFF = {"LORAJOB_RECONCILE_RESYNC_SECONDS": "3600"}


def test_watch_events_alone_take_a_lorajob_to_succeeded(lorajobs, start_operator):
    operator = start_operator(RESYNC_OFF | {"LORAJOB_METRICS_PORT": str(free_loopback_port())})
    lorajobs.apply(sample("events"))
    done = lorajobs.wait_phase("events", "Succeeded", timeout=180)
    assert done["status"]["restarts"] == {"check": 0, "convert": 0, "train": 0, "export": 0}

    metrics = operator.metrics()
    assert metrics['lorajob_operator_lorajobs{phase="Succeeded"}'] == 1
    assert metrics['lorajob_operator_cache_objects{resource="jobsets"}'] == 3
    assert metrics['lorajob_operator_api_requests_total{verb="create"}'] > 0
    assert metrics['lorajob_operator_reconciles_total{result="ok"}'] > 0
    assert metrics["lorajob_operator_leader"] == 1


class _DeafController(Controller):
    """Loses every change event the watches deliver, as if the pass each one queued was lost."""

    def _on_change(self, resource, obj) -> None:
        pass


def test_with_every_event_lost_the_cache_resync_still_converges(sim_cluster, lorajobs, namespace, monkeypatch):
    monkeypatch.setattr(handlers, "Controller", _DeafController)
    settings = {"LORAJOB_RECONCILE_RESYNC_SECONDS": "1", "LORAJOB_METRICS_PORT": "0", "LORAJOB_LEADER_ENABLED": "false"}
    with kopf_operator(monkeypatch, sim_cluster.kubeconfig, [namespace], settings) as controller:
        assert isinstance(controller, _DeafController)
        lorajobs.apply(sample("resynced", train_only=True))
        done = lorajobs.wait_phase("resynced", "Succeeded", timeout=120)
    assert done["status"]["restarts"]["train"] == 0
    assert len([js for js in lorajobs.jobsets() if js["metadata"]["name"] == "resynced"]) == 1


class _DeletionBlindController(Controller):
    """Misses every deletion, as kopf's re-list after 410 Gone does for objects deleted while it was not watching."""

    def watched(self, resource, event_type, obj) -> None:
        if event_type != "DELETED":
            super().watched(resource, event_type, obj)


def test_the_sweep_drops_what_a_missed_deletion_left_in_the_caches(sim_cluster, lorajobs, namespace, monkeypatch):
    monkeypatch.setattr(handlers, "Controller", _DeletionBlindController)
    settings = {"LORAJOB_RECONCILE_RESYNC_SECONDS": "1", "LORAJOB_WATCH_SWEEP_SECONDS": "1",
                "LORAJOB_METRICS_PORT": "0", "LORAJOB_LEADER_ENABLED": "false"}
    with kopf_operator(monkeypatch, sim_cluster.kubeconfig, [namespace], settings) as controller:
        for name in ("deleted", "kept"):
            lorajobs.apply(sample(name, train_only=True))
        lorajobs.wait_until(lambda: any(controller.caches.workloads_of(namespace, js["metadata"]["uid"])
                                        for js in controller.caches.jobsets_of_run(namespace, "deleted")),
                            "a JobSet of the LoRAJob to delete, and its Kueue Workload, in the cache")
        deleted_jobsets = [js["metadata"]["uid"] for js in controller.caches.jobsets_of_run(namespace, "deleted")]
        lorajobs.delete("deleted")  # its JobSets and their Workloads follow (garbage collection): every deletion unseen

        def nothing_of_the_deleted_run_cached() -> bool:
            return (controller.caches.lorajob(namespace, "deleted") is None
                    and not controller.caches.jobsets_of_run(namespace, "deleted")
                    and not any(controller.caches.workloads_of(namespace, uid) for uid in deleted_jobsets))

        lorajobs.wait_until(nothing_of_the_deleted_run_cached,
                            "the sweep dropping the deleted LoRAJob, its JobSets and their Workloads from the cache",
                            timeout=60)
        swept = {resource: controller.metrics.registry.get_sample_value(
            "lorajob_operator_cache_swept_total", {"resource": resource}) for resource in ("lorajobs", "jobsets")}
        assert swept["lorajobs"] == 1 and swept["jobsets"] >= 1, swept
        assert controller.caches.lorajob(namespace, "kept") is not None
        assert controller.caches.jobsets_of_run(namespace, "kept")
        assert controller.sweep.run() == 0  # what exists stays
