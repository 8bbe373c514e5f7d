"""The LoRAJob API (lorajob.dev/v1alpha1): the single source of truth for the CRD.

Field docstrings become the CRD's `description`s (what `kubectl explain` prints); constraints on
fields become OpenAPI constraints; rules that span fields are CEL `x-kubernetes-validations`
declared next to the model they constrain (see `rules.py` for the ones built from shared logic).
The operator parses `spec` into these models; `crd.py` renders them into `crds/`.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator
from pydantic.alias_generators import to_camel, to_snake

from lorajob_operator import accelerators, names, rules
from lorajob_trainer.contract import catalog
from lorajob_trainer.contract.config import TrackingConfig
from lorajob_trainer.contract.environment import CREDENTIALS, Credential
from lorajob_trainer.contract.records import (
    BASE_QUANTIZATIONS,
    BOUNDS,
    CHECKPOINT_SELECTORS,
    COLUMN_LAYOUTS,
    COMPILATION_CACHE_DIRECTORY,
    DEFAULTS,
    DORA_NEEDS_FULL_PRECISION,
    DPO_LOSS_TYPES,
    METHOD_NEEDS_MATCHING_LAYOUT,
    PREFERENCE_COLUMN_LAYOUTS,
    PREFERENCE_DEFAULTS,
    PREFERENCE_METHODS,
    TRAINING_METHODS,
    ExportGate,
    RematSetting,
    join,
)

GROUP = "lorajob.dev"
VERSION = "v1alpha1"
KIND = "LoRAJob"
PLURAL = "lorajobs"
SHORT_NAMES = ("lj",)

DNS_LABEL_MAX = names.DNS_LABEL_MAX
PATH_MAX = 1024
"""Bound on every path/URI string: CEL cost estimation needs a maximum length on each string."""
CHECKPOINTS_LISTED = 32
"""Bound on status.checkpoints (the trainer keeps max_num_checkpoints_to_keep newest, 3 by default, and the best)."""

# Value types a LoRAJob and a LoRAJobPolicy share.
QueueName = Annotated[str, Field(max_length=DNS_LABEL_MAX, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
Topology = Annotated[str, Field(max_length=16, pattern=r"^[0-9]+x[0-9]+(x[0-9]+)?$")]
StoragePath = Annotated[str, Field(max_length=PATH_MAX, pattern=r"^(gs://|/)")]
"""A gs:// URI or an absolute path."""


def _cel(*validations: dict) -> dict:
    return {"x-kubernetes-validations": list(validations)}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A JSON boolean is not a number: the API server refuses `learningRate: true`, pydantic would read 1.0."""
        if isinstance(value, bool):
            annotation = cls.model_fields[info.field_name].annotation
            types = {annotation, *typing.get_args(annotation)}
            if types & {int, float} and bool not in types:
                raise ValueError("must be a number, not a boolean")
        return value


class Backend(str, Enum):
    pathways = "pathways"
    mcjax = "mcjax"
    gpu = "gpu"


class Phase(str, Enum):
    Pending = "Pending"
    Queued = "Queued"
    Checking = "Checking"
    Converting = "Converting"
    Training = "Training"
    Exporting = "Exporting"
    Succeeded = "Succeeded"
    Failed = "Failed"
    Suspended = "Suspended"


ModelName = Literal[tuple(catalog.MODELS)]
TpuMachineType = Literal[tuple(accelerators.TPU_MACHINES)]
GpuAccelerator = Literal[accelerators.GPU_ACCELERATORS]


class CheckpointStorage(_Model):
    """Orbax storage options used when reading the base checkpoint and writing new ones."""

    use_zarr3: bool = DEFAULTS.use_zarr3
    """useZarr3 writes/reads Zarr v3 arrays. Off by default: Pathways cannot restore zarr3 base checkpoints efficiently."""
    use_ocdbt: bool = DEFAULTS.use_ocdbt
    """useOcdbt uses Orbax's OCDBT layout. Off by default: Pathways' array handler cannot read OCDBT, so the head pod would load the whole checkpoint."""


class ModelSpec(_Model):
    """The base model to fine-tune and where its weights come from (exactly one of maxtextCheckpoint, huggingFace)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "has(self.maxtextCheckpoint) != has(self.huggingFace)",
                "message": "set exactly one base checkpoint source: model.maxtextCheckpoint "
                "(a converted checkpoint, e.g. gs://bucket/qwen3/0/items) or model.huggingFace "
                "(a Hugging Face repo id or checkpoint path, converted first)",
            }
        )
    )

    name: ModelName
    """name of the model, which selects the model code and per-family LoRA defaults (e.g. qwen3-0.6b, llama3.1-8b, gemma3-4b)."""
    maxtext_checkpoint: str | None = Field(default=None, min_length=1, max_length=PATH_MAX, alias="maxtextCheckpoint")
    """maxtextCheckpoint is the path of a base checkpoint already in the trainer's format (MaxText `.../0/items` or a lorajob Orbax checkpoint). No convert step runs; a check step runs the data and fit checks instead."""
    hugging_face: str | None = Field(default=None, min_length=1, max_length=PATH_MAX, alias="huggingFace")
    """huggingFace is a Hugging Face repo id (org/name) or a path (gs://... or local) of a safetensors checkpoint. A convert step turns it into the trainer's format first."""
    tokenizer: str | None = Field(default=None, max_length=PATH_MAX)
    """tokenizer is a Hugging Face repo id or path of the tokenizer. Defaults to the model's Hugging Face repo."""
    checkpoint_storage: CheckpointStorage = Field(default_factory=CheckpointStorage)
    """checkpointStorage selects the Orbax storage flags (both off by default, as multi-host Pathways needs)."""


SecretKey = Annotated[str, Field(max_length=253, pattern=r"^[-._a-zA-Z0-9]+$")]


