"""LoRAJob spec -> the JobSet of each step, as plain dicts (no Kubernetes client, no I/O).

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
`lorajob.dev/*`), never the parent's labels or annotations.
"""

from __future__ import annotations

import dataclasses
import shlex

import pydantic

from lorajob_operator import accelerators, api, rules, validation
from lorajob_operator.settings import RenderSettings, Resources
from lorajob_trainer.contract import catalog, environment, fit
from lorajob_trainer.contract.config import ConfigError, TrainConfig
from lorajob_trainer.contract.environment import HF_TOKEN_ENV, HF_TOKEN_SOURCE_ENV
from lorajob_trainer.contract.records import REMAT_AUTO, RunLayout

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
KUEUE_API_VERSION = "kueue.x-k8s.io/v1beta2"

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
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"

WORKER = "worker"
TRAINER_CONTAINER = "trainer"
PATHWAYS_PROXY_PORT = 29000
PATHWAYS_RM_PORT = 29001
PATHWAYS_WORKER_PORT = 29005


@dataclasses.dataclass(frozen=True)
class Owner:
    """The LoRAJob the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict:
        return {
            "apiVersion": f"{api.GROUP}/{api.VERSION}",
            "kind": api.KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run reads and writes, all under <baseOutputDirectory>/<runName>/ unless given."""

    base_checkpoint: str
    """Trainer-format base weights: the given checkpoint, or the convert step's output."""
    converted_base: str | None
    """Where convert writes the base weights (None: no base conversion)."""
    restore_adapter: str | None
    """Adapter to start from: the given checkpoint, or the convert step's output."""
    converted_adapter: str | None
    run_directory: str
    checkpoints: str
    adapter_export: str | None


def run_name(spec: api.LoRAJobSpec, metadata_name: str) -> str:
    return metadata_name if spec.run_name is None else spec.run_name  # as the CEL rules: "" is set (and invalid)


def parse_spec(body: dict) -> tuple[api.LoRAJobSpec | None, tuple[str, ...]]:
    """The spec of a LoRAJob object, or why it cannot be used (the CRD's rules, checked again)."""
    try:
        spec = api.LoRAJobSpec.model_validate(body.get("spec") or {})
    except pydantic.ValidationError as error:
        return None, tuple(
            f"spec.{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in error.errors()
        )
    run = run_name(spec, body["metadata"]["name"])
    errors = [*validation.spec_rule_errors(body["spec"]), *rules.run_name_errors(run, spec)]
    try:
        train_config(spec, run)
    except ConfigError as error:  # a combination the trainer refuses: fail now, not in the pod
        errors.append(str(error))
    return (None, tuple(errors)) if errors else (spec, ())


def run_paths(spec: api.LoRAJobSpec, run: str) -> RunPaths:
    layout = RunLayout(spec.output.base_output_directory, run)
    converted_base = layout.converted_base if spec.model.hugging_face else None
    restore = spec.lora.restore_from
    converted_adapter = layout.converted_adapter if restore and restore.hugging_face else None
    export = None
    if spec.export.enabled:
        export = spec.export.path or layout.adapter_export
    return RunPaths(
        base_checkpoint=converted_base or spec.model.maxtext_checkpoint or "",
        converted_base=converted_base,
        restore_adapter=converted_adapter or (restore.checkpoint if restore else None),
        converted_adapter=converted_adapter,
        run_directory=layout.run_directory,
        checkpoints=layout.checkpoints,
        adapter_export=export,
    )


def _tokenizer(spec: api.LoRAJobSpec) -> str:
    return spec.model.tokenizer or spec.model.hugging_face or catalog.MODELS[spec.model.name].hf_repo or ""


# --- Command lines of the trainer image's entry points ----------------------------------------------

