"""kopf wiring: kopf's watches feed the operator's caches (watches.py) and kopf hosts its
`controller.loop.Controller` (work queue, workers, resync) and serves the liveness probe. Its handlers only
read (an index and an event handler per resource), so kopf writes nothing on the objects: the state lives
in the cluster and in LoRAJob status. Of several replicas, the one holding the Lease (leader.py)
reconciles; the others stand by with warm caches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes import client, config

from lorajob_operator import leader, watches
from lorajob_operator.controller.cluster import LeaderOnlyRESTClient
from lorajob_operator.controller.loop import Controller
from lorajob_operator.metrics import CountingRESTClient, Metrics
from lorajob_operator.settings import OperatorSettings


def _api_client(metrics: Metrics, connections: int, write_allowed: Callable[[], bool] | None = None) -> client.ApiClient:
    """A client counting its requests into `metrics`; with `write_allowed`, one that sends no write while it is false."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = connections  # else each pass beyond the pool opens a new TLS connection
    api_client = client.ApiClient(configuration)
    api_client.rest_client = (CountingRESTClient(configuration, metrics) if write_allowed is None
                              else LeaderOnlyRESTClient(configuration, metrics, write_allowed))
    return api_client


def _leadership(ours: OperatorSettings, namespaces: list[str] | None, metrics: Metrics) -> leader.LeaderElector | leader.NoElection:
    if not ours.leader.enabled:
        return leader.NoElection()
    # Its own client: the Lease's requests never wait behind the workers' connections.
    return leader.LeaderElector(_api_client(metrics, 1), ours.leader, leader.lease_namespace(ours.leader, namespaces),
                                leader.identity(ours.leader))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    ours = OperatorSettings.from_env()
    settings.posting.enabled = False  # our events are the phase transitions, posted by the reconciler
    watches.configure(settings, ours.watch)
    metrics = Metrics()
    leadership = _leadership(ours, memo.namespaces, metrics)
    memo.controller = Controller(
        _api_client(metrics, ours.reconcile.workers, leadership.leading), ours, memo.namespaces, metrics, leadership
    )
    if ours.metrics.port:
        metrics.serve(ours.metrics.port)
    logger.info("lorajob operator configured: %s", ours)


@kopf.on.cleanup()
def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.controller.stop()
    memo.controller.metrics.stop()


@kopf.on.probe(id="controller")
def controller_alive(memo: kopf.Memo, **_: Any) -> str:
    if not memo.controller.alive():
        raise RuntimeError("a worker, the resync loop or the campaign of the operator has stopped")
    return "ok"
