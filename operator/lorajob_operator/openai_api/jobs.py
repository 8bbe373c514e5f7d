"""Fine-tuning jobs as LoRAJobs: a create request in, a LoRAJob body out; a LoRAJob (its status, events and
checkpoints) in, the API's job, event and checkpoint objects out. Pure: the server does the I/O."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import time
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lorajob_operator import api
from lorajob_operator.openai_api.config import ModelOffer
from lorajob_operator.openai_api.files import LAYOUT_BY_NAME, StoredFile

JOB_LABEL = "fine-tuning.lorajob.dev/job"
"""On every LoRAJob the API created (the listing's selector)."""
REQUEST_ANNOTATION = "fine-tuning.lorajob.dev/request"
"""The request as the API resolved it (JSON): what `retrieve` shows of the job's settings."""
CANCELLED_ANNOTATION = "fine-tuning.lorajob.dev/cancelled-at"
"""When the job was cancelled (Unix seconds); a cancelled LoRAJob is suspended and stays cancelled."""
JOB_ID_PREFIX = "ftjob-"
JOB_ID_RANDOM = 14
"""ftjob- and 14 characters: 20, within the run-name limit of every backend (names.PATHWAYS_NAME_MAX)."""
JOB_ID = re.compile(f"{JOB_ID_PREFIX}[a-z0-9]{{1,{api.DNS_LABEL_MAX - len(JOB_ID_PREFIX)}}}")
AUTO_EPOCHS = 3
SUFFIX_MAX = 64
METADATA_PAIRS = 16
MAX_EPOCHS = 50


def is_job_id(text: str) -> bool:
    """A name the API could have given a job (anything else is no job, and never reaches a Kubernetes path)."""
    return JOB_ID.fullmatch(text) is not None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Auto = Literal["auto"]


class Hyperparameters(_Strict):
    n_epochs: Auto | Annotated[int, Field(ge=1, le=MAX_EPOCHS, strict=True)] = "auto"
    batch_size: Auto | Annotated[int, Field(ge=1, le=4096, strict=True)] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=100)] = "auto"
    beta: Auto | Annotated[float, Field(gt=0, le=100)] = "auto"
    """DPO's beta (method dpo only)."""
    lora_rank: Annotated[int, Field(ge=1, le=1024, strict=True)] | None = None
    """An extension: the adapters' rank (the model's template's when absent)."""
    lora_alpha: Annotated[float, Field(gt=0, le=65536)] | None = None
    """An extension: the adapters' alpha."""


class SupervisedMethod(_Strict):
    hyperparameters: Hyperparameters = Hyperparameters()


class Method(_Strict):
    type: Literal["supervised", "dpo"]
    supervised: SupervisedMethod | None = None
    dpo: SupervisedMethod | None = None

    def hyperparameters(self) -> Hyperparameters | None:
        chosen = self.supervised if self.type == "supervised" else self.dpo
        return chosen.hyperparameters if chosen else None


class WandbSettings(_Strict):
    project: str = Field(min_length=1, max_length=128)
    # No `name`: a LoRAJob's W&B run is named after the LoRAJob, so a run name would be refused, not dropped.
    entity: str | None = Field(default=None, max_length=128)
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=32)


class Integration(_Strict):
    type: Literal["wandb"]
    wandb: WandbSettings


class CreateJob(_Strict):
    """POST /v1/fine_tuning/jobs: the fields with a LoRAJob meaning; any other field is refused by name."""

    model: str = Field(min_length=1, max_length=256)
    training_file: str = Field(min_length=1, max_length=64)
    validation_file: str | None = Field(default=None, max_length=64)
    hyperparameters: Hyperparameters | None = None
    """The older place of method.supervised.hyperparameters."""
    method: Method | None = None
    suffix: str | None = Field(default=None, min_length=1, max_length=SUFFIX_MAX, pattern=r"^[A-Za-z0-9_-]+$")
    seed: Annotated[int, Field(ge=0, le=2**31 - 1, strict=True)] | None = None
    integrations: list[Integration] = Field(default_factory=list, max_length=1)
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=METADATA_PAIRS)

    @property
    def method_type(self) -> str:
        return self.method.type if self.method else "supervised"

    def chosen_hyperparameters(self) -> Hyperparameters:
        from_method = self.method.hyperparameters() if self.method else None
        if from_method is not None and self.hyperparameters is not None:
            raise RequestError("give hyperparameters either at the top level or under method, not both", "hyperparameters")
        return from_method or self.hyperparameters or Hyperparameters()