class SecretKeyRef(_Model):
    """A key of a Secret in the LoRAJob's namespace."""

    name: str = Field(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """name of the Secret."""
    key: SecretKey
    """key in the Secret that holds the value."""


_CREDENTIALS = {credential.field: credential for credential in CREDENTIALS}


def _secret_key_ref(credential: str) -> type[SecretKeyRef]:
    """The reference of spec.credentials.<credential>: its key defaults to the variable the pods get the value in."""
    variable = _CREDENTIALS[credential].variable
    return create_model(
        f"SecretKeyRef_{credential}", __base__=SecretKeyRef, __doc__=SecretKeyRef.__doc__,
        key=(SecretKey, Field(variable, description=f"key in the Secret that holds the value (default {variable}).")),
    )


HuggingFaceTokenRef = _secret_key_ref("huggingFaceToken")
MLflowTokenRef = _secret_key_ref("mlflowToken")
MLflowUsernameRef = _secret_key_ref("mlflowUsername")
MLflowPasswordRef = _secret_key_ref("mlflowPassword")
WandbApiKeyRef = _secret_key_ref("wandbApiKey")


class Credentials(_Model):
    """References to Secrets in the LoRAJob's namespace, each passed to the trainer's pods as an environment variable
    through an optional secretKeyRef: the values never appear in the LoRAJob, and the operator never reads them. The
    first CPU step (check or convert) fails the LoRAJob, saying which, when one does not arrive."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "has(self.mlflowUsername) == has(self.mlflowPassword)",
                "message": "credentials.mlflowUsername and mlflowPassword go together: MLflow's basic authentication "
                "sends both",
            },
            {
                "rule": "!has(self.mlflowToken) || !has(self.mlflowUsername)",
                "message": "set credentials.mlflowToken or mlflowUsername and mlflowPassword, not both: the MLflow "
                "client authenticates with a token or with a user name and password",
            },
        )
    )

    hugging_face_token: HuggingFaceTokenRef | None = Field(default=None, alias="huggingFaceToken")
    """huggingFaceToken is the Secret key holding a Hugging Face token (gated or private models and datasets, export.hubRepo), passed to the pods as HF_TOKEN."""
    mlflow_token: MLflowTokenRef | None = None
    """mlflowToken is the Secret key holding an access token of the MLflow server (spec.tracking.mlflow, or the one a LoRAJobPolicy sets by default), passed to the pods as MLFLOW_TRACKING_TOKEN."""
    mlflow_username: MLflowUsernameRef | None = None
    """mlflowUsername is the Secret key holding the user name of MLflow's basic authentication, passed to the pods as MLFLOW_TRACKING_USERNAME (with mlflowPassword)."""
    mlflow_password: MLflowPasswordRef | None = None
    """mlflowPassword is the Secret key holding the password of MLflow's basic authentication, passed to the pods as MLFLOW_TRACKING_PASSWORD (with mlflowUsername)."""
    wandb_api_key: WandbApiKeyRef | None = None
    """wandbApiKey is the Secret key holding a Weights & Biases API key, passed to the pods as WANDB_API_KEY; spec.tracking.wandb needs it in mode online."""

    def references(self) -> list[tuple[Credential, SecretKeyRef]]:
        """Each credential named, with its Secret key."""
        return [(c, ref) for c in CREDENTIALS if (ref := getattr(self, to_snake(c.field))) is not None]


def _is_layout(columns: str, layouts: tuple[tuple[str, ...], ...]) -> str:
    """CEL: the list `columns` is one of `layouts`."""
    return "(" + " || ".join(f"{columns} == {list(layout)}" for layout in layouts) + ")"


def _layout_list(layouts: tuple[tuple[str, ...], ...]) -> str:
    return "; ".join(str(list(layout)) for layout in layouts)


class DatasetSpec(_Model):
    """The training data, read with Hugging Face `datasets`: supervised examples (spec.method sft) or preference pairs (dpo, orpo)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": _is_layout("self.columns", COLUMN_LAYOUTS + PREFERENCE_COLUMN_LAYOUTS),
                "message": "dataset.columns must be one of " + _layout_list(COLUMN_LAYOUTS) + " (method sft), or "
                + _layout_list(PREFERENCE_COLUMN_LAYOUTS) + " (methods dpo, orpo)",
                "fieldPath": ".columns",
            }
        )
    )

    name: str = Field(min_length=1, max_length=PATH_MAX)
    """name is a Hugging Face dataset name (e.g. openai/gsm8k) or a path/builder (e.g. json) with files under dataDir."""
    split: str = Field(default=DEFAULTS.train_split, max_length=128)
    """split to train on."""
    eval_split: str | None = Field(default=None, max_length=128)
    """evalSplit, when set, is evaluated periodically and reported as eval loss (and, for a preference method, as the share of its pairs the adapter ranks right)."""
    data_dir: str | None = Field(default=None, max_length=PATH_MAX)
    """dataDir is the dataset configuration/subset or data directory (MaxText's hf_data_dir, e.g. main for gsm8k)."""
    columns: list[Annotated[str, Field(max_length=64)]] = Field(
        default=list(COLUMN_LAYOUTS[0]), min_length=1, max_length=max(map(len, COLUMN_LAYOUTS + PREFERENCE_COLUMN_LAYOUTS))
    )
    """columns to read. Method sft: [messages] (chat turns), [prompt, completion], or [question, answer]; the loss is computed only on the answer tokens. Methods dpo and orpo: [prompt, chosen, rejected] (a prompt and two answers, each a string or a list of {role, content} messages) or [chosen, rejected] (two conversations, message lists that share every turn but the last, which is the answer, as Hugging Face preference sets store them)."""
    chat_template_path: str | None = Field(default=None, max_length=PATH_MAX)
    """chatTemplatePath is a Jinja (or JSON with a chat_template key) chat template. Defaults to the tokenizer's template."""


class EarlyStopping(_Model):
    """When to stop training before its last step."""

    patience: int = Field(ge=1, le=10_000)
    """patience is the number of evaluations in a row without improvement after which training stops."""
    min_delta: float = Field(default=0.0, ge=0, le=1000)
    """minDelta is the decrease of the best eval loss that counts as an improvement."""


class TrainingSpec(_Model):
    """The optimisation schedule."""

    steps: int = Field(ge=1, le=10_000_000)
    """steps is the number of optimizer steps to run."""
    per_device_batch_size: int = Field(default=DEFAULTS.per_device_batch_size, ge=1, le=4096)
    """perDeviceBatchSize is the number of (packed) sequences per device per micro-batch; for a preference method (dpo, orpo), the number of pairs, each a row for the chosen answer and one for the rejected on the same device."""
    max_target_length: int = Field(
        default=DEFAULTS.max_target_length, ge=BOUNDS.max_target_length[0], le=BOUNDS.max_target_length[1]
    )
    """maxTargetLength is the sequence length in tokens; examples are packed up to it. A preference method packs nothing: each answer with its prompt fills its own row, cut to this length from the end (the start is kept)."""
    learning_rate: float = Field(default=DEFAULTS.learning_rate, gt=0, le=1)
    """learningRate is the peak AdamW learning rate (2e-4 by default, the usual LoRA rate)."""
    warmup_steps_fraction: float = Field(
        default=DEFAULTS.warmup_steps_fraction, ge=0, lt=BOUNDS.warmup_steps_fraction_below
    )
    """warmupStepsFraction is the share of steps with linear warmup."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """schedule of the learning rate after warmup."""
    gradient_accumulation_steps: int = Field(default=DEFAULTS.gradient_accumulation_steps, ge=1, le=1024)
    """gradientAccumulationSteps accumulates gradients over this many micro-batches per step."""
    packing: bool = True
    """packing fills each sequence with several short examples (attention never crosses them); false gives each example a sequence of its own, so that a batch counts examples (as the fine-tuning API's batch_size does). A preference method packs nothing either way."""
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    """seed of the adapters' initialisation and of the order the examples are read in."""
    remat: RematSetting = DEFAULTS.remat_policy
    """remat is what the backward pass recomputes per decoder layer: none keeps every activation; minimal keeps the weight matmuls' and the attention kernel's outputs; attention keeps the query, key and value projections and the attention kernel's output and recomputes the MLP; full keeps only each layer's input, for about a third more compute and far less memory. auto (the default) runs the first of none, minimal, attention, full whose step fits the chips, as the TPU compiler judges it in the fit check (status.plan.remat says which)."""
    checkpoint_period: int = Field(default=DEFAULTS.checkpoint_period, ge=1, le=10_000_000)
    """checkpointPeriod saves a checkpoint every this many steps (and at the end); a resumed run restarts from the latest."""
    eval_interval: int | None = Field(default=None, ge=1, le=10_000_000)
    """evalInterval evaluates dataset.evalSplit every this many steps (needs evalSplit). Defaults to checkpointPeriod."""
    early_stopping: EarlyStopping | None = None
    """earlyStopping ends training when the eval loss stops improving (needs dataset.evalSplit); the LoRAJob then succeeds with reason EarlyStopped and exports the best checkpoint."""


def _method_cel() -> str:
    """CEL on the spec: spec.method, sft when absent (an object stored before the field existed)."""
    return f"(has(self.method) ? self.method : '{TRAINING_METHODS[0]}')"


def _preference_method_cel() -> str:
    return f"({_method_cel()} in {list(PREFERENCE_METHODS)})"


LABEL_SMOOTHING_BELOW = 0.5
"""preference.labelSmoothing is below this (contract.config.PreferenceConfig's bound)."""


class PreferenceSpec(_Model):
    """The preference methods' settings (spec.method dpo or orpo). beta, lossType and labelSmoothing are DPO's, orpoLambda is ORPO's; a field left unset takes TRL's default."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                # Not a schema maximum: the API server compares an integer (`labelSmoothing: 0`) with a fractional bound
                # cut to an integer (0 < 0.5 would read 0 < 0); CEL sees every number field as a double.
                "rule": f"!has(self.labelSmoothing) || self.labelSmoothing < {LABEL_SMOOTHING_BELOW}",
                "message": f"preference.labelSmoothing must be below {LABEL_SMOOTHING_BELOW}: it is the share of pairs "
                "whose label is flipped, and from one half on the flipped would be the majority",
                "fieldPath": ".labelSmoothing",
            },
            {
                "rule": "!has(self.labelSmoothing) || self.labelSmoothing == 0.0 "
                "|| (has(self.lossType) && self.lossType == 'robust')",
                "message": "preference.labelSmoothing needs preference.lossType robust: it is Robust DPO's assumed "
                "share of pairs whose preference label is flipped",
                "fieldPath": ".labelSmoothing",
            }
        )
    )

    # No schema defaults: the API server would fill them in, and a DPO field set under method orpo (or the reverse)
    # could not be told from one left unset. trainer_settings() applies the contract's defaults.
    beta: float | None = Field(default=None, gt=0, description=(
        "beta is DPO's beta: the rewards are beta times the log-ratio of the trained model to the reference (the "
        "model as training starts); a higher beta keeps the adapter closer to the reference (for lossType ipo, "
        f"IPO's tau). Defaults to {PREFERENCE_DEFAULTS.beta}."))
    loss_type: Literal[DPO_LOSS_TYPES] | None = Field(default=None, alias="lossType", description=(
        "lossType is DPO's loss on each pair's reward margin, as TRL's DPOTrainer computes it: sigmoid (the DPO "
        "paper), ipo (IPO, on the answers' per-token mean log-ratios) or robust (Robust DPO, with labelSmoothing). "
        f"Defaults to {PREFERENCE_DEFAULTS.loss_type}."))
    label_smoothing: float | None = Field(default=None, ge=0, description=(
        f"labelSmoothing (0 to below {LABEL_SMOOTHING_BELOW}; lossType robust only) is the assumed share of pairs whose preference label "
        f"is flipped. Defaults to {PREFERENCE_DEFAULTS.label_smoothing}."))
    orpo_lambda: float | None = Field(default=None, gt=0, alias="orpoLambda", description=(
        "orpoLambda is ORPO's lambda: the weight of the odds-ratio term beside the chosen answers' loss (TRL's "
        f"ORPOConfig.beta). Defaults to {PREFERENCE_DEFAULTS.orpo_lambda}."))

    @field_validator("label_smoothing")
    @classmethod
    def _below_one_half(cls, value: float | None) -> float | None:
        if value is not None and value >= LABEL_SMOOTHING_BELOW:
            raise ValueError(f"must be below {LABEL_SMOOTHING_BELOW}")
        return value

    def trainer_settings(self) -> dict:
        """The trainer's preference section (contract.config.PreferenceConfig), TRL's defaults where unset."""
        return {
            "beta": PREFERENCE_DEFAULTS.beta if self.beta is None else self.beta,
            "loss_type": self.loss_type or PREFERENCE_DEFAULTS.loss_type,
            "label_smoothing": PREFERENCE_DEFAULTS.label_smoothing if self.label_smoothing is None else self.label_smoothing,
            "orpo_lambda": PREFERENCE_DEFAULTS.orpo_lambda if self.orpo_lambda is None else self.orpo_lambda,
        }


PREFERENCE_RULES = (
    {
        "rule": f"{_preference_method_cel()} == "
        + _is_layout("self.dataset.columns", PREFERENCE_COLUMN_LAYOUTS),
        "message": f"spec.method and dataset.columns do not match: {METHOD_NEEDS_MATCHING_LAYOUT}",
        "fieldPath": ".dataset.columns",
    },
    {
        "rule": f"!has(self.preference) || {_preference_method_cel()}",
        "message": "spec.preference applies to method dpo or orpo only: set spec.method, or remove spec.preference",
        "fieldPath": ".preference",
    },
    {
        "rule": f"!has(self.preference) || {_method_cel()} != 'orpo' || (!has(self.preference.beta) "
        "&& !has(self.preference.lossType) && !has(self.preference.labelSmoothing))",
        "message": "preference.beta, lossType and labelSmoothing are DPO's and spec.method is orpo: ORPO has no "
        "reference model; the weight of its odds-ratio term is preference.orpoLambda",
        "fieldPath": ".preference",
    },
    {
        "rule": f"!has(self.preference) || {_method_cel()} != 'dpo' || !has(self.preference.orpoLambda)",
        "message": "preference.orpoLambda is ORPO's and spec.method is dpo: DPO's strength is preference.beta",
        "fieldPath": ".preference.orpoLambda",
    },
)
"""The rules on spec.method, spec.preference and the dataset layout (on LoRAJobSpec, where all three are visible)."""


class LoRARestore(_Model):
    """An earlier adapter to start from (exactly one of checkpoint, huggingFace)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "has(self.checkpoint) != has(self.huggingFace)",
                "message": "lora.restoreFrom needs exactly one of checkpoint (a trainer LoRA checkpoint path) "
                "or huggingFace (a PEFT adapter repo id or path, converted first)",
            }
        )
    )

    checkpoint: str | None = Field(default=None, max_length=PATH_MAX)
    """checkpoint is the path of a trainer LoRA checkpoint (e.g. gs://bucket/run/checkpoints/1000/model_params)."""
    hugging_face: str | None = Field(default=None, max_length=PATH_MAX, alias="huggingFace")
    """huggingFace is a PEFT adapter (adapter_model.safetensors + adapter_config.json): a repo id or a path. A convert step runs first."""


