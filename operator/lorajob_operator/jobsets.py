"""LoRAJob spec -> the JobSet of each step, as plain dicts (no Kubernetes client, no I/O): the JobSet, Job and pod
templates (containers, environment, resources, node selectors, tolerations, labels) around the command lines
step_commands.py builds; the names and label keys are names.py's.

One JobSet per step, created one after the other by the operator, so the CPU-only check, convert and
export steps never hold TPU quota and no TPU slice is reserved while they run:

* check / convert / export: one pod on the CPU node pool running the trainer image's entry points (check:
  the data and fit checks of a chain without a convert step; convert runs them first).
* train, backend pathways: the shape GKE's tooling generates -- a `pathways-head` replicated job
  (one pod on the CPU pool: resource manager and proxy as native sidecars, the trainer talking to
  the proxy) and a `worker` replicated job with one Job per slice and one pod per TPU VM; the
  JobSet succeeds when the head does.
* train, backends mcjax and gpu: one `worker` replicated job of trainer processes that find each
  other through jax.distributed environment variables.

Children carry only allowlisted labels (Kueue's queue and priority labels and our own
`lorajob.dev/*`: names.allowed_label), never the parent's labels or annotations.
"""

from __future__ import annotations

import dataclasses

from lorajob_operator import accelerators, api, rules
from lorajob_operator.names import (
    COORDINATOR_LABEL, EXCLUSIVE_TOPOLOGY, GPU_ACCELERATOR_LABEL, JOB_INDEX_LABEL, JOBSET_API_VERSION,
    JOBSET_NAME_LABEL, KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL, LABEL_ATTEMPT, LABEL_PHASE, LABEL_RUN,
    NODE_POOL_LABEL, PATHWAYS_HEAD, REPLICAS_LABEL, REPLICATED_JOB_LABEL, TPU_ACCELERATOR_LABEL, TPU_TOPOLOGY_LABEL,
    TRAINER_CONTAINER, WORKER, child_name, first_pod_host, run_name,
)
from lorajob_operator.settings import RenderSettings, Resources
from lorajob_operator.step_commands import Job, check_command, convert_command, export_command, train_command
from lorajob_trainer.contract import environment
from lorajob_trainer.contract.records import RunLayout

TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"

PATHWAYS_PROXY_PORT = 29000
PATHWAYS_RM_PORT = 29001
PATHWAYS_WORKER_PORT = 29005