class RequestError(ValueError):
    """A request the API refuses: message and the parameter at fault (the API's error object)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def describe_validation_error(error) -> RequestError:
    """The first of pydantic's complaints as the API's error: unknown fields are named as having no LoRAJob meaning."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"] if not str(part).startswith(("function-", "literal[")))
    param = param.replace(".constrained-int", "").replace(".constrained-float", "")
    if first["type"] == "extra_forbidden":
        return RequestError(f"{param} is not supported: it has no meaning for a LoRAJob", param, "unsupported_parameter")
    if first["type"] == "literal_error" and param.endswith("type"):
        return RequestError(f"{param} {first['input']!r} is not supported: {first['msg']}", param, "unsupported_parameter")
    return RequestError(f"{param}: {first['msg']}", param, "invalid_parameter")


def _batch(batch_size: int, per_device_default: int, chips: int) -> tuple[int, int]:
    """(per-device batch, accumulation) giving `batch_size` examples per step over `chips`, each micro-batch no
    larger than the template's per-device batch."""
    if batch_size % chips:
        raise RequestError(f"batch_size {batch_size} must be a multiple of the model's {chips} accelerators "
                           "(each takes the same share of every batch)", "hyperparameters.batch_size")
    per_device = batch_size // chips
    accumulation = math.ceil(per_device / per_device_default)
    while per_device % accumulation:
        accumulation += 1
    return per_device // accumulation, accumulation


def build_lorajob(request: CreateJob, offer: ModelOffer, *, job_id: str, namespace: str, user: str,
                  training: StoredFile, validation: StoredFile | None, dataset_folder: str, outputs: str) -> dict:
    """The LoRAJob this request runs, and what `retrieve` says of it (annotations)."""
    method = request.method_type
    for field, stored in (("training_file", training), ("validation_file", validation)):
        if stored is not None and method not in LAYOUT_BY_NAME[stored.layout].methods:
            raise RequestError(f"{field} {stored.id} holds {stored.layout} lines, which method {method} does not "
                               f"train on", field, "invalid_file_layout")
    if validation is not None and validation.layout != training.layout:
        raise RequestError(f"validation_file holds {validation.layout} lines but training_file {training.layout}",
                           "validation_file", "invalid_file_layout")
    chosen = request.chosen_hyperparameters()
    if chosen.beta != "auto" and method != "dpo":
        raise RequestError("beta is DPO's: it needs method.type dpo", "method.supervised.hyperparameters.beta")

    spec = copy.deepcopy(offer.template)
    template_training, chips = offer.spec.training, offer.accelerators
    if chosen.batch_size == "auto":
        per_device, accumulation = template_training.per_device_batch_size, template_training.gradient_accumulation_steps
    else:
        per_device, accumulation = _batch(chosen.batch_size, template_training.per_device_batch_size, chips)
    batch_size = per_device * accumulation * chips
    epochs = AUTO_EPOCHS if chosen.n_epochs == "auto" else chosen.n_epochs
    steps_per_epoch = math.ceil(training.lines / batch_size)
    multiplier = 1.0 if chosen.learning_rate_multiplier == "auto" else chosen.learning_rate_multiplier

    training_spec = spec.setdefault("training", {})
    training_spec.update({
        "steps": epochs * steps_per_epoch, "perDeviceBatchSize": per_device, "gradientAccumulationSteps": accumulation,
        "learningRate": template_training.learning_rate * multiplier, "packing": False,
        "checkpointPeriod": training_spec.get("checkpointPeriod", steps_per_epoch),
    })
    if request.seed is not None:
        training_spec["seed"] = request.seed
    layout = LAYOUT_BY_NAME[training.layout]
    spec["dataset"] = {"name": "json", "dataDir": dataset_folder, "columns": list(layout.columns), "split": "train",
                       **({"evalSplit": "test"} if validation else {})}
    if validation is None:  # what needs an eval split goes with it
        for field in ("evalInterval", "earlyStopping"):
            training_spec.pop(field, None)
        spec.pop("evaluation", None)
    spec["method"] = "dpo" if method == "dpo" else "sft"
    if method == "dpo" and chosen.beta != "auto":
        spec["preference"] = {"beta": chosen.beta}
    lora = {key: value for key, value in (("rank", chosen.lora_rank), ("alpha", chosen.lora_alpha)) if value is not None}
    if lora:
        spec["lora"] = {**spec.get("lora", {}), **lora}
    spec["output"] = {**spec.get("output", {}), "baseOutputDirectory": outputs}
    for integration in request.integrations:
        wandb = integration.wandb
        spec.setdefault("tracking", {})["wandb"] = {
            **spec.get("tracking", {}).get("wandb", {}), "project": wandb.project,
            **({"entity": wandb.entity} if wandb.entity else {}), **({"tags": wandb.tags} if wandb.tags else {})}
    resolved = {
        "model": request.model, "training_file": training.id,
        "validation_file": validation.id if validation else None, "method": method,
        "hyperparameters": {"n_epochs": epochs, "batch_size": batch_size, "learning_rate_multiplier": multiplier,
                            **({"beta": chosen.beta} if method == "dpo" else {}),
                            **{f"lora_{key}": value for key, value in lora.items()}},
        "suffix": request.suffix, "seed": request.seed if request.seed is not None else training_spec.get("seed", 0),
        "metadata": request.metadata, "integrations": [i.model_dump(exclude_none=True) for i in request.integrations],
        "user": user, "created": time.time(),
    }
    return {
        "apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
        "metadata": {"name": job_id, "namespace": namespace, "labels": {JOB_LABEL: "true"},
                     "annotations": {REQUEST_ANNOTATION: json.dumps(resolved, sort_keys=True)}},
        "spec": spec,
    }