class LoRASpec(_Model):
    """The low-rank adapters to train."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "!(has(self.dora) && self.dora) || !has(self.baseQuantization) || self.baseQuantization == 'none'",
                "message": DORA_NEEDS_FULL_PRECISION,
            }
        )
    )

    rank: int = Field(default=DEFAULTS.lora_rank, ge=BOUNDS.lora_rank[0], le=BOUNDS.lora_rank[1])
    """rank (r) of the adapters."""
    alpha: float = Field(default=DEFAULTS.lora_alpha, gt=0, le=65536)
    """alpha scales the adapter output by alpha/rank (alpha/sqrt(rank) with rsLoRA)."""
    rs_lora: bool = Field(default=False, alias="rsLoRA")
    """rsLoRA scales the adapter output by alpha/sqrt(rank) instead of alpha/rank (rank-stabilised LoRA, PEFT's use_rslora), so the update keeps its size at large ranks. An adapter in restoreFrom must have been trained the same way."""
    dora: bool = False
    """dora trains DoRA adapters (PEFT's use_dora): besides A and B, a magnitude per output feature of each adapted weight, W' = m * (W + scale*B*A) / ||W + scale*B*A||. It adapts attention and dense MLP projections, not routed experts: for a mixture-of-experts model set targetModules to leave the experts out. An adapter in restoreFrom must be a DoRA one too."""
    base_quantization: Literal[BASE_QUANTIZATIONS] = Field(default="none", alias="baseQuantization")
    """baseQuantization holds the frozen base model quantised while the adapters train (QLoRA): none keeps the weights as loaded (bf16); int8, int4, nf4 (4-bit NormalFloat) and fp8 (float8 e4m3) quantise every decoder projection and routed expert per output channel, which cuts the weights' HBM to about a half (int8, fp8) or a quarter (int4, nf4). The embedding, norms and MoE routers stay as loaded. The adapters stay in full precision and export as an ordinary PEFT adapter for the unquantised base."""
    target_modules: str | None = Field(default=None, max_length=PATH_MAX)
    """targetModules is a regular expression over module paths that overrides the model family's default (attention q/k/v/o and MLP gate/up/down)."""
    restore_from: LoRARestore | None = None
    """restoreFrom starts training from an earlier adapter instead of zero-initialised B matrices."""


def _topology_list(topologies: tuple[str, ...], shown: int = 12) -> str:
    if len(topologies) <= shown:
        return ", ".join(topologies)
    return f"{', '.join(topologies[:shown])} or another of the {len(topologies)} in docs/user-guide.md"


class TpuSpec(_Model):
    """TPU slices for the pathways and mcjax backends."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            *(
                {
                    "rule": f"self.machineType != '{machine_type}' || self.topology in {list(machine.topologies)}",
                    "message": f"topology is not valid for {machine_type} (TPU {machine.generation}); "
                    f"use one of {_topology_list(machine.topologies)}",
                    "fieldPath": ".topology",
                }
                for machine_type, machine in accelerators.TPU_MACHINES.items()
            )
        )
    )

    machine_type: TpuMachineType
    """machineType of the TPU node pool, e.g. ct6e-standard-4t (v6e) or ct5p-hightpu-4t (v5p)."""
    topology: Topology
    """topology of one slice, e.g. 16x16 for v6e-256 or 4x4x4 for v5p-128."""
    slices: int = Field(default=1, ge=1, le=64)
    """slices is the number of TPU slices (data parallel across slices over DCN)."""


class GpuSpec(_Model):
    """GPU nodes for the gpu backend."""

    accelerator: GpuAccelerator
    """accelerator is the node label value cloud.google.com/gke-accelerator, e.g. nvidia-h200-141gb."""
    gpus_per_node: int = Field(default=8, ge=1, le=8)
    """gpusPerNode is the number of GPUs each worker pod requests (nvidia.com/gpu)."""
    nodes: int = Field(default=1, ge=1, le=512)
    """nodes is the number of worker pods, one per node."""


class ComputeSpec(_Model):
    """Where the train step runs. Convert and export always run on the CPU node pool."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "self.backend == 'gpu' ? (has(self.gpu) && !has(self.tpu)) : (has(self.tpu) && !has(self.gpu))",
                "message": "backend gpu needs compute.gpu (and no compute.tpu); backends pathways and mcjax "
                "need compute.tpu (and no compute.gpu)",
            }
        )
    )

    backend: Backend = Backend.pathways
    """backend: pathways (single-controller JAX through Pathways, the default for multi-host TPU), mcjax (multi-controller JAX on TPU) or gpu (multi-controller JAX on GPU nodes)."""
    tpu: TpuSpec | None = None
    """tpu slices for the pathways and mcjax backends."""
    gpu: GpuSpec | None = None
    """gpu nodes for the gpu backend."""
    cpu_node_pool: str | None = Field(default=None, max_length=DNS_LABEL_MAX)
    """cpuNodePool is the node pool (cloud.google.com/gke-nodepool) for the Pathways head and the check/convert/export pods. Defaults to the operator's setting (cpu-np)."""


