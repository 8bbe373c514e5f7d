"""Per-test namespace (with a Kueue LocalQueue and the HF token Secret) and an operator process watching it."""

from __future__ import annotations

import hashlib
import re

import pytest
from lorajobs import HF_SECRET, Lorajobs

from lorajob_operator import names
from lorajob_operator.local import OperatorProcess, OperatorReplicas

FAST_OPERATOR = {
    "LORAJOB_RECONCILE_RESYNC_SECONDS": "1",
    "LORAJOB_RECONCILE_RETRY_BACKOFF_SECONDS": "1",
    "LORAJOB_RECONCILE_BLOCKED_RECHECK_SECONDS": "1",
    # A killed leader is replaced within 4 s + 2 looks.
    "LORAJOB_LEADER_LEASE_DURATION_SECONDS": "4",
    "LORAJOB_LEADER_RENEW_DEADLINE_SECONDS": "3",
    "LORAJOB_LEADER_RETRY_PERIOD_SECONDS": "0.5",
}


@pytest.fixture
def namespace(sim_cluster, request) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_")).strip("-")
    if len(slug) > 40:  # cut, with a hash of the whole name so that parametrized cases never share a namespace
        slug = slug[:33].strip("-") + "-" + hashlib.sha1(request.node.name.encode()).hexdigest()[:6]
    name = "e2e-" + slug
    sim_cluster.create_namespace_with_queue(name)
    sim_cluster.kubectl("-n", name, "create", "secret", "generic", HF_SECRET, "--from-literal=HF_TOKEN=hf_test")
    yield name
    sim_cluster.kubectl("delete", "namespace", name, "--wait=false")


@pytest.fixture
def lorajobs(sim_cluster, namespace) -> Lorajobs:
    return Lorajobs(sim_cluster, namespace)


@pytest.fixture
def start_operator(sim_cluster, namespace, tmp_path):
    """Starts an operator watching the test's namespace; every one started is stopped at the end."""
    started: list[OperatorProcess] = []

    def start(settings: dict[str, str] | None = None, namespaces: list[str] | None = None) -> OperatorProcess:
        """`settings`: LORAJOB_* overrides of FAST_OPERATOR; `namespaces`: those watched (the test's by default)."""
        process = OperatorProcess(sim_cluster.kubeconfig, namespaces or [namespace], tmp_path / "operator.log",
                                  FAST_OPERATOR | (settings or {}))
        started.append(process.start())
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def operator(start_operator) -> OperatorProcess:
    return start_operator()


@pytest.fixture
def replicas(sim_cluster, namespace, tmp_path) -> OperatorReplicas:
    """Two replicas of the operator watching the test's namespace (one Lease there): one leads, one stands by."""
    with OperatorReplicas(sim_cluster.kubeconfig, [namespace], tmp_path, FAST_OPERATOR) as started:
        yield started


@pytest.fixture
def trainer_log(sim_cluster, namespace, tmp_path):
    """The log file kwok serves for every trainer container in the test's namespace."""
    path = tmp_path / "trainer.log"
    path.write_text("")
    sim_cluster.serve_container_logs(namespace, names.TRAINER_CONTAINER, path)
    return path