# ------------------------------------------------------------------------------------------ status


def _seconds(timestamp: str | None) -> int | None:
    return int(datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()) if timestamp else None


def request_of(obj: dict) -> dict[str, Any]:
    return json.loads(obj["metadata"].get("annotations", {}).get(REQUEST_ANNOTATION, "{}"))


def newest_first(objects: list[dict]) -> list[dict]:
    """The API's jobs by creation, newest first (to the request's own sub-second time: the object's creationTimestamp
    counts whole seconds)."""
    return sorted(objects, key=lambda o: (request_of(o).get("created", 0), o["metadata"]["name"]), reverse=True)


def cancelled_at(obj: dict) -> int | None:
    value = obj["metadata"].get("annotations", {}).get(CANCELLED_ANNOTATION)
    return int(value) if value else None


STATUS_BY_PHASE = {
    api.Phase.Pending: "validating_files", api.Phase.Queued: "queued", api.Phase.Checking: "running",
    api.Phase.Converting: "running", api.Phase.Training: "running", api.Phase.Exporting: "running",
    api.Phase.Succeeded: "succeeded", api.Phase.Failed: "failed", api.Phase.Suspended: "paused",
}
FINISHED = ("succeeded", "failed", "cancelled")


def job_status(obj: dict) -> str:
    phase = (obj.get("status") or {}).get("phase")
    status = STATUS_BY_PHASE[api.Phase(phase)] if phase else "validating_files"
    if cancelled_at(obj) is not None and status not in ("succeeded", "failed"):
        return "cancelled"
    return status


def fine_tuned_model(obj: dict, step: int | None = None) -> str:
    """ft:<base model>:<namespace>[:<suffix>]:<job id>[:ckpt-step-<n>], as the API names trained models."""
    request = request_of(obj)
    parts = ["ft", request.get("model", ""), obj["metadata"]["namespace"], *([request["suffix"]] if request.get("suffix") else []),
             obj["metadata"]["name"]]
    return ":".join(parts) + (f":ckpt-step-{step}" if step is not None else "")


def _condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c.get("type") == kind), {})


def job_object(obj: dict) -> dict[str, Any]:
    status, request = obj.get("status") or {}, request_of(obj)
    state = job_status(obj)
    outputs = status.get("outputs") or {}
    finished_at = (cancelled_at(obj) if state == "cancelled"
                   else _seconds(status.get("completionTime")) if state in FINISHED else None)
    error = None
    if state == "failed":
        failed = _condition(status, "Failed")
        error = {"code": failed.get("reason") or "Failed", "message": failed.get("message") or status.get("message", ""),
                 "param": None}
    progress = status.get("progress") or {}
    eta = progress.get("etaSeconds")
    return {
        "id": obj["metadata"]["name"], "object": "fine_tuning.job",
        "created_at": _seconds(obj["metadata"]["creationTimestamp"]),
        "finished_at": finished_at, "error": error, "status": state,
        "fine_tuned_model": fine_tuned_model(obj) if state == "succeeded" and outputs.get("adapterPath") else None,
        "model": request.get("model"), "organization_id": obj["metadata"]["namespace"],
        "hyperparameters": {k: v for k, v in request.get("hyperparameters", {}).items()
                            if k in ("n_epochs", "batch_size", "learning_rate_multiplier")},
        "method": {"type": request.get("method", "supervised"),
                   request.get("method", "supervised"): {"hyperparameters": request.get("hyperparameters", {})}},
        "training_file": request.get("training_file"), "validation_file": request.get("validation_file"),
        "result_files": [], "seed": request.get("seed"), "suffix": request.get("suffix"),
        "user_provided_suffix": request.get("suffix"), "metadata": request.get("metadata"),
        "integrations": request.get("integrations") or None,
        "trained_tokens": (status.get("data") or {}).get("trainedTokens") if state == "succeeded" else None,
        "estimated_finish": int(datetime.now().timestamp()) + eta if eta and state == "running" else None,
        "lorajob": {"name": obj["metadata"]["name"], "phase": status.get("phase"), "message": status.get("message"),
                    "adapter_path": outputs.get("adapterPath"),
                    "progress": {k: progress.get(k) for k in ("step", "totalSteps", "loss", "evalLoss")}},
    }