class OutputSpec(_Model):
    """Where checkpoints and exports go."""

    base_output_directory: StoragePath
    """baseOutputDirectory is a gs:// URI or an absolute path; the run writes under <baseOutputDirectory>/<runName>/."""
    compilation_cache: StoragePath | None = Field(default=None, alias="compilationCache")
    """compilationCache is where the train step keeps JAX's persistent compilation cache (a gs:// URI or an absolute path): a retry, a resume after a suspend or preemption, and any later run of the same model, shapes and slice load their compiled programs from it instead of compiling again. Defaults to <baseOutputDirectory>/_compilation-cache, shared by the runs under it. Whoever can write there can make the trainer run code: share it only among jobs that trust each other. Unused by the pathways backend, whose programs the Pathways server compiles."""

    @property
    def compilation_cache_path(self) -> str:
        return self.compilation_cache or join(self.base_output_directory, COMPILATION_CACHE_DIRECTORY)


class ExportSpec(_Model):
    """Export of the trained adapter to Hugging Face PEFT format."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "!(has(self.path) && has(self.hubRepo))",
                "message": "set at most one export destination: export.path or export.hubRepo",
            }
        )
    )

    enabled: bool = True
    """enabled runs the export step after training."""
    path: StoragePath | None = None
    """path to write the PEFT adapter to. Defaults to <baseOutputDirectory>/<runName>/huggingface."""
    hub_repo: str | None = Field(default=None, max_length=256, pattern=r"^[A-Za-z0-9][-._A-Za-z0-9]*/[-._A-Za-z0-9]+$")
    """hubRepo (org/name) pushes the adapter to the Hugging Face Hub with credentials.huggingFaceToken."""
    merged: bool = False
    """merged also writes the base model with the adapter merged in, as Hugging Face safetensors."""
    step: str | None = Field(default=None, max_length=16, pattern=f"^({'|'.join(CHECKPOINT_SELECTORS)}|[0-9]+)$")
    """step is the checkpoint to export: latest (the default), best (lowest eval loss; needs dataset.evalSplit; the default with training.earlyStopping) or a step number. The exported step is recorded in status.outputs.exportedStep."""
    require_improvement: bool = Field(default=False, alias="requireImprovement")
    """requireImprovement skips the export unless the adapter scores above the base model in spec.evaluation; the LoRAJob then ends Failed with reason NoImprovement (the checkpoints stay)."""
    minimum_score: float | None = Field(default=None, ge=0, le=1, alias="minimumScore")
    """minimumScore (0 to 1) skips the export unless the adapter's evaluation score reaches it."""
    minimum_stop_rate: float | None = Field(default=None, ge=0, le=1, alias="minimumStopRate")
    """minimumStopRate (0 to 1) skips the export unless that share of the adapter's answers ends with an end-of-turn token."""

    def gate(self) -> ExportGate:
        return ExportGate(self.require_improvement, self.minimum_score, self.minimum_stop_rate)

    def checkpoint(self, training: TrainingSpec) -> str:
        """The checkpoint export takes, defaults applied."""
        return self.step or ("best" if training.early_stopping else "latest")


