"""Queue positions from Kueue's visibility API (visibility.kueue.x-k8s.io `pendingworkloads`): Kueue's own order
of the pending Workloads, counting those of every namespace. Asked at each resync, one request per LocalQueue
that holds a pending Workload of the watched namespaces; where the cluster does not serve the API, observe
works the positions out from the caches (`caches.queue_positions`) instead, and the API is tried again later."""

from __future__ import annotations

import logging
import time

from kubernetes.client.exceptions import ApiException

from lorajob_operator.caches import Caches, Key
from lorajob_operator.controller.cluster import Cluster

log = logging.getLogger("lorajob.operator.kueue")

UNSERVED_RETRY_SECONDS = 300.0
"""How long after finding the API not served (404, 503) it is asked again."""
NOT_SERVED = (404, 503)


class KueueVisibility:
    def __init__(self, cluster: Cluster, view: Caches):
        self.cluster = cluster
        self.view = view
        self._unserved_until = 0.0

    def refresh(self) -> None:
        """Kueue's positions of every pending Workload in the LocalQueues that hold one of ours, into the caches."""
        if time.monotonic() < self._unserved_until:
            return
        positions: dict[Key, int] = {}
        for namespace, local_queue in sorted(self.view.pending_local_queues()):
            try:
                pending = self.cluster.pending_workloads(namespace, local_queue)
            except ApiException as error:
                if error.status not in NOT_SERVED:
                    raise
                log.info("Kueue's visibility API is not served (%s %s): queue positions are worked out from the "
                         "watched Workloads; asking again in %.0f s", error.status, error.reason, UNSERVED_RETRY_SECONDS)
                self._unserved_until = time.monotonic() + UNSERVED_RETRY_SECONDS
                self.view.kueue_positions = {}
                return
            positions |= {(namespace, item["metadata"]["name"]): item["positionInClusterQueue"] + 1 for item in pending}
        self.view.kueue_positions = positions
