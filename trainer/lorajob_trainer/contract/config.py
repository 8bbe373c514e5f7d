"""Trainer configuration: a YAML file plus MaxText-style `key=value` overrides.

Imports without JAX: the operator builds command lines with `TrainConfig.to_args()` and the
trainer parses them back with `TrainConfig.from_args(argv)`. Keys follow MaxText's SFT trainer
where it has one (`steps`, `per_device_batch_size`, `lora.lora_rank`, ...). Nested keys are
written with dots (`lora.lora_rank=8`), list values in YAML flow style
(`train_data_columns=['question','answer']`). Unknown or malformed keys fail before any work,
with a message naming the key.
"""

from __future__ import annotations

import difflib
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lorajob_trainer.contract import catalog
from lorajob_trainer.contract.records import (
    BASE_QUANTIZATIONS, BOUNDS, COLUMN_LAYOUTS, DEFAULTS, DORA_NEEDS_FULL_PRECISION, DPO_LOSS_TYPES, EVAL_SCORERS,
    METHOD_NEEDS_MATCHING_LAYOUT, PREFERENCE_COLUMN_LAYOUTS, PREFERENCE_DEFAULTS, PREFERENCE_METHODS, TRAINING_METHODS,
    RematSetting, RunLayout,
)



class ConfigError(ValueError):
    """A config key is unknown, malformed or has an invalid value; the message names the key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class LoraConfig(_Section):
    enable_lora: bool = True
    """Must be true: this trainer trains LoRA adapters only."""
    lora_rank: int = Field(DEFAULTS.lora_rank, ge=BOUNDS.lora_rank[0], le=BOUNDS.lora_rank[1])
    """Adapter rank r."""
    lora_alpha: float = Field(DEFAULTS.lora_alpha, gt=0)
    """Adapter scale numerator: the update is (alpha / r) * B A."""
    use_rslora: bool = False
    """rsLoRA (PEFT's use_rslora): the update is (alpha / sqrt(r)) * B A, which keeps its size as r grows."""
    use_dora: bool = False
    """DoRA (PEFT's use_dora): each adapted weight's output features also get a learned magnitude,
    W' = m * (W + s B A) / ||W + s B A||. Not on routed experts."""
    base_quantization: Literal[BASE_QUANTIZATIONS] = "none"
    """QLoRA: hold the frozen decoder projections quantised (contract.records.BASE_QUANTIZATIONS); the adapters stay
    in the base's dtype."""

    @model_validator(mode="after")
    def _variants_combine(self) -> LoraConfig:
        if self.use_dora and self.base_quantization != "none":
            raise ValueError(DORA_NEEDS_FULL_PRECISION)
        return self
    lora_module_path: str = ""
    """Expert override: a regex over model module paths selecting the adapted layers."""
    target_modules: list[str] | None = None
    """Hugging Face projection names to adapt (q_proj, ..., down_proj); None = the family default."""
    lora_restore_path: str = ""
    """Start from an earlier adapter (a LoRA checkpoint directory); ignored when resuming a run."""

    @model_validator(mode="after")
    def _one_target_selector(self) -> LoraConfig:
        if not self.enable_lora:
            raise ValueError("lora.enable_lora=false is not supported: only LoRA fine-tuning is implemented")
        if self.lora_module_path and self.target_modules is not None:
            raise ValueError("set either lora.lora_module_path or lora.target_modules, not both")
        if self.target_modules is not None and not self.target_modules:
            raise ValueError("lora.target_modules must not be empty")
        return self


class MeshConfig(_Section):
    data: int = -1
    """Data-parallel degree across slices (DCN); -1 = number of slices."""
    fsdp: int = -1
    """Parameter-sharding degree within a slice; -1 = all devices of a slice not used by expert and tensor."""
    expert: Annotated[int, Field(gt=0)] | Literal["auto"] = "auto"
    """Expert-parallel degree within a slice: MoE models' routed experts (and their adapters) are split over
    it along the expert dimension, and each token travels to the devices holding its experts and back; the batch
    and the weights fsdp splits are split over it too. auto: the largest degree dividing both the devices of a
    slice and the model's experts, where the tokens' all-to-alls send fewer bytes than gathering every expert's
    weights to every device (models/experts.expert_axis_for), else 1; 1 for a model without routed experts."""
    tensor: int = Field(1, gt=0)
    """Tensor-parallel degree within a slice."""

    @property
    def expert_degree(self) -> int:
        """`expert` as a number: 1 while still "auto", where no model decided it (run.resolve_expert_axis decides
        for the trainer and the plan; a mesh for convert or export has no experts to split)."""
        return 1 if self.expert == "auto" else self.expert

    @model_validator(mode="after")
    def _positive_or_fill(self) -> MeshConfig:
        for axis in ("data", "fsdp"):
            value = getattr(self, axis)
            if value == 0 or value < -1:
                raise ValueError(f"mesh.{axis} must be a positive integer or -1 (fill), got {value}")
        return self


class GenerationEvalConfig(_Section):
    enabled: bool = False
    """After the last step, generate answers to the evaluation prompts with the base model and with the trained
    adapter, score both and write <run>/evaluation.json (and print a LORAJOB_EVAL line)."""
    scorer: Literal[EVAL_SCORERS] = "exact_match"
    """How an answer is scored against the reference answer (contract.records.EVAL_SCORERS)."""
    pattern: str = ""
    """scorer=regex: the regex whose first group (else whole match) is the answer, searched in both texts."""
    max_new_tokens: int = Field(256, ge=1, le=32_768)
    """Tokens generated per answer at most."""
    examples: int = Field(64, ge=1, le=100_000)
    """The first N evaluation examples are scored (all when fewer)."""
    batch_size: int = Field(0, ge=0)
    """Prompts generated at once; 0 = per_device_batch_size rows per device."""
    samples: int = Field(3, ge=0, le=20)
    """Examples whose prompt and answers the record carries."""

    @model_validator(mode="after")
    def _pattern_compiles(self) -> GenerationEvalConfig:
        if self.scorer == "regex" and not self.pattern:
            raise ValueError("generation_eval.scorer=regex needs generation_eval.pattern")
        if self.pattern:
            try:
                re.compile(self.pattern)
            except re.error as error:
                raise ValueError(f"generation_eval.pattern is not a regex: {error}") from None
        return self


class PreferenceConfig(_Section):
    beta: float = Field(PREFERENCE_DEFAULTS.beta, gt=0)
    """DPO's beta: the rewards are beta times the log-ratio of the trained model to the reference; higher keeps
    the trained model closer to the reference (IPO: its tau)."""
    loss_type: Literal[DPO_LOSS_TYPES] = PREFERENCE_DEFAULTS.loss_type
    """DPO's loss (contract.records.DPO_LOSS_TYPES)."""
    label_smoothing: float = Field(PREFERENCE_DEFAULTS.label_smoothing, ge=0, lt=0.5)
    """loss_type=robust: the assumed share of pairs whose preference label is flipped."""
    orpo_lambda: float = Field(PREFERENCE_DEFAULTS.orpo_lambda, gt=0)
    """ORPO's lambda: the weight of the odds-ratio term beside the chosen answers' NLL (TRL's ORPOConfig.beta)."""

    @model_validator(mode="after")
    def _smoothing_is_robust(self) -> PreferenceConfig:
        if self.label_smoothing and self.loss_type != "robust":
            raise ValueError("preference.label_smoothing applies to loss_type=robust only (the share of flipped "
                             f"labels); loss_type is {self.loss_type}")
        return self


class TrackingConfig(_Section):
    """Experiment trackers the lead process reports the run to (lorajob_trainer.tracking). Credentials come from
    the environment only (MLFLOW_TRACKING_TOKEN or MLFLOW_TRACKING_USERNAME/PASSWORD, WANDB_API_KEY)."""

    mlflow_tracking_uri: str = ""
    """MLflow tracking server (http:// or https://, or a local path for a file store); empty = no MLflow."""
    mlflow_experiment: str = ""
    """The MLflow experiment of the run, created when missing; empty = the LoRAJob's namespace, else "lorajob"."""
    mlflow_run_name: str = ""
    """The MLflow run's name; empty = the LoRAJob's name, else run_name."""
    mlflow_tags: dict[str, str] = {}
    """Tags set on the MLflow run."""
    wandb_project: str = ""
    """The Weights & Biases project; empty = no W&B."""
    wandb_entity: str = ""
    """The W&B entity (user or team); empty = the API key's default."""
    wandb_mode: Literal["online", "offline"] = "online"
    """online: report to the W&B server; offline: write the run's files under wandb_dir for `wandb sync`."""
    wandb_tags: list[str] = []
    """Tags set on the W&B run."""
    wandb_dir: str = ""
    """A local directory for W&B's files; empty = <run directory>/wandb when it is local, else a temporary one."""
    job_name: str = ""
    """The LoRAJob's name, recorded with the run (the operator sets it, with its namespace and uid)."""
    job_namespace: str = ""
    """The LoRAJob's namespace, recorded with the run; the MLflow experiment where mlflow_experiment is empty."""
    job_uid: str = ""
    """The LoRAJob's uid, recorded with the run."""

    @property
    def trackers(self) -> tuple[str, ...]:
        """The configured trackers, by name (contract.records.TRACKERS)."""
        return tuple(name for name, on in (("mlflow", self.mlflow_tracking_uri), ("wandb", self.wandb_project)) if on)

    def to_args(self) -> list[str]:
        """`tracking.key=value` overrides that reproduce this section (fields that differ from defaults): the train
        command line's own, which the export entry point takes as well."""
        return [f"{key}={_format_value(value)}"
                for key, value in _flatten(self.model_dump(exclude_defaults=True), prefix=TRACKING_PREFIX)]

    @classmethod
    def from_args(cls, argv: list[str]) -> TrackingConfig:
        """Parse `tracking.key=value` overrides (`to_args`); ConfigError naming a key that is not a tracking key."""
        values: dict[str, Any] = {}
        for argument in argv:
            key, value = _split_override(argument)
            if not key.startswith(TRACKING_PREFIX):
                raise ConfigError(f"{argument!r}: only {TRACKING_PREFIX}* keys are taken here")
            _merge(values, {key: _parse_value(key, value)}, source="command line")
        try:
            return cls.model_validate(values.get("tracking", {}))
        except ValidationError as error:
            raise ConfigError(_describe(error)) from None


TRACKING_PREFIX = "tracking."
"""The tracking section's keys on a command line."""


LOSS_CHUNK_TOKENS = 512
"""Positions per device in one chunk of the loss by default: the chunk's LM-head matmuls read the whole head
[hidden, vocab] for that many positions, and on a TPU below about 240 positions per read (v5e: 197 TFLOP/s over
819 GB/s) they wait on memory, not the matrix unit (qwen3-4b on a v5e chip, 2 rows of 64 positions a chunk:
67 ms of its 854 ms step for a head that needs 32)."""


@dataclass(frozen=True)
class StepShape:
    """What one train step takes per device: `accumulation` micro-batches of `rows` sequences of `length`
    positions; the loss is computed `loss_chunk` positions of each row at a time."""

    rows: int
    length: int
    accumulation: int
    loss_chunk: int

    @property
    def tokens(self) -> int:
        """Positions per device per step."""
        return self.rows * self.length * self.accumulation


def default_loss_chunk(rows: int) -> int:
    """Positions per row of a loss chunk by default for `rows` rows per device: `LOSS_CHUNK_TOKENS` over them, at
    least 64."""
    return max(64, LOSS_CHUNK_TOKENS // rows)


class TrainConfig(_Section):
    run_name: str = Field(min_length=1)
    """Name of the run; outputs go to <base_output_directory>/<run_name>/."""
    base_output_directory: str = Field(min_length=1)
    """Root for checkpoints, metrics and the progress file."""

    model_name: str
    """A model name from lorajob_trainer.contract.catalog (selects the model family)."""
    load_parameters_path: str = Field(min_length=1)
    """Base weights: a local directory of Hugging Face safetensors + config.json, a lorajob base checkpoint
    (`python -m lorajob_trainer.convert base`) or a MaxText checkpoint (`.../0/items`, scanned or not);
    the last two also as gs:// URIs."""
    tokenizer_path: str = ""
    """Tokenizer directory, gs:// URI or Hub repo id; empty = load_parameters_path. For a MaxText base it
    must also hold the model's config.json (MaxText checkpoints carry none)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Compute and base-weight dtype; auto = bfloat16 on accelerators, float32 on CPU."""

    hf_path: str = ""
    """Dataset: a Hugging Face hub name, or a builder (json, parquet, csv) used with hf_train_files."""
    hf_name: str = ""
    """Dataset configuration name."""
    hf_data_dir: str = ""
    """Dataset data_dir (for example `main` for openai/gsm8k)."""
    hf_train_files: list[str] | None = None
    """Local training files or directories; replaces hub download."""
    hf_eval_files: list[str] | None = None
    """Local evaluation files or directories."""
    train_split: str = DEFAULTS.train_split
    """Split used for training."""
    hf_eval_split: str = ""
    """Split used for evaluation (hub datasets); empty = no evaluation split."""
    train_data_columns: list[str] = list(COLUMN_LAYOUTS[0])
    """Column layout: ['messages'], ['prompt','completion'] or ['question','answer']; for a preference method
    ['prompt','chosen','rejected'] or ['chosen','rejected'] (contract.records.PREFERENCE_COLUMN_LAYOUTS)."""
    chat_template_path: str = ""
    """Chat template file (.jinja/.j2/.txt, or .json with a chat_template key); empty = tokenizer's."""
    max_target_length: int = Field(
        DEFAULTS.max_target_length, ge=BOUNDS.max_target_length[0], le=BOUNDS.max_target_length[1]
    )
    """Sequence length of one packed row, in tokens."""
    packing: bool = True
    """Pack several examples into one row (attention never crosses examples)."""
    shuffle: bool = True
    """Shuffle examples, with a new order per epoch."""
    data_shuffle_seed: int = 0
    """Seed of the per-epoch example order."""
    epoch_policy: Literal["continue", "fail"] = "continue"
    """At the end of the data: continue into the next epoch (logged), or fail the run."""

    method: Literal[TRAINING_METHODS] = "sft"
    """What the adapters are trained to do (contract.records.TRAINING_METHODS)."""
    preference: PreferenceConfig = PreferenceConfig()
    """The preference methods' settings (method dpo or orpo)."""
    steps: int = Field(gt=0)
    """Optimizer steps to run."""
    per_device_batch_size: int = Field(DEFAULTS.per_device_batch_size, gt=0)
    """Rows per device per micro-batch; for a preference method, pairs (each a row for the chosen answer and one
    for the rejected, on the same device)."""
    gradient_accumulation_steps: int = Field(DEFAULTS.gradient_accumulation_steps, gt=0)
    """Micro-batches accumulated into one optimizer step."""
    learning_rate: float = Field(DEFAULTS.learning_rate, gt=0)
    """Peak learning rate."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup."""
    warmup_steps_fraction: float = Field(DEFAULTS.warmup_steps_fraction, ge=0, lt=BOUNDS.warmup_steps_fraction_below)
    """Fraction of steps with a linear warmup from 0."""
    learning_rate_final_fraction: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak (cosine and linear)."""
    adam_b1: float = Field(0.9, ge=0, lt=1)
    """Adam's first-moment decay."""
    adam_b2: float = Field(0.999, ge=0, lt=1)
    """Adam's second-moment decay."""
    adam_eps: float = Field(1e-8, gt=0)
    """Adam's denominator epsilon."""
    adam_weight_decay: float = Field(0.0, ge=0)
    """Decoupled (AdamW) weight decay on the adapters."""
    gradient_clipping_threshold: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this; 0 = no clipping."""
    seed: int = 0
    """Seed of the adapter initialisation."""
    loss_chunk_length: int | None = Field(None, gt=0)
    """Positions per row whose LM-head logits exist at one time: the loss never builds all
    [batch, length, vocab] logits, and skips chunks without trained tokens (each row's trained positions
    come first). Shorter chunks skip more of the prompt and padding but make more, smaller LM-head matmuls,
    each reading the whole head again. Default (`loss_chunk_per_row`): `LOSS_CHUNK_TOKENS` positions per
    device over its rows, at least 64 per row."""
    remat_policy: RematSetting = DEFAULTS.remat_policy
    """What the backward pass recomputes per decoder layer (remat.py): none = keep every activation;
    minimal = keep each projection's output and the attention kernel's, recompute norms, activations and dense
    attention's scores; attention = keep the query, key and value projections and the attention kernel's output,
    recompute the MLP; full = keep only each layer's input; auto = the first of these whose step fits the devices (the fit check's
    choice in the run's plan.json, else compiled on the devices at start; minimal where a device reports no memory
    capacity, as a CPU)."""

    expert_capacity_factor: float = Field(2.0, ge=0)
    """With mesh.expert > 1: each device sends each device of its expert group room for this many times its
    even share of its (token, expert) rows (models/experts.py); rows beyond that room are dropped, counted
    in the step's metrics (expert_rows_dropped) as the empty room is (expert_slots_padded). 0 = room for
    every row whatever the routing: nothing dropped, mesh.expert times the traffic."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """Weight of the MoE load-balancing loss added to the LM loss, as transformers' router_aux_loss_coef
    (Qwen3 MoE; Gemma 4 defines no such loss); None = as the checkpoint's config.json: its
    router_aux_loss_coef when output_router_logits is true, else 0 (off). 0 still reports it (aux_loss)."""

    eval_interval: int = Field(0, ge=0)
    """Evaluate every N steps (and after the last); 0 = never."""
    eval_steps: int = Field(1, gt=0)
    """Batches per evaluation."""
    early_stopping_patience: int = Field(0, ge=0)
    """Stop after this many evaluations in a row without an improvement of the best eval loss by
    early_stopping_min_delta (a checkpoint is saved at the stop); 0 = never stop early."""
    early_stopping_min_delta: float = Field(0.0, ge=0)
    """The decrease of the eval loss that counts as an improvement."""

    generation_eval: GenerationEvalConfig = GenerationEvalConfig()
    """Base model against adapter by generated answers, after training."""

    enable_checkpointing: bool = True
    """Save LoRA checkpoints (adapters, optimizer state, data position) to resume from."""
    checkpoint_period: int = Field(DEFAULTS.checkpoint_period, gt=0)
    """Save every N steps; the last step is always saved."""
    max_num_checkpoints_to_keep: int = Field(3, gt=0)
    """Older checkpoints beyond this many are deleted."""
    async_checkpointing: bool = True
    """Write checkpoints in the background while training continues."""
    checkpoint_storage_use_zarr3: bool = DEFAULTS.use_zarr3
    """Write checkpoints in Zarr v3 (Pathways needs it off)."""
    checkpoint_storage_use_ocdbt: bool = DEFAULTS.use_ocdbt
    """Write checkpoints as one OCDBT key-value store (Pathways needs it off)."""

    mesh: MeshConfig = MeshConfig()
    """Device mesh axes."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters."""
    log_period: int = Field(1, gt=0)
    """Log metrics every N steps."""
    enable_tensorboard: bool = True
    """Also write TensorBoard event files under <run>/tensorboard."""
    progress_lines: bool = False
    """Print each progress update as one `LORAJOB_PROGRESS {json}` line on stdout for the operator, which
    reads it from the pod log (the pods it renders turn this on); a person gets a progress bar instead."""
    tracking: TrackingConfig = TrackingConfig()
    """Experiment trackers (MLflow, Weights & Biases) the run reports to; none by default."""
    compilation_cache_dir: str = ""
    """JAX's persistent compilation cache (a local path or gs:// URI): compiled programs are read from it instead of
    compiled again, and written to it. Empty: JAX's own setting (JAX_COMPILATION_CACHE_DIR)."""
    peak_tflops_per_device: float | None = Field(None, gt=0)
    """Peak dense TFLOP/s of one device for MFU; None = look up the device kind."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> TrainConfig:
        catalog.family_of(self.model_name)
        layouts = PREFERENCE_COLUMN_LAYOUTS if self.preference_method else COLUMN_LAYOUTS
        if tuple(self.train_data_columns) not in layouts:
            raise ValueError(f"train_data_columns={self.train_data_columns} with method={self.method}: "
                             f"{METHOD_NEEDS_MATCHING_LAYOUT}")
        if not self.hf_path and not self.hf_train_files:
            raise ValueError("no training data: set hf_path or hf_train_files")
        if self.eval_interval and not (self.hf_eval_files or self.hf_eval_split):
            raise ValueError("eval_interval is set but there is no evaluation data: set hf_eval_files or hf_eval_split")
        if self.early_stopping_patience and not self.eval_interval:
            raise ValueError("early_stopping_patience needs evaluations: set eval_interval (and evaluation data)")
        if self.generation_eval.enabled and not (self.hf_eval_files or self.hf_eval_split):
            raise ValueError("generation_eval.enabled needs evaluation data: set hf_eval_files or hf_eval_split")
        return self

    @property
    def preference_method(self) -> bool:
        """The method trains on preference pairs (dpo, orpo)."""
        return self.method in PREFERENCE_METHODS

    @property
    def rows_per_device(self) -> int:
        """Rows per device per micro-batch: per_device_batch_size, twice that for a preference method's pairs."""
        return self.per_device_batch_size * (2 if self.preference_method else 1)

    # Derived paths.
    @property
    def loss_chunk_per_row(self) -> int:
        """`loss_chunk_length`, or by default `LOSS_CHUNK_TOKENS` over the rows of a micro-batch, at least 64."""
        if self.loss_chunk_length is not None:
            return self.loss_chunk_length
        return default_loss_chunk(self.rows_per_device)

    @property
    def step_shape(self) -> StepShape:
        return StepShape(self.rows_per_device, self.max_target_length, self.gradient_accumulation_steps,
                         self.loss_chunk_per_row)

    @property
    def layout(self) -> RunLayout:
        return RunLayout(self.base_output_directory, self.run_name)

    @property
    def run_directory(self) -> Path:
        return Path(self.layout.run_directory)

    @property
    def checkpoint_directory(self) -> Path:
        return Path(self.layout.checkpoints)

    @property
    def family(self) -> str:
        return catalog.family_of(self.model_name)

    @property
    def tokenizer_directory(self) -> str:
        return self.tokenizer_path or self.load_parameters_path

    # Command lines.
    @classmethod
    def from_args(cls, argv: list[str], base_yaml: str | Path | None = None) -> TrainConfig:
        """Parse `[config.yaml] key=value...` (on top of `base_yaml` if given)."""
        values: dict[str, Any] = {}
        if base_yaml is not None:
            _merge(values, _read_yaml(Path(base_yaml)), source=str(base_yaml))
        overrides = list(argv)
        if overrides and "=" not in overrides[0]:
            config_file = Path(overrides.pop(0))
            _merge(values, _read_yaml(config_file), source=str(config_file))
        for argument in overrides:
            key, value = _split_override(argument)
            _merge(values, {key: _parse_value(key, value)}, source="command line")
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        try:
            return cls.model_validate(values)
        except ValidationError as error:
            raise ConfigError(_describe(error)) from None

    def to_args(self) -> list[str]:
        """`key=value` overrides that reproduce this config (fields that differ from defaults)."""
        return [f"{key}={_format_value(value)}" for key, value in _flatten(self.model_dump(exclude_defaults=True))]


KEY_GROUPS: dict[str, str] = {
    "run_name": "Run identity and outputs",
    "model_name": "Model",
    "hf_path": "Data",
    "steps": "Optimisation",
    "eval_interval": "Evaluation",
    "enable_checkpointing": "Checkpointing",
    "log_period": "Reporting",
}
"""The first top-level key of each group of `--help`, in field order; `lora.*` and `mesh.*` get their own."""


def describe_keys() -> str:
    """Every config key with its type, default and doc, grouped as the config is: the `--help` text."""
    lines: list[str] = []
    for title, fields in _key_groups():
        lines.append(f"{title}:")
        for key, field in fields:
            lines.append(f"  {key}  ({_type_name(field.annotation)}, {_default_text(field)})")
            lines.extend(f"      {line.strip()}" for line in (field.description or "").strip().splitlines())
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def all_keys() -> list[str]:
    """Every dotted config key a YAML file or override may set."""
    return [key for _, fields in _key_groups() for key, _ in fields]


def _key_groups() -> list[tuple[str, list[tuple[str, Any]]]]:
    groups: list[tuple[str, list[tuple[str, Any]]]] = []
    sections: list[tuple[str, list[tuple[str, Any]]]] = []
    for name, field in TrainConfig.model_fields.items():
        if name in KEY_GROUPS:
            groups.append((KEY_GROUPS[name], []))
        if _is_section_type(field.annotation):
            sub_keys = [(f"{name}.{key}", sub) for key, sub in field.annotation.model_fields.items()]
            sections.append((f"{field.description.rstrip('.')} ({name}.*)", sub_keys))
        else:
            groups[-1][1].append((name, field))
    return groups + sections


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return " | ".join(str(choice) for choice in typing.get_args(annotation))
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    default = field.get_default(call_default_factory=True)
    return f"default: {_format_value(default) if default not in ('', None) else repr(default)}"


def _is_section_type(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, _Section)


def resolve_target_modules(lora: LoraConfig, family_default: list[str]) -> list[str] | None:
    """Target modules: command line / YAML (`lora.target_modules`) > the family default.

    Returns None when an explicit regex (`lora.lora_module_path`) selects the layers instead.
    """
    if lora.lora_module_path:
        return None
    if lora.target_modules is not None:
        return list(lora.target_modules)
    return list(family_default)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(loaded).__name__}")
    return loaded