SCORERS = {"exactMatch": "exact_match", "contains": "contains", "regex": "regex", "gsm8k": "gsm8k"}
"""spec.evaluation.scorer -> the trainer's generation_eval.scorer (contract.EVAL_SCORERS)."""


class EvaluationSpec(_Model):
    """Evaluation of the base model against the trained adapter by generated answers, after the last training step
    (on the train step's accelerators, with the model it has loaded): greedy answers to the first `examples` prompts
    of dataset.evalSplit, each scored against the split's answer."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "!has(self.scorer) || self.scorer != 'regex' || has(self.pattern)",
                "message": "evaluation.scorer regex needs evaluation.pattern: the regex that extracts the answer",
                "fieldPath": ".pattern",
            },
        )
    )

    scorer: Literal[tuple(SCORERS)] = "exactMatch"
    """scorer: exactMatch (equal after lower-casing, whitespace and end punctuation normalised), contains (the reference within the answer), regex (what pattern extracts from both is equal) or gsm8k (the number after `####`)."""
    pattern: str | None = Field(default=None, min_length=1, max_length=1024)
    """pattern is the regex of scorer regex; its first group, else the whole match, is the answer."""
    max_new_tokens: int = Field(default=256, ge=1, le=32_768)
    """maxNewTokens bounds each generated answer; one that reaches it without an end-of-turn token counts against the stop rate."""
    examples: int = Field(default=64, ge=1, le=100_000)
    """examples: the first N examples of the eval split are evaluated (all when fewer)."""
    samples: int = Field(default=3, ge=0, le=20)
    """samples: how many prompts with both models' answers status.evaluation keeps (all are written to <run>/evaluation-samples.jsonl)."""

    def trainer_scorer(self) -> str:
        return SCORERS[self.scorer]


WandbMode = TrackingConfig.model_fields["wandb_mode"].annotation
"""online or offline (contract.config.TrackingConfig.wandb_mode)."""


class MLflowTracking(_Model):
    """An MLflow tracking server the train step reports its run to: parameters, a metric per logged step, and
    artifacts (the plan, the loss plot, the exported adapter)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            {
                "rule": "self.trackingUri.matches('^https?://[^/?#]+')",
                "message": "tracking.mlflow.trackingUri must be the http:// or https:// address of an MLflow tracking "
                "server (e.g. https://mlflow.example.com): the trainer's pods report to it over the network",
                "fieldPath": ".trackingUri",
            },
            {
                "rule": "!self.trackingUri.matches('^[^:]*://[^/?#]*@')",
                "message": "tracking.mlflow.trackingUri must not carry a user name or password (user:password@host): "
                "the spec and the trainer's command line are no place for them; name Secrets in "
                "credentials.mlflowUsername and mlflowPassword, or credentials.mlflowToken",
                "fieldPath": ".trackingUri",
            },
        )
    )

    tracking_uri: str = Field(max_length=PATH_MAX)
    """trackingUri is the MLflow tracking server's address (http:// or https://); its credentials are credentials.mlflowToken, or mlflowUsername and mlflowPassword."""
    experiment: str | None = Field(default=None, min_length=1, max_length=256)
    """experiment holds the run; created when missing. Defaults to the LoRAJob's namespace."""
    run_name: str | None = Field(default=None, min_length=1, max_length=256)
    """runName names the MLflow run. Defaults to the LoRAJob's name."""
    tags: dict[str, Annotated[str, Field(max_length=5000)]] = Field(default_factory=dict, max_length=32)
    """tags set on the run, beside the LoRAJob's name, namespace and uid, which the run always records."""


class WandbTracking(_Model):
    """A Weights & Biases project the train step reports its run to: the config, a metric per logged step, and
    artifacts (the plan, the loss plot, the exported adapter)."""

    project: str = Field(min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$")
    """project of the run (created when missing)."""
    entity: str | None = Field(default=None, min_length=1, max_length=128, pattern=r"^[^/\\#?%:]+$")
    """entity (user or team) that owns the project. Defaults to the API key's default entity."""
    mode: WandbMode = "online"
    """mode online reports to the W&B server (needs credentials.wandbApiKey); offline only writes the run's files, for a later `wandb sync` (under <run directory>/wandb where the run directory is a local path)."""
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=32)
    """tags set on the run."""


class TrackingSpec(_Model):
    """Experiment trackers the train step reports the run to (none by default). A tracker that cannot be reached
    never fails training: the LoRAJob's TrackingDegraded condition says which and why. Like the rest of the spec, it
    cannot change once the LoRAJob is created: one run is recorded in one place (create a new LoRAJob instead)."""

    mlflow: MLflowTracking | None = None
    """mlflow reports to an MLflow tracking server. A LoRAJobPolicy may set one by default."""
    wandb: WandbTracking | None = None
    """wandb reports to Weights & Biases."""