@dataclasses.dataclass(frozen=True)
class Owner(Job):
    """The LoRAJob the children belong to."""

    def reference(self) -> dict:
        return {
            "apiVersion": f"{api.GROUP}/{api.VERSION}",
            "kind": api.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# --- Building blocks --------------------------------------------------------------------------------

def _env(name: str, value: str) -> dict:
    return {"name": name, "value": value}


def _env_from_label(name: str, label: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


def _credential_env(spec: api.LoRAJobSpec) -> list[dict]:
    """Each credential the LoRAJob names, and the Secret key it should come from (environment.Credential)."""
    # Optional: without the Secret or its key the pod still starts, and the first CPU step's check says what is
    # missing (the operator holds no right on Secrets).
    return [
        env
        for credential, ref in (spec.credentials.references() if spec.credentials else [])
        for env in (
            {"name": credential.variable,
             "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key, "optional": True}}},
            _env(credential.source_variable, f"{ref.name}/{ref.key}"),
        )
    ]


def _labels(run: str, phase: str, attempt: int) -> dict:
    return {LABEL_RUN: run, LABEL_PHASE: phase, LABEL_ATTEMPT: str(attempt)}


def _queue_labels(spec: api.LoRAJobSpec) -> dict:
    labels = {}
    if spec.scheduling.queue_name:
        labels[KUEUE_QUEUE_LABEL] = spec.scheduling.queue_name
    if spec.scheduling.priority_class:
        labels[KUEUE_PRIORITY_LABEL] = spec.scheduling.priority_class
    return labels


def _trainer_image(spec: api.LoRAJobSpec, settings: RenderSettings) -> str:
    return spec.images.trainer or settings.images.trainer


def _cpu_node_pool(spec: api.LoRAJobSpec, settings: RenderSettings) -> str:
    return spec.compute.cpu_node_pool or settings.cpu_node_pool


def _pod_spec(containers: list[dict], node_selector: dict, settings: RenderSettings, **extra) -> dict:
    pod = {"restartPolicy": "Never", "nodeSelector": node_selector, "containers": containers, **extra}
    if settings.priority_class_name:
        pod["priorityClassName"] = settings.priority_class_name
    return pod


def _replicated_job(
    name: str,
    *,
    replicas: int,
    pods: int,
    pod_spec: dict,
    pod_labels: dict,
    exclusive_topology: str | None = None,
) -> dict:
    """`replicas` Jobs of `pods` indexed pods each; a failed pod fails the step (retries are the LoRAJob's)."""
    template: dict = {"metadata": {"annotations": {EXCLUSIVE_TOPOLOGY: exclusive_topology}}} if exclusive_topology else {}
    return {
        "name": name,
        "replicas": replicas,
        "template": {
            **template,
            "spec": {
                "parallelism": pods,
                "completions": pods,
                "completionMode": "Indexed",
                "backoffLimit": 0,
                "template": {"metadata": {"labels": dict(pod_labels)}, "spec": pod_spec},
            },
        },
    }


def _jobset(name: str, owner: Owner, labels: dict, queue_labels: dict, replicated_jobs: list[dict], **spec) -> dict:
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": {**labels, **queue_labels},
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            # A failed Job fails the JobSet at once; the operator owns retries (per step, with backoff).
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": replicated_jobs,
            **spec,
        },
    }


def _tpu_machine(spec: api.LoRAJobSpec) -> accelerators.TpuMachine:
    return accelerators.TPU_MACHINES[spec.compute.tpu.machine_type]


def _tpu_node_selector(spec: api.LoRAJobSpec) -> dict:
    return {TPU_ACCELERATOR_LABEL: _tpu_machine(spec).accelerator, TPU_TOPOLOGY_LABEL: spec.compute.tpu.topology}


TPU_TOLERATION = {"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def _tpu_resources(spec: api.LoRAJobSpec) -> dict:
    chips = str(_tpu_machine(spec).chips_per_vm)
    return {"requests": {TPU_RESOURCE: chips}, "limits": {TPU_RESOURCE: chips}}


def _vms_per_slice(spec: api.LoRAJobSpec) -> int:
    return accelerators.vms_per_slice(spec.compute.tpu.machine_type, spec.compute.tpu.topology)


TRAINER_SECURITY_CONTEXT = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""The trainer image runs as its numeric non-root user (Dockerfile `USER`) and needs no privilege: TPUs and
GPUs come through their device plugins. (The Pathways server and proxy images are Google's and keep theirs.)"""


def _trainer_container(spec: api.LoRAJobSpec, settings: RenderSettings, command: list[str], env: list[dict], resources: dict) -> dict:
    return {
        "name": TRAINER_CONTAINER,
        "image": _trainer_image(spec, settings),
        "command": command,
        "env": [*env, *_credential_env(spec)],
        "resources": resources,
        "securityContext": TRAINER_SECURITY_CONTEXT,
        # The trainer's last log line names what failed; the operator puts it in the Failed condition.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


# --- The JobSet of each step ------------------------------------------------------------------------

def _cpu_step(phase: str, command: list[str], resources: Resources, spec, owner, run, settings, attempt) -> dict:
    labels = _labels(run, phase, attempt)
    container = _trainer_container(spec, settings, command, [], resources.as_dict())
    pod = _pod_spec([container], {NODE_POOL_LABEL: _cpu_node_pool(spec, settings)}, settings)
    job = _replicated_job(phase, replicas=1, pods=1, pod_spec=pod, pod_labels=labels)
    return _jobset(child_name(run, phase), owner, labels, _queue_labels(spec), [job])


def _pathways_train(spec, owner, run, settings, attempt) -> dict:
    name = child_name(run, "train")
    labels = _labels(run, "train", attempt)
    tpu, machine, images, resources = spec.compute.tpu, _tpu_machine(spec), settings.images, settings.resources
    head_env = _env_from_label("PATHWAYS_HEAD", COORDINATOR_LABEL)
    scratch = f"--gcs_scratch_location={RunLayout(spec.output.base_output_directory, run).pathways_scratch}"
    rm_address = f"--resource_manager_address=$(PATHWAYS_HEAD):{PATHWAYS_RM_PORT}"
    pathways_server = spec.images.pathways_server or images.pathways_server

    resource_manager = {
        "name": "pathways-rm",
        "image": pathways_server,
        "restartPolicy": "Always",  # a native sidecar: it stops when the trainer container exits
        "args": [
            f"--server_port={PATHWAYS_RM_PORT}",
            scratch,
            "--node_type=resource_manager",
            f"--instance_count={tpu.slices}",
            f"--instance_type={machine.pathways_type}:{tpu.topology}",
        ],
        "env": [
            _env_from_label("REPLICATED_JOB_NAME", REPLICATED_JOB_LABEL),
            _env_from_label("JOBSET_NAME", JOBSET_NAME_LABEL),
            _env_from_label("HOST_ADDRESS", COORDINATOR_LABEL),
            _env("TPU_SKIP_MDS_QUERY", "true"),
        ],
        "ports": [{"containerPort": PATHWAYS_RM_PORT}, {"containerPort": PATHWAYS_RM_PORT + 1}],
        "resources": resources.pathways_resource_manager.as_dict(),
    }
    proxy = {
        "name": "pathways-proxy",
        "image": spec.images.pathways_proxy or images.pathways_proxy,
        "restartPolicy": "Always",
        "args": [f"--server_port={PATHWAYS_PROXY_PORT}", rm_address, scratch],
        "env": [head_env],
        "ports": [{"containerPort": PATHWAYS_PROXY_PORT}],
        "resources": resources.pathways_proxy.as_dict(),
    }
    trainer = _trainer_container(
        spec,
        settings,
        train_command(spec, run, owner),
        [
            head_env,
            _env(environment.ENV_PLATFORMS, environment.PATHWAYS_PLATFORM),
            _env("JAX_BACKEND_TARGET", f"grpc://$(PATHWAYS_HEAD):{PATHWAYS_PROXY_PORT}"),
            _env("ENABLE_PATHWAYS_PERSISTENCE", "1"),
            _env("XCLOUD_ENVIRONMENT", "GCP"),
        ],
        resources.pathways_head_user.as_dict(),
    )
    head_pod = _pod_spec(
        [trainer],
        {NODE_POOL_LABEL: _cpu_node_pool(spec, settings)},
        settings,
        initContainers=[resource_manager, proxy],
        hostNetwork=True,
        dnsPolicy="ClusterFirstWithHostNet",
        terminationGracePeriodSeconds=spec.scheduling.termination_grace_period_seconds,
    )
    worker_container = {
        "name": "pathways-worker",
        "image": pathways_server,
        "args": [f"--server_port={PATHWAYS_WORKER_PORT}", rm_address, scratch],
        "env": [
            head_env,
            _env_from_label("MEGASCALE_COORDINATOR_ADDRESS", COORDINATOR_LABEL),
            _env_from_label("MEGASCALE_NUM_SLICES", REPLICAS_LABEL),
            _env_from_label("MEGASCALE_SLICE_ID", JOB_INDEX_LABEL),
            _env_from_label("JOBSET_NAME", JOBSET_NAME_LABEL),
            _env_from_label("REPLICATED_JOB_NAME", REPLICATED_JOB_LABEL),
            _env("MEGASCALE_GRPC_ENABLE_XOR_TRACER", "false"),
            _env("XCLOUD_ENVIRONMENT", "GCP"),
        ],
        "ports": [{"containerPort": port} for port in (PATHWAYS_WORKER_PORT, PATHWAYS_WORKER_PORT + 1, 8471, 8080)],
        "resources": _tpu_resources(spec),
    }
    worker_pod = _pod_spec(
        [worker_container],
        _tpu_node_selector(spec),
        settings,
        tolerations=[TPU_TOLERATION],
        hostNetwork=True,
        dnsPolicy="ClusterFirstWithHostNet",
        terminationGracePeriodSeconds=spec.scheduling.termination_grace_period_seconds,
    )
    jobs = [
        _replicated_job(
            PATHWAYS_HEAD, replicas=1, pods=1, pod_spec=head_pod, pod_labels=labels,
            exclusive_topology="kubernetes.io/hostname",
        ),
        _replicated_job(
            WORKER, replicas=tpu.slices, pods=_vms_per_slice(spec), pod_spec=worker_pod, pod_labels=labels,
            exclusive_topology=NODE_POOL_LABEL,
        ),
    ]
    return _jobset(
        name, owner, labels, _queue_labels(spec), jobs,
        coordinator={"replicatedJob": PATHWAYS_HEAD, "jobIndex": 0, "podIndex": 0},
        successPolicy={"operator": "All", "targetReplicatedJobs": [PATHWAYS_HEAD]},
    )


JOB_INDEX_ENV = "JOB_INDEX"
PROCESS_ID_FROM_INDICES = f'export {environment.ENV_PROCESS_ID}=$(( {JOB_INDEX_ENV} * {{pods}} + JOB_COMPLETION_INDEX )); exec "$0" "$@"'
"""Process id = <Job index in the JobSet> x <pods per Job> + <pod index in its Job> (JOB_COMPLETION_INDEX
is set by Kubernetes in Indexed Jobs); the shell computes it and then becomes the trainer."""


def _multi_controller_trainer(spec, settings, owner: Owner, run: str, jobs: int, pods: int, env: list[dict], resources: dict) -> dict:
    """The trainer of one of `jobs` x `pods` jax.distributed processes, coordinated by process 0."""
    name = child_name(run, "train")
    # Pod 0 of Job 0, addressed through the JobSet's headless service; a literal (not JobSet's
    # coordinator label) so the name needs no room for a doubled label value.
    coordinator = first_pod_host(name, WORKER)
    distributed_env = [
        _env(environment.ENV_COORDINATOR_ADDRESS, f"{coordinator}:{environment.DEFAULT_COORDINATOR_PORT}"),
        _env(environment.ENV_NUM_PROCESSES, str(jobs * pods)),
        _env_from_label(JOB_INDEX_ENV, JOB_INDEX_LABEL),
    ]
    command = ["/bin/sh", "-c", PROCESS_ID_FROM_INDICES.format(pods=pods), *train_command(spec, run, owner)]
    return _trainer_container(spec, settings, command, [*distributed_env, *env], resources)


def _mcjax_train(spec, owner, run, settings, attempt) -> dict:
    name = child_name(run, "train")
    labels = _labels(run, "train", attempt)
    slices, vms = spec.compute.tpu.slices, _vms_per_slice(spec)
    megascale = [
        _env("MEGASCALE_COORDINATOR_ADDRESS", first_pod_host(name, WORKER)),
        _env_from_label("MEGASCALE_NUM_SLICES", REPLICAS_LABEL),
        _env_from_label("MEGASCALE_SLICE_ID", JOB_INDEX_LABEL),
    ]
    container = _multi_controller_trainer(spec, settings, owner, run, slices, vms, megascale, _tpu_resources(spec))
    pod = _pod_spec(
        [container], _tpu_node_selector(spec), settings,
        tolerations=[TPU_TOLERATION], hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet",
        terminationGracePeriodSeconds=spec.scheduling.termination_grace_period_seconds,
    )
    job = _replicated_job(
        WORKER, replicas=slices, pods=vms, pod_spec=pod, pod_labels=labels, exclusive_topology=NODE_POOL_LABEL,
    )
    return _jobset(name, owner, labels, _queue_labels(spec), [job])


def _gpu_train(spec, owner, run, settings, attempt) -> dict:
    name = child_name(run, "train")
    labels = _labels(run, "train", attempt)
    gpu = spec.compute.gpu
    gpus = str(gpu.gpus_per_node)
    resources = {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}}
    container = _multi_controller_trainer(spec, settings, owner, run, 1, gpu.nodes, [], resources)
    pod = _pod_spec(
        [container], {GPU_ACCELERATOR_LABEL: gpu.accelerator}, settings, tolerations=[GPU_TOLERATION],
        terminationGracePeriodSeconds=spec.scheduling.termination_grace_period_seconds,
    )
    job = _replicated_job(WORKER, replicas=1, pods=gpu.nodes, pod_spec=pod, pod_labels=labels)
    return _jobset(name, owner, labels, _queue_labels(spec), [job])


_TRAIN_BY_BACKEND = {
    api.Backend.pathways: _pathways_train,
    api.Backend.mcjax: _mcjax_train,
    api.Backend.gpu: _gpu_train,
}


def render_phase(
    phase: str, spec: api.LoRAJobSpec, owner: Owner, settings: RenderSettings, attempt: int = 0
) -> dict:
    """The JobSet of one step (`phase` in rules.PHASES) for try number `attempt`."""
    run = run_name(spec, owner.name)
    if phase == "train":
        return _TRAIN_BY_BACKEND[spec.compute.backend](spec, owner, run, settings, attempt)
    if phase == "check":
        return _cpu_step(phase, check_command(spec, run), settings.resources.convert, spec, owner, run, settings, attempt)
    if phase == "convert":
        return _cpu_step(phase, convert_command(spec, run), settings.resources.convert, spec, owner, run, settings, attempt)
    if phase == "export":
        return _cpu_step(phase, export_command(spec, run, owner), settings.resources.export, spec, owner, run, settings, attempt)
    raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(rules.PHASES)}")


def render_all(spec: api.LoRAJobSpec, owner: Owner, settings: RenderSettings) -> list[dict]:
    """The JobSets of every step this LoRAJob runs, in order (first tries)."""
    return [render_phase(phase, spec, owner, settings) for phase in rules.phases(spec)]
