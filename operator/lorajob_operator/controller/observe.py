"""What exists for one LoRAJob, from the watch-fed caches only (no request): `observe` -> reconcile.observed.Observed."""

from __future__ import annotations

from datetime import datetime

from lorajob_operator import api, policy, rules
from lorajob_operator.caches import Caches
from lorajob_operator.names import child_name, run_name
from lorajob_operator.reconcile.kueue import QueuePosition
from lorajob_operator.reconcile.observed import Observed, effective_spec, observe_child
from lorajob_operator.settings import RenderSettings
from lorajob_operator.validation import parse_spec


def spec_problems(view: Caches, namespace: str, spec: api.LoRAJobSpec) -> tuple[list[tuple[str, str]], str | None]:
    """Problems only a look at the cluster reveals, and the ClusterQueue behind the LocalQueue."""
    problems = []
    cluster_queue = None
    queue = spec.scheduling.queue_name
    if queue:
        local_queue = view.local_queue(namespace, queue)
        if local_queue is None:
            problems.append((
                "LocalQueueNotFound",
                f"Kueue LocalQueue {queue} (spec.scheduling.queueName or a LoRAJobPolicy default) does not exist in namespace {namespace}; "
                "ask your admin for the queue name to use",
            ))
        else:
            cluster_queue = local_queue.get("spec", {}).get("clusterQueue")
    return problems, cluster_queue


def _newest_workload(view: Caches, namespace: str, jobset: dict) -> dict | None:
    workloads = view.workloads_of(namespace, jobset["metadata"]["uid"])
    return max(workloads, key=lambda w: w["metadata"]["creationTimestamp"], default=None)


def _queue_position(view: Caches, workload: dict | None) -> QueuePosition | None:
    """Kueue's own position where its visibility API gave one, else the one worked out from the caches."""
    if workload is None:
        return None
    key = (workload["metadata"]["namespace"], workload["metadata"]["name"])
    if kueues := view.kueue_position(*key):
        return QueuePosition(kueues, from_kueue=True)
    found = view.queue_position(*key)
    return QueuePosition(found, namespaces=tuple(view.namespaces or ())) if found else None


def observe(
    view: Caches, body: dict, now: datetime, render_settings: RenderSettings,
    failed_pods: dict[str, list[dict]] | None = None,
) -> Observed:
    """What exists, from the caches only (pure: no request). `failed_pods`: the pods of failed children, by
    JobSet name, read by the caller when it wants the failed container named."""
    metadata = body["metadata"]
    namespace, name, uid = metadata["namespace"], metadata["name"], metadata["uid"]
    spec, errors = parse_spec(body)
    children, problems, cluster_queue = {}, [], None
    policies, namespace_labels = view.policies(), view.namespace_labels(namespace)
    if spec is not None:
        defaults = policy.resolve_defaults(policies, namespace_labels, spec)
        problems, cluster_queue = spec_problems(view, namespace, effective_spec(spec, defaults))
        run = run_name(spec, name)
        names = {child_name(run, phase): phase for phase in rules.phases(spec)}
        # A JobSet holding one of these names without our label is found when creating it fails (409).
        for jobset in view.jobsets_of_run(namespace, run):
            jobset_name = jobset["metadata"]["name"]
            if jobset_name in names:
                workload = _newest_workload(view, namespace, jobset)
                children[names[jobset_name]] = observe_child(
                    jobset, uid, workload, (failed_pods or {}).get(jobset_name), _queue_position(view, workload)
                )
    return Observed(
        name=name,
        namespace=namespace,
        generation=metadata.get("generation", 0),
        spec=spec,
        spec_errors=errors,
        status=body.get("status") or {},
        children=children,
        problems=tuple(problems),
        cluster_queue=cluster_queue,
        now=now,
        policies=policies,
        namespace_labels=namespace_labels,
        render=render_settings,
        annotations=metadata.get("annotations") or {},
    )