TRACKING_RULES = (
    {
        "rule": "!has(self.tracking) || !has(self.tracking.wandb) || self.tracking.wandb.mode == 'offline' "
        "|| (has(self.credentials) && has(self.credentials.wandbApiKey))",
        "message": "tracking.wandb in mode online needs credentials.wandbApiKey: the W&B server takes runs only with "
        "an API key (mode offline writes the run's files for `wandb sync` instead)",
        "fieldPath": ".tracking.wandb",
    },
    {
        "rule": "!has(self.credentials) || !has(self.credentials.wandbApiKey) "
        "|| (has(self.tracking) && has(self.tracking.wandb))",
        "message": "credentials.wandbApiKey is for tracking.wandb, which is not set: add tracking.wandb, or remove the key",
        "fieldPath": ".credentials.wandbApiKey",
    },
)
"""The rules between spec.tracking and spec.credentials (on LoRAJobSpec, where both are visible). MLflow credentials
may come without spec.tracking.mlflow: they can be for the MLflow server a LoRAJobPolicy sets by default."""


class SchedulingSpec(_Model):
    """Queueing, priority and lifetime."""

    queue_name: QueueName | None = None
    """queueName is the Kueue LocalQueue of the namespace that admits each step's JobSet."""
    priority_class: str | None = Field(default=None, max_length=253)
    """priorityClass is the Kueue WorkloadPriorityClass of the steps."""
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000)
    """activeDeadlineSeconds fails the LoRAJob when it has been running (not suspended) longer than this."""
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    """ttlSecondsAfterFinished deletes the LoRAJob (and its children) this long after it succeeded or failed."""
    retry_limit: int = Field(default=2, ge=0, le=20)
    """retryLimit is how many times each step is retried (with backoff) after a failure of unknown cause before the LoRAJob fails. A user error (a bad config, dataset or adapter, as the trainer's exit code says) fails it at once; infrastructure failures count against infrastructureRetryLimit instead."""
    infrastructure_retry_limit: int = Field(default=10, ge=0, le=1000)
    """infrastructureRetryLimit is how many times each step is retried after infrastructure failures (pod evicted or preempted, node lost, killed by a signal, trainer stopped by SIGTERM); training resumes from its latest checkpoint."""
    termination_grace_period_seconds: int = Field(default=120, ge=1, le=3600)
    """terminationGracePeriodSeconds is how long a train pod has after SIGTERM (preemption, drain, suspend) to finish its step and save a checkpoint there before it is killed; size it to a step plus a checkpoint write."""
    progress_deadline_seconds: int | None = Field(default=None, ge=30, le=86_400)
    """progressDeadlineSeconds, when set, restarts a train step whose step counter has not advanced for this long (counted while it runs, from its start or its last new step) as an infrastructure failure with reason Stalled, on infrastructureRetryLimit; training resumes from its latest checkpoint. Size it well above the slowest step plus its checkpoint write and evaluation, and above the trainer's start-up (checkpoint load, compilation) before its first step."""


class ImagesSpec(_Model):
    """Container images; unset ones come from the operator's defaults (which admins may set)."""

    trainer: str | None = Field(default=None, max_length=PATH_MAX)
    """trainer image, which runs the convert, train and export entry points."""
    pathways_server: str | None = Field(default=None, max_length=PATH_MAX)
    """pathwaysServer image for the Pathways resource manager and workers."""
    pathways_proxy: str | None = Field(default=None, max_length=PATH_MAX)
    """pathwaysProxy image for the Pathways proxy sidecar."""


class LoRAJobSpec(_Model):
    """LoRAJobSpec describes one LoRA fine-tune: convert (if needed, else a check step), train, export (if enabled)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            *rules.immutability_rules(),
            {
                "rule": "!has(self.training.evalInterval) || has(self.dataset.evalSplit)",
                "message": "training.evalInterval needs dataset.evalSplit: there is nothing to evaluate",
                "fieldPath": ".training.evalInterval",
            },
            {
                "rule": "!has(self.training.earlyStopping) || has(self.dataset.evalSplit)",
                "message": "training.earlyStopping needs dataset.evalSplit: it stops when the eval loss stops improving",
                "fieldPath": ".training.earlyStopping",
            },
            {
                "rule": "!has(self.evaluation) || has(self.dataset.evalSplit)",
                "message": "evaluation needs dataset.evalSplit: its prompts and answers are what both models are scored on",
                "fieldPath": ".evaluation",
            },
            {
                "rule": "has(self.evaluation) || !has(self.export) || ((!has(self.export.requireImprovement) "
                "|| !self.export.requireImprovement) && !has(self.export.minimumScore) && !has(self.export.minimumStopRate))",
                "message": "export.requireImprovement, minimumScore and minimumStopRate need spec.evaluation: the gate judges its scores",
                "fieldPath": ".export",
            },
            {
                "rule": "!has(self.export) || !has(self.export.step) || self.export.step != 'best' "
                "|| has(self.dataset.evalSplit)",
                "message": "export.step best needs dataset.evalSplit: best is the checkpoint with the lowest eval loss",
                "fieldPath": ".export.step",
            },
            {
                "rule": "(has(self.compute.backend) && self.compute.backend != 'pathways') "
                "|| !has(self.model.checkpointStorage) "
                "|| ((!has(self.model.checkpointStorage.useOcdbt) || !self.model.checkpointStorage.useOcdbt) "
                "&& (!has(self.model.checkpointStorage.useZarr3) || !self.model.checkpointStorage.useZarr3))",
                "message": "model.checkpointStorage.useOcdbt and useZarr3 need the mcjax or gpu backend: Pathways' array "
                "handler reads neither OCDBT nor Zarr v3, so its checkpoints are written without them",
                "fieldPath": ".model.checkpointStorage",
            },
            *PREFERENCE_RULES,
            *TRACKING_RULES,
        )
    )

    run_name: str | None = Field(default=None, max_length=DNS_LABEL_MAX)
    """runName names the run's outputs and child JobSets. Defaults to metadata.name."""
    suspend: bool = False
    """suspend pauses the LoRAJob: the current step's JobSet is deleted and recreated on resume, which restarts training from its latest checkpoint."""
    model: ModelSpec
    """model to fine-tune."""
    credentials: Credentials | None = None
    """credentials for Hugging Face and the experiment trackers, as references to Secrets."""
    dataset: DatasetSpec
    """dataset to fine-tune on."""
    method: Literal[TRAINING_METHODS] = TRAINING_METHODS[0]
    """method is what the adapters are trained to do: sft (supervised fine-tuning: the next-token loss of the answers), dpo (Direct Preference Optimization: prefer each pair's chosen answer to its rejected one more than the reference does, the reference being the model as training starts) or orpo (Odds Ratio Preference Optimization: the chosen answers' loss plus an odds-ratio term; no reference). dpo and orpo read a preference layout in dataset.columns and take their settings from spec.preference."""
    preference: PreferenceSpec | None = None
    """preference holds the settings of method dpo or orpo (TRL's defaults where unset)."""
    training: TrainingSpec
    """training schedule."""
    lora: LoRASpec = Field(default_factory=LoRASpec)
    """lora adapter settings."""
    compute: ComputeSpec
    """compute for the train step."""
    output: OutputSpec
    """output location."""
    evaluation: EvaluationSpec | None = None
    """evaluation of base model and adapter by generated answers after training (status.evaluation); export can be gated on it."""
    export: ExportSpec = Field(default_factory=ExportSpec)
    """export to Hugging Face PEFT format."""
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    """tracking reports the run to experiment trackers (MLflow, Weights & Biases); status.tracking links to the runs."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """scheduling: Kueue queue, priority, deadlines, retries."""
    images: ImagesSpec = Field(default_factory=ImagesSpec)
    """images overriding the operator's defaults."""