def train_config(spec: api.LoRAJobSpec, run: str) -> TrainConfig:
    """The trainer's config for this LoRAJob (the trainer validates it again at start-up)."""
    paths = run_paths(spec, run)
    dataset, training, lora = spec.dataset, spec.training, spec.lora
    values = {
        "run_name": run,
        "base_output_directory": spec.output.base_output_directory,
        "model_name": spec.model.name,
        "load_parameters_path": paths.base_checkpoint,
        "tokenizer_path": _tokenizer(spec),
        "hf_path": dataset.name,
        "hf_data_dir": dataset.data_dir or "",
        "train_split": dataset.split,
        "hf_eval_split": dataset.eval_split or "",
        "eval_interval": (training.eval_interval or training.checkpoint_period) if dataset.eval_split else 0,
        "train_data_columns": list(dataset.columns),
        "chat_template_path": dataset.chat_template_path or "",
        "max_target_length": training.max_target_length,
        "steps": training.steps,
        "per_device_batch_size": training.per_device_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "learning_rate": training.learning_rate,
        "lr_schedule": training.schedule,
        "warmup_steps_fraction": training.warmup_steps_fraction,
        "checkpoint_period": training.checkpoint_period,
        "remat_policy": training.remat,
        "early_stopping_patience": training.early_stopping.patience if training.early_stopping else 0,
        "early_stopping_min_delta": training.early_stopping.min_delta if training.early_stopping else 0.0,
        "progress_lines": True,
        "checkpoint_storage_use_zarr3": spec.model.checkpoint_storage.use_zarr3,
        "checkpoint_storage_use_ocdbt": spec.model.checkpoint_storage.use_ocdbt,
        "generation_eval": _generation_eval(spec.evaluation),
        "lora": {
            "lora_rank": lora.rank,
            "lora_alpha": lora.alpha,
            "use_rslora": lora.rs_lora,
            "use_dora": lora.dora,
            "base_quantization": lora.base_quantization,
            "lora_module_path": lora.target_modules or "",
            "lora_restore_path": paths.restore_adapter or "",
        },
    }
    return TrainConfig.from_dict(values)


def _generation_eval(evaluation: api.EvaluationSpec | None) -> dict:
    if evaluation is None:
        return {}
    return {
        "enabled": True, "scorer": evaluation.trainer_scorer(), "pattern": evaluation.pattern or "",
        "max_new_tokens": evaluation.max_new_tokens, "examples": evaluation.examples, "samples": evaluation.samples,
    }


def train_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    return ["python", "-m", "lorajob_trainer.train", *train_config(spec, run).to_args()]


def accelerator_count(spec: api.LoRAJobSpec) -> int:
    """TPU chips or GPUs of the train step."""
    if spec.compute.gpu is not None:
        return spec.compute.gpu.gpus_per_node * spec.compute.gpu.nodes
    return accelerators.chips_in(spec.compute.tpu.topology) * spec.compute.tpu.slices


def data_check_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    """The data check of the train step's own config, run on a CPU first (`lorajob_trainer.datacheck`)."""
    return ["python", "-m", "lorajob_trainer.datacheck", "--devices", str(accelerator_count(spec)),
            *train_config(spec, run).to_args()]


LARGER_TOPOLOGIES_TRIED = 2
"""How many next larger topologies of the machine type a plan tries when the LoRAJob's own does not fit."""


def plan_request(spec: api.LoRAJobSpec) -> fit.Request:
    """What `lorajob_trainer.fit` compiles the train step for (TPU backends): the chip's facts, the LoRAJob's own
    target, then the smallest changes, cheapest first: smaller per-device batches (the global batch kept by
    accumulation), remat "full" (a third more compute, no more chips), then the next larger topologies of the
    machine type. Under remat auto the LoRAJob's own target keeps auto (the fit check chooses its policy) and each
    alternative is compiled with "full", which answers whether that change fits in one compile."""
    tpu, training = spec.compute.tpu, spec.training
    machine = accelerators.TPU_MACHINES[tpu.machine_type]

    def target(topology: str, batch: int, accumulation: int, remat: str = training.remat) -> fit.Target:
        return fit.Target(tpu.machine_type, topology, tpu.slices, accelerators.chips_in(topology) * tpu.slices,
                          batch, accumulation, remat)

    batch, accumulation = training.per_device_batch_size, training.gradient_accumulation_steps
    targets = [target(tpu.topology, batch, accumulation)]
    # Whether a change fits is what an alternative asks; under auto, "full" (which keeps the least) answers it in one
    # compile, and the train step's own plan chooses the policy again for the target it runs on.
    alternative = "full" if training.remat == REMAT_AUTO else training.remat
    while batch > 1 and batch % 2 == 0:
        batch, accumulation = batch // 2, accumulation * 2
        targets.append(target(tpu.topology, batch, accumulation, alternative))
    if training.remat not in ("full", REMAT_AUTO):  # auto tries full itself
        targets.append(target(tpu.topology, training.per_device_batch_size, training.gradient_accumulation_steps, "full"))
    larger = sorted(
        (t for t in machine.topologies if accelerators.chips_in(t) > accelerators.chips_in(tpu.topology)),
        key=accelerators.chips_in,
    )[:LARGER_TOPOLOGIES_TRIED]
    targets += [target(t, training.per_device_batch_size, training.gradient_accumulation_steps, alternative)
                for t in larger]
    return fit.Request(accelerators.TPU_CHIPS[machine.generation], machine.chips_per_vm, tuple(targets))


