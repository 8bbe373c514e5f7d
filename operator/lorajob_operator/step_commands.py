"""What each step runs: the trainer's config of a LoRAJob (`train_config`, and the trackers it reports to:
`tracking_config`), the command lines of the trainer image's
entry points (`python -m lorajob_trainer.<train|datacheck|fit|convert|export> ...`) that the check, convert, train
and export steps run, the fit check's request (`plan_request`), and where a run reads and writes (`run_paths`).

Pure: a spec in, lists and values out. jobsets.py puts these commands into each step's JobSet.
"""

from __future__ import annotations

import dataclasses
import shlex

from lorajob_operator import accelerators, api
from lorajob_trainer.contract import catalog, fit
from lorajob_trainer.contract.config import ConfigError, TrackingConfig, TrainConfig
from lorajob_trainer.contract.records import PREFERENCE_METHODS, REMAT_AUTO, RunLayout


@dataclasses.dataclass(frozen=True)
class Job:
    """The LoRAJob a step runs for."""

    name: str
    namespace: str
    uid: str


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
        "method": spec.method,
        "preference": _preference(spec),
        "chat_template_path": dataset.chat_template_path or "",
        "max_target_length": training.max_target_length,
        "steps": training.steps,
        "per_device_batch_size": training.per_device_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "packing": training.packing,
        "seed": training.seed,
        "data_shuffle_seed": training.seed,
        "learning_rate": training.learning_rate,
        "lr_schedule": training.schedule,
        "warmup_steps_fraction": training.warmup_steps_fraction,
        "checkpoint_period": training.checkpoint_period,
        "remat_policy": training.remat,
        "early_stopping_patience": training.early_stopping.patience if training.early_stopping else 0,
        "early_stopping_min_delta": training.early_stopping.min_delta if training.early_stopping else 0.0,
        "progress_lines": True,
        "compilation_cache_dir": "" if spec.compute.backend == api.Backend.pathways else spec.output.compilation_cache_path,
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


def train_config_errors(spec: api.LoRAJobSpec, run: str) -> list[str]:
    """Why the trainer refuses this LoRAJob's config (a combination it refuses that the CRD's rules let through);
    empty when it accepts it."""
    try:
        train_config(spec, run)
    except ConfigError as error:  # a combination the trainer refuses: fail now, not in the pod
        return [str(error)]
    return []


def _preference(spec: api.LoRAJobSpec) -> dict:
    """The trainer's preference section: spec.preference for a preference method (the trainer's defaults where
    unset), the trainer's defaults for sft (the CRD refuses spec.preference there)."""
    if spec.method not in PREFERENCE_METHODS:
        return {}
    return (spec.preference or api.PreferenceSpec()).trainer_settings()


def _generation_eval(evaluation: api.EvaluationSpec | None) -> dict:
    if evaluation is None:
        return {}
    return {
        "enabled": True, "scorer": evaluation.trainer_scorer(), "pattern": evaluation.pattern or "",
        "max_new_tokens": evaluation.max_new_tokens, "examples": evaluation.examples, "samples": evaluation.samples,
    }


def tracking_config(spec: api.LoRAJobSpec, job: Job) -> TrackingConfig:
    """The train config's tracking section: spec.tracking (`spec` holds a LoRAJobPolicy's default MLflow server where
    the LoRAJob sets none: observed.effective_spec), the MLflow experiment and run named after the LoRAJob's namespace
    and name unless set, and the LoRAJob, which the runs record. Empty without trackers."""
    mlflow, wandb = spec.tracking.mlflow, spec.tracking.wandb
    if mlflow is None and wandb is None:
        return TrackingConfig()
    values = {"job_name": job.name, "job_namespace": job.namespace, "job_uid": job.uid}
    if mlflow is not None:
        values |= {
            "mlflow_tracking_uri": mlflow.tracking_uri, "mlflow_experiment": mlflow.experiment or job.namespace,
            "mlflow_run_name": mlflow.run_name or job.name, "mlflow_tags": mlflow.tags,
        }
    if wandb is not None:  # offline: wandb_dir left to the trainer (under the run directory where it is local)
        values |= {"wandb_project": wandb.project, "wandb_entity": wandb.entity or "", "wandb_mode": wandb.mode,
                   "wandb_tags": wandb.tags}
    return TrackingConfig.model_validate(values)


def train_command(spec: api.LoRAJobSpec, run: str, job: Job) -> list[str]:
    """The train step: the train config, with the trackers it reports to (the checks before it report to none)."""
    config = train_config(spec, run).model_copy(update={"tracking": tracking_config(spec, job)})
    return ["python", "-m", "lorajob_trainer.train", *config.to_args()]


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


FIT_CHECK = "lorajob_trainer.fit"
"""The trainer's fit check, run as `python -m`: by the LoRAJob's CPU step, and by `lorajob plan` (planning.py)."""


def fit_command(request: fit.Request, model_config: str, config_args: list[str], python: str = "python",
                module: str = FIT_CHECK) -> list[str]:
    """The fit check of the train config `config_args` on `request`; `model_config`: where the model's config.json
    is."""
    return [python, "-m", module, "--request", request.to_json(), "--model-config", model_config, *config_args]


def plan_command(spec: api.LoRAJobSpec, run: str) -> list[str]:
    """The fit check of the train step's own config, run on a CPU first."""
    return fit_command(plan_request(spec), spec.model.hugging_face or _tokenizer(spec), train_config(spec, run).to_args())


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


def export_command(spec: api.LoRAJobSpec, run: str, job: Job) -> list[str]:
    """The export step; with trackers, it logs the adapter to the runs the train step kept in <run>/tracking.json."""
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
    tracking = tracking_config(spec, job)
    if tracking.trackers:
        command += ["--tracking-record", RunLayout(spec.output.base_output_directory, run).tracking, *tracking.to_args()]
    return command