CONDITION_TYPES = (
    "Blocked", "Queued", "Admitted", "Evicted", "Running", "Suspended", "Succeeded", "Failed", "TrackingDegraded",
)
"""The condition types the operator writes, in the order status lists them."""


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str = Field(max_length=316, description=(
        f"type of the condition: {', '.join(CONDITION_TYPES)}. Blocked: a problem the operator can see outside "
        "the spec (a missing LocalQueue, a name taken) stops progress. TrackingDegraded (only with spec.tracking): "
        "True while an experiment tracker does not take what the trainer sends it (the message says which and why; "
        "training goes on), False while every tracker does."))
    status: Literal["True", "False", "Unknown"]
    """status of the condition."""
    reason: str = Field(default="", max_length=1024)
    """reason is a CamelCase machine-readable cause."""
    message: str = Field(default="", max_length=32768)
    """message is a human-readable explanation."""
    last_transition_time: datetime | None = None
    """lastTransitionTime is when the status last changed."""
    observed_generation: int | None = None
    """observedGeneration is the metadata.generation this condition was computed from."""


def _per_step(name: str, doc: str, field: type, default, field_doc: str) -> type[_Model]:
    """A model with one field per step (rules.PHASES), so a new step cannot be left out of status."""
    fields = {step: (field, Field(default, description=field_doc.format(step=step))) for step in rules.PHASES}
    return create_model(name, __base__=_Model, __doc__=doc, **fields)


PhaseChildren = _per_step("PhaseChildren", "The child JobSet of each step, by name.", str | None, None, "{step} JobSet name.")
PhaseRestarts = _per_step("PhaseRestarts", "How often each step was retried.", int, 0, "{step} retries.")


class Outputs(_Model):
    """Where the results are."""

    checkpoint_path: str | None = None
    """checkpointPath is the directory of the trainer's LoRA checkpoints."""
    adapter_path: str | None = None
    """adapterPath is the exported Hugging Face PEFT adapter."""
    base_checkpoint_path: str | None = None
    """baseCheckpointPath is the trainer-format base checkpoint (converted or given)."""
    exported_step: int | None = None
    """exportedStep is the training step whose checkpoint export.step chose (once training has finished)."""


class CheckpointStatus(_Model):
    """A complete checkpoint of the run."""

    step: int
    """step of the checkpoint."""
    time: datetime | None = None
    """time the checkpoint was saved."""
    train_loss: float | None = None
    """trainLoss at this step."""
    eval_loss: float | None = None
    """evalLoss on dataset.evalSplit at this step, when it was evaluated."""
    path: str
    """path of the checkpoint (a step directory under outputs.checkpointPath)."""


class Progress(_Model):
    """Training progress reported by the trainer."""

    step: int | None = None
    """step last completed."""
    total_steps: int | None = None
    """totalSteps to run."""
    loss: float | None = None
    """loss at the last reported step."""
    tokens_per_second: float | None = None
    """tokensPerSecond counts real (non-padding) tokens."""
    eta_seconds: int | None = None
    """etaSeconds is the estimated time to finish training."""
    eval_loss: float | None = None
    """evalLoss is the latest loss on dataset.evalSplit."""
    eval_step: int | None = None
    """evalStep is the step evalLoss was measured at."""
    reward_accuracy: float | None = None
    """rewardAccuracy (preference methods) is the share (0 to 1) of the last reported step's pairs whose chosen answer earned the higher reward."""
    reward_margin: float | None = None
    """rewardMargin (preference methods) is the mean of the chosen minus the rejected reward over the last reported step's pairs."""
    chosen_logps: float | None = None
    """chosenLogps (preference methods) is the mean log-probability of the step's chosen answers (dpo: summed over each answer's tokens; orpo: its per-token mean)."""
    rejected_logps: float | None = None
    """rejectedLogps (preference methods) is the same for the rejected answers."""
    eval_preference_accuracy: float | None = None
    """evalPreferenceAccuracy (preference methods) is the share (0 to 1) of dataset.evalSplit's pairs the adapter ranks right (its chosen answer more likely than the rejected one; for dpo, relative to the reference), measured at evalStep."""
    expert_rows_dropped: int | None = None
    """expertRowsDropped counts the (token, expert) rows a mixture-of-experts model's expert-parallel step dropped past the experts' capacity since the train step started (the trainer's expert_capacity_factor; absent without expert parallelism)."""
    state: str | None = None
    """state of the trainer: compiling (until its first step has run), running, evaluating (after the last step),
    succeeded, stopped_early (the eval loss stopped improving), preempted or failed."""
    message: str | None = Field(default=None, max_length=4096)
    """message is the trainer's explanation of its state (why it stopped or failed)."""
    summary: str | None = None
    """What kubectl get shows: `compiling`, then the step and its share, as wide at every step (` 120/1000  12%`)."""
    advanced_time: datetime | None = None
    """advancedTime is when the running train step started or its step last advanced, whichever is later (kept only while it runs with scheduling.progressDeadlineSeconds set): the stall watchdog counts from it."""


class DataStatus(_Model):
    """The data check's figures (the check or convert step runs it before the train step asks Kueue for accelerators)."""

    examples: int | None = None
    """examples in the training split."""
    tokens: int | None = None
    """tokens of every example, the chat template rendered."""
    trained_tokens: int | None = None
    """trainedTokens are the answer tokens the loss is computed on, before truncation."""
    epochs: float | None = None
    """epochs is how many passes over the data training.steps x the global batch amounts to."""
    truncated_examples: int | None = None
    """truncatedExamples are the examples longer than training.maxTargetLength."""
    truncated_share: float | None = None
    """truncatedShare is the share (0 to 1) of the trained tokens training.maxTargetLength cuts off."""