def plan_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    """The fit check of the train step's own config (`lorajob_trainer.fit`), run on a CPU first."""
    return ["python", "-m", "lorajob_trainer.fit", "--request", plan_request(spec).to_json(),
            "--model-config", spec.model.hugging_face or _tokenizer(spec), *train_config(spec, run).to_args()]


def check_commands(spec: api.LoRAJobSpec, run: str) -> list[list[str]]:
    """What the CPU step before the train step checks: the data, then (TPU backends) the fit."""
    return [data_check_command(spec, run), *([plan_command(spec, run)] if spec.compute.tpu is not None else [])]


def _chained(commands: list[list[str]]) -> list[str]:
    return ["/bin/sh", "-c", " && ".join(shlex.join(command) for command in commands)]


def check_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    """The check step of a chain without a convert step: only the checks."""
    return _chained(check_commands(spec, run))


def convert_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    """The checks, then `lorajob_trainer.convert base` and/or `adapter` (the adapter reads the base's
    config.json)."""
    paths = run_paths(spec, run)
    convert = ["python", "-m", "lorajob_trainer.convert"]
    commands = check_commands(spec, run)
    if paths.converted_base:
        commands.append([*convert, "base", "--model-name", spec.model.name, "--hf", spec.model.hugging_face, "--out", paths.converted_base])
    if paths.converted_adapter:
        commands.append([
            *convert, "adapter", "--model-name", spec.model.name, "--base", paths.base_checkpoint,
            "--adapter", spec.lora.restore_from.hugging_face, "--out", paths.converted_adapter,
        ])
    return _chained(commands)


def export_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    paths = run_paths(spec, run)
    command = [
        "python", "-m", "lorajob_trainer.export",
        "--checkpoint", paths.checkpoints,
        "--out", paths.adapter_export,
        "--step", spec.export.checkpoint(spec.training),
        "--base-model-name-or-path", spec.model.hugging_face or _tokenizer(spec),
    ]
    if spec.export.merged:
        command += ["--merged", "--base", paths.base_checkpoint]
    if spec.export.hub_repo:
        command += ["--hub-repo", spec.export.hub_repo]
    gate = spec.export.gate()
    if gate.active:
        command += ["--evaluation", RunLayout(spec.output.base_output_directory, run).evaluation]
        command += ["--require-improvement"] if gate.require_improvement else []
        command += ["--minimum-score", str(gate.minimum_score)] if gate.minimum_score is not None else []
        command += ["--minimum-stop-rate", str(gate.minimum_stop_rate)] if gate.minimum_stop_rate is not None else []
    return command


# --- Building blocks --------------------------------------------------------------------------------

def _env(name: str, value: str) -> dict:
    return {"name": name, "value": value}


def _env_from_label(name: str, label: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}


