"""The English of status: progress summaries, failures, retries, and where a queued step stands in Kueue."""

from __future__ import annotations

from lorajob_operator.reconcile.kueue import WorkloadState
from lorajob_trainer.contract.records import COMPILING
from lorajob_operator.reconcile.observed import ChildState


def progress_summary(step: int, total_steps: int | None, state: str | None = None) -> str:
    """What `kubectl get lj` shows: `compiling` until the first step has run, then e.g. ` 120/1000  12%`, as
    wide at every step of a run (the step padded to the total's digits, the share to three), so that the
    columns of `kubectl get lj -w` stay where they are as the run advances."""
    if state == COMPILING:
        return COMPILING
    if not total_steps:
        return str(step)
    return f"{step:>{len(str(total_steps))}}/{total_steps} {100 * step // total_steps:>3}%"


def failure_text(phase: str, child: ChildState) -> str:
    text = f"the {phase} step failed (JobSet {child.name}"
    text += f": {child.failure_reason}" if child.failure_reason else ""
    text += ")"
    if child.container_failure:
        text += ": " + child.container_failure.describe()
    elif child.failure_message:
        text += ": " + child.failure_message
    return text


def retries_text(limit: int, budget: str) -> str:
    return f"after {limit} retr{'y' if limit == 1 else 'ies'}" if limit else f"({budget} is 0)"


def ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def waiting_for(workload: WorkloadState) -> str:
    """What a pending Workload waits for, e.g. `16 google.com/tpu (flavor tpu-v6e-slice-4x4)`: each resource
    Kueue's message says is short, with what the Workload requests of it in all. Kueue's message does not
    always name one (it may only list flavors that do not match): then the accelerators it requests, else
    everything it requests; "quota" before Kueue has looked at it."""
    flavors: dict[str, list[str]] = {}
    for resource, flavor in workload.short_of:
        flavors.setdefault(resource, []).append(flavor)
    if flavors:
        return ", ".join(
            " ".join(filter(None, (workload.requests.get(resource), resource))) + f" (flavor {' or '.join(names)})"
            for resource, names in flavors.items()
        )
    extended = {resource: total for resource, total in workload.requests.items() if "/" in resource}
    return ", ".join(f"{total} {resource}" for resource, total in (extended or workload.requests).items()) or "quota"


EXACT_QUEUE_POSITIONS = 10
"""Positions up to this are given exactly; further back, only the power of ten of the Workloads ahead, so
that the 1,000 LoRAJobs behind an admitted one do not all need a status write to say they moved up."""


def queue_place(position: int) -> str:
    """`3rd`, or `100+ Workloads ahead` (see EXACT_QUEUE_POSITIONS)."""
    if position <= EXACT_QUEUE_POSITIONS:
        return ordinal(position)
    return f"{10 ** (len(str(position - 1)) - 1)}+ Workloads ahead"


def waiting_for_quota(cluster_queue: str, workload: WorkloadState) -> tuple[str, str]:
    """(the short text, its details): position in the ClusterQueue and what the Workload waits for; then
    what the position counts and Kueue's own message."""
    queue = workload.queue
    where = f"{queue_place(queue.position)} in ClusterQueue {cluster_queue}" if queue else f"queued in ClusterQueue {cluster_queue}"
    details = []
    if queue and queue.from_kueue:
        details.append("Kueue's position (its visibility API), counting the pending Workloads of every namespace")
    elif queue:
        plural = "s" if len(queue.namespaces) > 1 else ""
        counted = f" in namespace{plural} {', '.join(queue.namespaces)}" if queue.namespaces else ""
        details.append(f"counting the pending Workloads{counted} in Kueue's order (priority, then creation)")
    if workload.pending_message:
        details.append(f"Kueue: {workload.pending_message}")
    return f"{where}; waiting for {waiting_for(workload)}", "; ".join(details)