class PlanStatus(_Model):
    """The fit check's figures: the train step compiled for the LoRAJob's TPU chips by the TPU compiler, before any
    was held (the CPU step before the train step runs it; `lorajob plan` prints the same)."""

    target: str | None = None
    """target is the machine type, topology, chips and batch the step was compiled for."""
    hbm_bytes_per_chip: int | None = None
    """hbmBytesPerChip is the HBM the compiler assigns per chip (arguments, outputs, temporaries)."""
    capacity_bytes: int | None = None
    """capacityBytes is the chip's HBM less the plan's safety margin."""
    step_seconds: float | None = None
    """stepSeconds is the roofline's step time (compute, HBM and ICI bounds; activations' traffic left out)."""
    tokens_per_second: float | None = None
    """tokensPerSecond is the roofline's prediction for the whole train step (all chips), to set beside progress.tokensPerSecond."""
    mfu: float | None = None
    """mfu is the roofline's model-FLOPs-utilisation ceiling (0 to 1)."""
    bound: str | None = None
    """bound says what bounds the roofline: compute, HBM bandwidth or ICI collectives (the compiled step's, on TPU; NVLink all-gathers in a GPU estimate)."""
    compile_seconds: float | None = None
    """compileSeconds is how long the compile took on the CPU step's pod."""
    remat: str | None = None
    """remat is the remat policy the step was compiled with: training.remat, or what auto chose."""


class ModelEvaluation(_Model):
    """One model's results on the evaluated prompts."""

    score: float | None = None
    """score is the share (0 to 1) of answers the scorer counts as right."""
    stop_rate: float | None = None
    """stopRate is the share (0 to 1) of answers that ended with an end-of-turn or EOS token before maxNewTokens."""
    mean_length: float | None = None
    """meanLength is the mean answer length in tokens."""
    preference_accuracy: float | None = None
    """preferenceAccuracy (spec.method dpo, orpo) is the share (0 to 1) of the eval split's pairs whose chosen answer the model finds likelier than the rejected one, per token (the answers' mean log-probabilities: a sum would favour the shorter); export.requireImprovement compares it, not score."""


class EvaluationSample(_Model):
    """One evaluated prompt with both models' answers (each cut to 300 characters)."""

    prompt: str = Field(default="", max_length=1024)
    reference: str = Field(default="", max_length=1024)
    base: str = Field(default="", max_length=1024)
    adapter: str = Field(default="", max_length=1024)


class EvaluationStatus(_Model):
    """The evaluation of base and adapter (spec.evaluation), run by the train step after its last step."""

    scorer: str | None = None
    examples: int | None = None
    """examples evaluated."""
    step: int | None = None
    """step is the training step whose adapter was evaluated."""
    seconds: float | None = None
    """seconds both models' generations and the scoring took."""
    base: ModelEvaluation | None = None
    adapter: ModelEvaluation | None = None
    samples: list[EvaluationSample] = Field(default_factory=list, max_length=20)


class ResolvedImages(_Model):
    """The images the steps run with."""

    trainer: str | None = None
    """trainer image."""
    pathways_server: str | None = None
    """pathwaysServer image."""
    pathways_proxy: str | None = None
    """pathwaysProxy image."""


class Resolved(_Model):
    """Settings the operator filled in from its defaults and LoRAJobPolicies (the spec is never rewritten)."""

    queue_name: str | None = None
    """queueName is the Kueue LocalQueue the steps are submitted to."""
    cpu_node_pool: str | None = None
    """cpuNodePool hosts the Pathways head and the convert/export pods."""
    images: ResolvedImages | None = None
    """images the steps run with."""
    mlflow_tracking_uri: str | None = None
    """mlflowTrackingUri is the MLflow server the train step reports to: spec.tracking.mlflow's, else a LoRAJobPolicy's default."""
    policies: list[str] = Field(default_factory=list, max_length=64)
    """policies are the LoRAJobPolicies that apply to this LoRAJob's namespace."""


TRACKER_TITLES = {"mlflow": "MLflow", "wandb": "Weights & Biases"}
"""Each experiment tracker (contract.records.TRACKERS) as people call it."""


class TrackedRun(_Model):
    """One experiment tracker's run of the LoRAJob."""

    url: str | None = None
    """url of the run in the tracker's web UI."""


class TrackingStatus(_Model):
    """The experiment trackers' runs (spec.tracking), as the trainer reports them."""

    mlflow: TrackedRun | None = None
    """mlflow run (spec.tracking.mlflow, or a LoRAJobPolicy's default server)."""
    wandb: TrackedRun | None = None
    """wandb run (spec.tracking.wandb)."""


class LoRAJobStatus(_Model):
    """LoRAJobStatus is computed by the operator from the child JobSets and their Kueue Workloads."""

    phase: Phase | None = None
    """phase: Pending, Queued, Checking, Converting, Training, Exporting, Succeeded, Failed or Suspended."""
    message: str | None = None
    """message explains the phase (e.g. why it is queued or failed)."""
    conditions: list[Condition] = Field(default_factory=list, max_length=16)
    """conditions in the standard Kubernetes shape."""
    observed_generation: int | None = None
    """observedGeneration is the metadata.generation the status reflects."""
    children: PhaseChildren | None = None
    """children names the JobSet of each step."""
    start_time: datetime | None = None
    """startTime is when the first step was created."""
    completion_time: datetime | None = None
    """completionTime is when the LoRAJob succeeded or failed."""
    restarts: PhaseRestarts | None = None
    """restarts counts retries per step, whatever their cause."""
    infrastructure_restarts: PhaseRestarts | None = None
    """infrastructureRestarts counts the retries (of restarts) after infrastructure failures, which do not use up retryLimit."""
    outputs: Outputs | None = None
    """outputs of the run."""
    progress: Progress | None = None
    """progress of training."""
    data: DataStatus | None = None
    """data holds the data check's figures, once the check or convert step has run it."""
    plan: PlanStatus | None = None
    """plan holds the fit check's figures (TPU backends), once the check or convert step has run it."""
    evaluation: EvaluationStatus | None = None
    """evaluation holds base and adapter scores, once the train step has evaluated them (spec.evaluation)."""
    checkpoints: list[CheckpointStatus] = Field(default_factory=list, max_length=CHECKPOINTS_LISTED)
    """checkpoints are the complete checkpoints the run keeps (the newest few and the best by eval loss), oldest first."""
    resolved: Resolved | None = None
    """resolved records the defaults the operator applied (queue, images, CPU node pool, MLflow server) and the policies in force."""
    tracking: TrackingStatus | None = None
    """tracking links to the run in each experiment tracker (spec.tracking), once the trainer has started it."""


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress.summary"},
    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
    {"name": "Queue", "type": "string", "jsonPath": ".status.resolved.queueName"},  # the queue in force, policy default included
    {"name": "Backend", "type": "string", "jsonPath": ".spec.compute.backend", "priority": 1},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
    {"name": "Eval Loss", "type": "number", "jsonPath": ".status.progress.evalLoss", "priority": 1},
    {"name": "Reward Acc", "type": "number", "jsonPath": ".status.progress.rewardAccuracy", "priority": 1},
    {"name": "Score", "type": "number", "jsonPath": ".status.evaluation.adapter.score"},
    {"name": "MLflow Run", "type": "string", "jsonPath": ".status.tracking.mlflow.url", "priority": 1},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