def _event(job_id: str, created_at: int | None, key: str, message: str, *, level: str = "info",
           kind: str = "message", data: dict | None = None) -> dict[str, Any]:
    digest = hashlib.sha256(f"{job_id}/{key}".encode()).hexdigest()[:24]
    return {"id": f"ftevent-{digest}", "object": "fine_tuning.job.event", "created_at": created_at or 0,
            "level": level, "message": message, "type": kind, "data": data or {}}


def job_events(obj: dict, kube_events: list[dict]) -> list[dict[str, Any]]:
    """The job's events, newest first: the operator's Kubernetes events on the LoRAJob, a metrics event per
    checkpoint and for the latest step, and the job's end."""
    job_id, status = obj["metadata"]["name"], obj.get("status") or {}
    events = [_event(job_id, _seconds(obj["metadata"]["creationTimestamp"]), "created", "Created fine-tuning job")]
    for event in kube_events:
        when = _seconds(event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp"))
        events.append(_event(job_id, when, f"k8s/{event['metadata']['uid']}/{event.get('count', 1)}",
                             f"{event.get('reason', '')}: {event.get('message', '')}",
                             level="warn" if event.get("type") == "Warning" else "info"))
    for checkpoint in status.get("checkpoints", []):
        step = checkpoint["step"]
        events.append(_event(job_id, _seconds(checkpoint.get("time")), f"checkpoint/{step}",
                             f"Checkpoint saved at step {step}", kind="metrics",
                             data={"step": step, "train_loss": checkpoint.get("trainLoss"),
                                   "valid_loss": checkpoint.get("evalLoss")}))
    progress = status.get("progress") or {}
    if progress.get("step"):
        step, total = progress["step"], progress.get("totalSteps")
        events.append(_event(job_id, _seconds(progress.get("advancedTime")), f"step/{step}",
                             f"Step {step}/{total}: training loss={progress.get('loss')}", kind="metrics",
                             data={"step": step, "total_steps": total, "train_loss": progress.get("loss"),
                                   "valid_loss": progress.get("evalLoss")}))
    # Newest first; events of the same second in the reverse of the order they happened (the list's order so far).
    events = [event for _, event in sorted(enumerate(events), key=lambda pair: (pair[1]["created_at"], pair[0]),
                                           reverse=True)]
    state = job_status(obj)
    if state in FINISHED:  # the last word, even where an event of the same second came after it
        job = job_object(obj)
        message = {"succeeded": f"The job has successfully completed: {job['fine_tuned_model']}",
                   "failed": f"The job failed: {(job['error'] or {}).get('message', '')}",
                   "cancelled": "The job was cancelled"}[state]
        events.insert(0, _event(job_id, max(job["finished_at"] or 0, events[0]["created_at"]), state, message,
                                level="error" if state == "failed" else "info"))
    return events


def job_checkpoints(obj: dict) -> list[dict[str, Any]]:
    """The job's kept checkpoints, newest first."""
    job_id = obj["metadata"]["name"]
    checkpoints = sorted((obj.get("status") or {}).get("checkpoints", []), key=lambda c: c["step"], reverse=True)
    return [{"id": f"ftckpt-{job_id}-{c['step']}", "object": "fine_tuning.job.checkpoint",
             "created_at": _seconds(c.get("time")) or 0, "fine_tuning_job_id": job_id, "step_number": c["step"],
             "fine_tuned_model_checkpoint": fine_tuned_model(obj, c["step"]),
             "metrics": {"step": c["step"], "train_loss": c.get("trainLoss"), "valid_loss": c.get("evalLoss")},
             "path": c.get("path")} for c in checkpoints]
