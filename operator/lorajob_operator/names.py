"""Names and labels: the run name, each step's JobSet name and the hosts inside a JobSet, the API groups of the
resources the operator reads and writes, the label and annotation keys on them (ours, Kueue's, JobSet's, the Job
controller's, GKE's), and the length limits and patterns names must fit (rules.py turns those into the run-name
rule, in Python and CEL).

Constants and pure functions only: modules that need a name or a label key import this module, not the rendering.
"""

from __future__ import annotations

from typing import Protocol


class NamedRun(Protocol):
    """What `run_name` reads of a LoRAJobSpec (api.py imports this module, so this one names no api type)."""

    run_name: str | None

# --- Resources ------------------------------------------------------------------------------------

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"

# --- Label and annotation keys --------------------------------------------------------------------

LABEL_PREFIX = "lorajob.dev/"
LABEL_RUN = LABEL_PREFIX + "run-name"
LABEL_PHASE = LABEL_PREFIX + "phase"
LABEL_ATTEMPT = LABEL_PREFIX + "attempt"
"""Which try of the step a JobSet is (0 first); a retry recreates the JobSet under the same name."""
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ALLOWED_LABELS = (KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL)
ALLOWED_LABEL_PREFIXES = (LABEL_PREFIX,)

EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
COORDINATOR_LABEL = "jobset.sigs.k8s.io/coordinator"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICAS_LABEL = "jobset.sigs.k8s.io/replicatedjob-replicas"
# Labels JobSet and the Job controller put on every pod (with JOB_INDEX_LABEL): which JobSet,
# replicated job and pod of its Job it is.
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
ARGOCD_LINK_PREFIX = "link.argocd.argoproj.io/"
"""Argo CD shows the value of each annotation with this prefix as an external link of the resource (`URL` or
`title|URL`); the operator links each experiment tracker's run from its LoRAJob (`tracker_link`)."""


def tracker_link(tracker: str) -> str:
    """The annotation linking a LoRAJob to its run in one experiment tracker (contract.records.TRACKERS)."""
    return f"{ARGOCD_LINK_PREFIX}{tracker}-run"


def allowed_label(key: str) -> bool:
    """Children carry only these labels (Kueue's queue and priority labels and our own `lorajob.dev/*`)."""
    return key in ALLOWED_LABELS or key.startswith(ALLOWED_LABEL_PREFIXES)


# --- Names ----------------------------------------------------------------------------------------

# The replicated jobs of a train JobSet (the head: pathways backend only), and the trainer's container.
WORKER = "worker"
PATHWAYS_HEAD = "pathways-head"
TRAINER_CONTAINER = "trainer"

CHILD_SUFFIX = {"check": "-check", "convert": "-convert", "train": "", "export": "-to-hf"}
"""Suffix of each step's JobSet name; the train JobSet carries the run name itself (as in the tutorial)."""


def run_name(spec: NamedRun, metadata_name: str) -> str:
    return metadata_name if spec.run_name is None else spec.run_name  # as the CEL rules: "" is set (and invalid)


def child_name(run_name: str, phase: str) -> str:
    return run_name + CHILD_SUFFIX[phase]


def first_pod_host(jobset_name: str, replicated_job: str) -> str:
    """The DNS name of pod 0 of Job 0 of a replicated job, through the JobSet's headless service:
    `<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>` (also JobSet's coordinator label value)."""
    return f"{jobset_name}-{replicated_job}-0-0.{jobset_name}"


def pathways_coordinator(run_name: str) -> str:
    """The Pathways head's host: the train JobSet carries the run name itself."""
    return first_pod_host(run_name, PATHWAYS_HEAD)


# --- Length limits and patterns ---------------------------------------------------------------------

DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

WORKLOAD_NAME_MAX = 28
"""GKE resource names are at most 63 characters; Kueue and GKE prepend `default-`, `jobset-` and append
an 11-character Kueue hash and a 9-character node-pool hash: 63 - 8 - 7 - 11 - 9 = 28."""

LABEL_VALUE_MAX = 63
"""Kubernetes label values are at most 63 characters."""
OBJECT_NAME_PATTERN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
"""metadata.name of a LoRAJob, as the API server checks every custom object's name (an RFC 1123 subdomain; the
CRD's schema bounds its length)."""
DNS_LABEL_MAX = 63
"""Kubernetes object names that must be DNS labels (RFC 1123) are at most 63 characters."""

PATHWAYS_NAME_MAX = (LABEL_VALUE_MAX - len(pathways_coordinator(""))) // 2
"""The longest run name whose Pathways coordinator label value (the head's host) fits LABEL_VALUE_MAX."""