def _credential_env(spec: api.LoRAJobSpec) -> list[dict]:
    token = spec.credentials.hugging_face_token if spec.credentials else None
    if token is None:
        return []
    # Optional: without the Secret or its key the pod still starts, and the first CPU step's check says what is
    # missing (the operator holds no right on Secrets).
    return [
        {"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key, "optional": True}}},
        _env(HF_TOKEN_SOURCE_ENV, f"{token.name}/{token.key}"),
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
    return _jobset(rules.child_name(run, phase), owner, labels, _queue_labels(spec), [job])


def _pathways_train(spec, owner, run, settings, attempt) -> dict:
    name = rules.child_name(run, "train")
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
        train_command(spec, run),
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
            rules.PATHWAYS_HEAD, replicas=1, pods=1, pod_spec=head_pod, pod_labels=labels,
            exclusive_topology="kubernetes.io/hostname",
        ),
        _replicated_job(
            WORKER, replicas=tpu.slices, pods=_vms_per_slice(spec), pod_spec=worker_pod, pod_labels=labels,
            exclusive_topology=NODE_POOL_LABEL,
        ),
    ]
    return _jobset(
        name, owner, labels, _queue_labels(spec), jobs,
        coordinator={"replicatedJob": rules.PATHWAYS_HEAD, "jobIndex": 0, "podIndex": 0},
        successPolicy={"operator": "All", "targetReplicatedJobs": [rules.PATHWAYS_HEAD]},
    )


JOB_INDEX_ENV = "JOB_INDEX"
PROCESS_ID_FROM_INDICES = f'export {environment.ENV_PROCESS_ID}=$(( {JOB_INDEX_ENV} * {{pods}} + JOB_COMPLETION_INDEX )); exec "$0" "$@"'
"""Process id = <Job index in the JobSet> x <pods per Job> + <pod index in its Job> (JOB_COMPLETION_INDEX
is set by Kubernetes in Indexed Jobs); the shell computes it and then becomes the trainer."""


def _multi_controller_trainer(spec, settings, run: str, jobs: int, pods: int, env: list[dict], resources: dict) -> dict:
    """The trainer of one of `jobs` x `pods` jax.distributed processes, coordinated by process 0."""
    name = rules.child_name(run, "train")
    # Pod 0 of Job 0, addressed through the JobSet's headless service; a literal (not JobSet's
    # coordinator label) so the name needs no room for a doubled label value.
    coordinator = rules.first_pod_host(name, WORKER)
    distributed_env = [
        _env(environment.ENV_COORDINATOR_ADDRESS, f"{coordinator}:{environment.DEFAULT_COORDINATOR_PORT}"),
        _env(environment.ENV_NUM_PROCESSES, str(jobs * pods)),
        _env_from_label(JOB_INDEX_ENV, JOB_INDEX_LABEL),
    ]
    command = ["/bin/sh", "-c", PROCESS_ID_FROM_INDICES.format(pods=pods), *train_command(spec, run)]
    return _trainer_container(spec, settings, command, [*distributed_env, *env], resources)


def _mcjax_train(spec, owner, run, settings, attempt) -> dict:
    name = rules.child_name(run, "train")
    labels = _labels(run, "train", attempt)
    slices, vms = spec.compute.tpu.slices, _vms_per_slice(spec)
    megascale = [
        _env("MEGASCALE_COORDINATOR_ADDRESS", rules.first_pod_host(name, WORKER)),
        _env_from_label("MEGASCALE_NUM_SLICES", REPLICAS_LABEL),
        _env_from_label("MEGASCALE_SLICE_ID", JOB_INDEX_LABEL),
    ]
    container = _multi_controller_trainer(spec, settings, run, slices, vms, megascale, _tpu_resources(spec))
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
    name = rules.child_name(run, "train")
    labels = _labels(run, "train", attempt)
    gpu = spec.compute.gpu
    gpus = str(gpu.gpus_per_node)
    resources = {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}}
    container = _multi_controller_trainer(spec, settings, run, 1, gpu.nodes, [], resources)
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
        return _cpu_step(phase, export_command(spec, run), settings.resources.export, spec, owner, run, settings, attempt)
    raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(rules.PHASES)}")


def render_all(spec: api.LoRAJobSpec, owner: Owner, settings: RenderSettings) -> list[dict]:
    """The JobSets of every step this LoRAJob runs, in order (first tries)."""
    return [render_phase(phase, spec, owner, settings) for phase in rules.phases(spec)]


def allowed_label(key: str) -> bool:
    return key in ALLOWED_LABELS or key.startswith(ALLOWED_LABEL_PREFIXES)