def _split_override(argument: str) -> tuple[str, str]:
    key, separator, value = argument.partition("=")
    key = key.strip()
    if not separator or not key:
        raise ConfigError(f"malformed override {argument!r}: expected key=value")
    _field_annotation(key)
    return key, value


def _merge(values: dict[str, Any], update: dict[str, Any], *, source: str) -> None:
    """Merge `update` (nested dicts and/or dotted keys) into `values`, checking every key exists."""
    for key, value in _flatten(update):
        _field_annotation(key, source=source)
        section = values
        *parents, leaf = key.split(".")
        for parent in parents:
            section = section.setdefault(parent, {})
        section[leaf] = value


def _flatten(values: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    flat: list[tuple[str, Any]] = []
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and _is_section(dotted):
            flat.extend(_flatten(value, prefix=f"{dotted}."))
        else:
            flat.append((dotted, value))
    return flat


def _is_section(dotted_key: str) -> bool:
    try:
        annotation = _field_annotation(dotted_key)
    except ConfigError:
        return False
    return _is_section_type(annotation)


def _field_annotation(dotted_key: str, *, source: str = "command line") -> Any:
    """The type annotation of a dotted key; ConfigError naming the key if it does not exist."""
    model: type[BaseModel] = TrainConfig
    parts = dotted_key.split(".")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            where = ".".join(parts[:depth]) or "the top level"
            known = ", ".join(sorted(model.model_fields))
            raise ConfigError(f"unknown config key {dotted_key!r} ({source}).{_suggestion(dotted_key)} Keys at {where}: "
                              f"{known} (every key: --help)")
        annotation = field.annotation
        if depth < len(parts) - 1:
            if not _is_section_type(annotation):
                raise ConfigError(f"unknown config key {dotted_key!r} ({source}): {'.'.join(parts[: depth + 1])} has no sub-keys")
            model = annotation
    return annotation


def _suggestion(dotted_key: str) -> str:
    """` Did you mean 'x'?` for the closest valid key, also across sections (`rank` -> `lora.lora_rank`)."""
    keys = all_keys()
    leaves = {key.rsplit(".", 1)[-1]: key for key in keys}
    close = difflib.get_close_matches(dotted_key, keys, n=1, cutoff=0.6)
    if not close:
        leaf_match = difflib.get_close_matches(dotted_key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.6)
        close = [leaves[leaf_match[0]]] if leaf_match else []
    return f" Did you mean {close[0]!r}?" if close else ""


def _parse_value(key: str, raw: str) -> Any:
    """String-typed keys keep the raw text (a regex or a run name is never reinterpreted); others are YAML."""
    if _accepts_only_strings(_field_annotation(key)):
        return raw
    try:
        return yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"malformed value for {key!r}: {raw!r} is not valid YAML ({error})") from None


def _accepts_only_strings(annotation: Any) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(choice, str) for choice in typing.get_args(annotation))
    return False


def _format_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("\n...").strip()


def _describe(error: ValidationError) -> str:
    problems = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "config"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "missing":
            problems.append(f"{key}: required key is missing")
        elif item["type"] == "extra_forbidden":
            problems.append(f"{key}: unknown config key")
        else:
            problems.append(f"{key}: {message} (got {item.get('input')!r})" if item["loc"] else message)
    return "invalid trainer config: " + "; ".join(problems)



def parse_or_report(argv: list[str]) -> TrainConfig | None:
    """`TrainConfig.from_args(argv)`, or None after printing the ConfigError on stderr as every entry point reports
    it (the caller then exits with exit_codes.CONFIG)."""
    try:
        return TrainConfig.from_args(argv)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return None
