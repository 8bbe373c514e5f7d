"""Reading Kueue: a Workload's state (reserved, admitted, evicted, pending and why), what it requests in all, and
which quotas its pending message says it is short of."""

from __future__ import annotations

import dataclasses
import re
from decimal import Decimal
from collections.abc import Mapping

from lorajob_operator.reconcile.conditions import find_condition, is_true


@dataclasses.dataclass(frozen=True)
class QueuePosition:
    """Where a pending Workload stands among the pending Workloads of its ClusterQueue, in Kueue's order."""

    position: int
    """1 for the Workload Kueue considers next."""
    namespaces: tuple[str, ...] = ()
    """The namespaces whose Workloads were counted when the operator watches only some (empty: all)."""
    from_kueue: bool = False
    """Kueue's own position (its visibility API), counting every namespace; else worked out from the caches."""


@dataclasses.dataclass(frozen=True)
class WorkloadState:
    name: str
    quota_reserved: bool
    admitted: bool
    cluster_queue: str | None
    """The ClusterQueue that admitted it (None while pending)."""
    pending_reason: str
    pending_message: str
    evicted_reason: str | None
    """Set while an eviction (preemption, deactivation, ...) is in effect."""
    evicted_message: str
    requests: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What its pod sets request in all, by resource (Kueue's status.resourceRequests of a pending Workload)."""
    short_of: tuple[tuple[str, str], ...] = ()
    """(resource, flavor) pairs whose quota Kueue's pending message says is used up, in its order."""
    queue: QueuePosition | None = None


# Kueue's flavor assigner: "insufficient unused quota [in cohort] for <resource> in flavor <flavor>, <n> more needed"
# (quota in use by others: it may free up), "insufficient quota for <resource> in flavor <flavor>, ..." (never enough).
_QUOTA_IN_USE = re.compile(r"insufficient unused quota (?:in cohort )?for (\S+) in flavor ([^\s,;]+), \S+ more needed")


_ANY_QUOTA = re.compile(r"quota (?:in cohort )?for (\S+) in flavor ([^\s,;]+)")


def short_of(pending_message: str) -> tuple[tuple[str, str], ...]:
    """The (resource, flavor) pairs Kueue's pending message names: those whose quota is in use, else any."""
    pairs = _QUOTA_IN_USE.findall(pending_message) or _ANY_QUOTA.findall(pending_message)
    return tuple(dict.fromkeys(pairs))


def _quantity_text(value: Decimal) -> str:
    if value != value.to_integral_value():
        return str(value.normalize())
    for suffix, size in (("Gi", 2**30), ("Mi", 2**20)):
        if value >= size and value % size == 0:
            return f"{int(value) // size}{suffix}"
    return str(int(value))


def total_requests(pod_set_requests: list[dict]) -> dict[str, str]:
    """status.resourceRequests (one entry per pod set, totals of its pods) summed by resource."""
    # Imported here: `kubernetes.utils` loads the whole client, which `lorajob render` and `validate` never need.
    from kubernetes.utils.quantity import parse_quantity

    totals: dict[str, Decimal] = {}
    for pod_set in pod_set_requests:
        for resource, quantity in (pod_set.get("resources") or {}).items():
            totals[resource] = totals.get(resource, Decimal(0)) + parse_quantity(quantity)
    return {resource: _quantity_text(total) for resource, total in totals.items()}


def observe_workload(workload: dict, queue: QueuePosition | None = None) -> WorkloadState:
    quota = find_condition(workload, "QuotaReserved") or {}
    evicted = find_condition(workload, "Evicted")
    active_eviction = evicted is not None and evicted.get("status") == "True"
    status = workload.get("status", {})
    admission = status.get("admission") or {}
    return WorkloadState(
        name=workload["metadata"]["name"],
        quota_reserved=is_true(workload, "QuotaReserved"),
        admitted=is_true(workload, "Admitted"),
        cluster_queue=admission.get("clusterQueue"),
        pending_reason=quota.get("reason", ""),
        pending_message=quota.get("message", ""),
        evicted_reason=evicted.get("reason") if active_eviction else None,
        evicted_message=evicted.get("message", "") if active_eviction else "",
        requests=total_requests(status.get("resourceRequests") or []),
        short_of=short_of(quota.get("message", "")),
        queue=queue,
    )
