"""What the operator and the trainer agree on of a run: shared defaults and bounds, the run directory layout, the
dataset column layouts, the records the steps print (progress, data, plan, evaluation: their JSON and the stdout
lines that carry them) and how a duration is written.

Standard library only. The exit codes (`exit_codes`), the config (`config`) and the environment (`environment`)
are the other parts of the contract.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Literal, get_args


@dataclass(frozen=True)
class Defaults:
    """The defaults a LoRAJob and `python -m lorajob_trainer.train` share, so the same settings give the same run."""

    learning_rate: float = 2e-4
    """LoRA trains a few adapter weights from zero, so it wants about ten times a full fine-tune's rate;
    2e-4 is the rate of the QLoRA paper and of PEFT's examples."""
    warmup_steps_fraction: float = 0.1
    """The first tenth of the steps warms the learning rate up from zero."""
    per_device_batch_size: int = 1
    """One sequence per device: the memory-safe start; packing fills it."""
    gradient_accumulation_steps: int = 1
    max_target_length: int = 2048
    """Long enough for most chat turns of today's instruction data; longer examples are truncated."""
    checkpoint_period: int = 100
    """A LoRA checkpoint is small (adapter and optimizer state), and a preempted step saves on SIGTERM, so a
    short period costs little and bounds the work a crash loses."""
    lora_rank: int = 16
    lora_alpha: float = 32.0
    """Twice the rank: the scale alpha/rank = 2 most LoRA recipes use."""
    remat_policy: str = "auto"
    """The policy of `REMAT_POLICIES` with the least recompute whose step fits the chips, chosen by the compiler:
    by the fit check before a TPU is held (recorded in `RunLayout.plan` and status.plan), else by the train step on
    its own devices."""
    train_split: str = "train"
    use_zarr3: bool = False
    """Off: Pathways cannot restore Zarr v3 base checkpoints efficiently."""
    use_ocdbt: bool = False
    """Off: Pathways' array handler cannot read OCDBT, so the head pod would load the whole checkpoint."""


DEFAULTS = Defaults()


@dataclass(frozen=True)
class Bounds:
    """Bounds a LoRAJob's schema and the trainer's config share, so that what one accepts the other does."""

    max_target_length: tuple[int, int] = (16, 1_048_576)
    """Inclusive."""
    lora_rank: tuple[int, int] = (1, 1024)
    """Inclusive."""
    warmup_steps_fraction_below: float = 1.0
    """From 0 up to, not including, this: a warmup over every step never reaches the peak rate."""


BOUNDS = Bounds()

RematPolicy = Literal["none", "minimal", "attention", "full"]
"""What the backward pass recomputes per decoder layer, least recompute (and most memory) first."""
REMAT_POLICIES: tuple[RematPolicy, ...] = get_args(RematPolicy)
REMAT_AUTO = "auto"
RematSetting = Literal["auto", RematPolicy]
"""A remat policy, or `auto`: the first of `REMAT_POLICIES` whose step fits."""

BASE_QUANTIZATIONS = ("none", "int8", "int4", "nf4", "fp8")
"""How the frozen base is held while the adapters train (QLoRA): as loaded (none), or each decoder projection and
routed expert quantised per output channel (int8, int4, nf4: 4-bit NormalFloat, fp8: float8 e4m3), as Qwix does."""
DORA_NEEDS_FULL_PRECISION = (
    "lora.dora needs the base weights in full precision (it takes their norms at every step): set "
    "baseQuantization to none, or train without DoRA"
)

COLUMN_LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("messages",),
    ("prompt", "completion"),
    ("question", "answer"),
)
"""The dataset column layouts the trainer understands (the same three MaxText accepts); the first is the default."""

TRAINING_METHODS = ("sft", "dpo", "orpo")
"""What the adapters are trained to do: sft (supervised fine-tuning: the answers' next-token loss), dpo (Direct
Preference Optimization against the model as training starts) or orpo (Odds Ratio Preference Optimization: the
chosen answers' loss plus an odds-ratio term, no reference)."""
PREFERENCE_METHODS = ("dpo", "orpo")
"""The methods that train on preference pairs (a prompt, a chosen and a rejected answer)."""
DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")
"""DPO's loss on the pair's log-ratio margin, as TRL's DPOTrainer computes it: sigmoid (the DPO paper), ipo (IPO,
on the answers' per-token mean log-ratios) or robust (Robust DPO: labelSmoothing is the share of flipped labels)."""
PREFERENCE_COLUMN_LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("prompt", "chosen", "rejected"),
    ("chosen", "rejected"),
)
"""The preference dataset layouts: a prompt and two answers (each a string or a list of {role, content} messages),
or two whole conversations (message lists) that share every turn but the last, which is the answer."""
METHOD_NEEDS_MATCHING_LAYOUT = (
    "a preference method (dpo, orpo) reads dataset.columns " + " or ".join(str(list(layout)) for layout in
    PREFERENCE_COLUMN_LAYOUTS) + "; sft reads " + ", ".join(str(list(layout)) for layout in COLUMN_LAYOUTS)
)


@dataclass(frozen=True)
class PreferenceDefaults:
    """The preference settings a LoRAJob and the trainer share by default (TRL's defaults)."""

    beta: float = 0.1
    """DPO's beta: how far the trained model may move from the reference (higher: less)."""
    orpo_lambda: float = 0.1
    """ORPO's lambda, the odds-ratio term's weight (TRL's ORPOConfig.beta)."""
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0


PREFERENCE_DEFAULTS = PreferenceDefaults()


def join(base: str, *parts: str) -> str:
    """`base/part/...` for local paths and gs:// URIs alike (pathlib would fold gs:// to gs:/)."""
    return "/".join([base.rstrip("/"), *parts])


COMPILATION_CACHE_DIRECTORY = "_compilation-cache"
"""The default of a LoRAJob's output.compilationCache, under its base output directory beside the runs (no run name
has an underscore)."""


@dataclass(frozen=True)
class RunLayout:
    """Where a run writes: everything under `<base_output_directory>/<run_name>/`."""

    base_output_directory: str
    run_name: str

    @property
    def run_directory(self) -> str:
        return join(self.base_output_directory, self.run_name)

    @property
    def checkpoints(self) -> str:
        """The trainer's Orbax checkpoints, one directory per saved step."""
        return join(self.run_directory, "checkpoints")

    def checkpoint(self, step: int) -> str:
        return join(self.checkpoints, str(step))

    @property
    def converted_base(self) -> str:
        """Where convert writes the base weights from a Hugging Face checkpoint."""
        return join(self.run_directory, "base")

    @property
    def converted_adapter(self) -> str:
        """Where convert writes a Hugging Face adapter to start from."""
        return join(self.run_directory, "restore-adapter")

    @property
    def adapter_export(self) -> str:
        """Where export writes the trained adapter in PEFT format, unless the LoRAJob names a path."""
        return join(self.run_directory, "huggingface")

    @property
    def metrics(self) -> str:
        """One JSON line of metrics per logged step."""
        return join(self.run_directory, "metrics.jsonl")

    @property
    def progress(self) -> str:
        """The latest progress record, replaced atomically."""
        return join(self.run_directory, "progress.json")

    @property
    def evaluation(self) -> str:
        """The evaluation of base and adapter (`EvalRecord.to_json`), which the export step's gate reads."""
        return join(self.run_directory, "evaluation.json")

    @property
    def evaluation_samples(self) -> str:
        """Every evaluated example with the base's and the adapter's answers, one JSON line each."""
        return join(self.run_directory, "evaluation-samples.jsonl")

    @property
    def plan(self) -> str:
        """The fit check's record (`PlanRecord` as JSON): a train step with remat auto runs the policy it chose."""
        return join(self.run_directory, "plan.json")

    @property
    def tensorboard(self) -> str:
        return join(self.run_directory, "tensorboard")

    @property
    def tracking(self) -> str:
        """The experiment trackers' runs (`TrackingRecord` as JSON), kept beside the checkpoints: a resumed or retried
        run, and the export step, append to the same tracker runs."""
        return join(self.run_directory, "tracking.json")

    @property
    def pathways_scratch(self) -> str:
        """Pathways' scratch space on the run's storage."""
        return join(self.run_directory, "pathways-scratch")


STOPPED_EARLY = "stopped_early"
"""The progress state of a run that ended before its last step because the eval loss stopped improving."""
FINISHED_STATES = ("succeeded", STOPPED_EARLY)
COMPILING = "compiling"
"""The progress state from the train step's start until its first step has run (the step compiles meanwhile)."""
EVALUATING = "evaluating"
"""The progress state while the train step evaluates base and adapter after its last step (not finished yet)."""

PROGRESS_LINE_PREFIX = "LORAJOB_PROGRESS "
"""Starts the stdout line that repeats each progress record as compact JSON: the operator reads it from the
lead pod's log (it cannot read the run directory, usually on gs://)."""


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite_or_none(value) -> float | None:
    return float(value) if _finite(value) else None


def _json_after(prefix: str, line: str) -> dict | None:
    """The JSON object that follows `prefix` in `line` (None: no prefix, or not a whole JSON object)."""
    _, found, payload = line.partition(prefix)
    if not found:
        return None
    try:
        values = json.loads(payload)
    except ValueError:
        return None
    return values if isinstance(values, dict) else None


TRACKERS = ("mlflow", "wandb")
"""The experiment trackers a run can report to (spec.tracking; lorajob_trainer.tracking)."""


@dataclass(frozen=True)
class TrackedRun:
    """One tracker's run: its id (resumed by later processes) and the address a person opens."""

    run_id: str
    url: str = ""
    logged_step: int = 0
    """The highest step whose metrics the tracker has taken, as kept now and then while the run goes and at its end:
    a resumed run sends none at or below it (where the tracker cannot say so itself, as an offline W&B run)."""


@dataclass(frozen=True)
class TrackingRecord:
    """The tracker runs of one LoRAJob run, by tracker name (`TRACKERS`), and its lineage."""

    runs: dict[str, TrackedRun]
    lineage: dict[str, str] = field(default_factory=dict)
    """What the run trained on (base model, dataset, the dataset's fingerprint), which the export step records with
    the adapter it appends to the runs."""

    def to_json(self) -> str:
        return json.dumps({**{name: asdict(run) for name, run in self.runs.items()}, LINEAGE_KEY: self.lineage},
                          indent=1)

    @classmethod
    def from_json(cls, text: str) -> TrackingRecord:
        values = json.loads(text)
        return cls({name: TrackedRun(**run) for name, run in values.items() if name in TRACKERS},
                   {str(key): str(value) for key, value in values.get(LINEAGE_KEY, {}).items()})


LINEAGE_KEY = "lineage"


PREFERENCE_PROGRESS = ("reward_accuracy", "reward_margin", "chosen_logps", "rejected_logps",
                       "eval_preference_accuracy")
"""The progress record's figures of a preference method."""


@dataclass(frozen=True)
class CheckpointRecord:
    """A complete checkpoint the run keeps."""

    step: int
    train_loss: float | None = None
    eval_loss: float | None = None
    """Loss on the evaluation split at this step, when it was evaluated."""
    time: float | None = None
    """Unix time of the save."""

    @classmethod
    def from_json(cls, values) -> CheckpointRecord | None:
        if not isinstance(values, dict) or not _count(values.get("step")):
            return None
        numbers = {name: values.get(name) for name in ("train_loss", "eval_loss", "time")}
        if any(value is not None and not _finite(value) for value in numbers.values()):
            return None
        return cls(step=values["step"], **numbers)


CHECKPOINT_SELECTORS = ("latest", "best")
"""What export may take besides a step number: the newest checkpoint, or the one with the lowest eval loss."""


class NoSuchCheckpoint(LookupError):
    """The checkpoint asked for is not among the run's complete checkpoints."""


def choose_checkpoint(selector: str, checkpoints: list[CheckpointRecord]) -> CheckpointRecord:
    """The checkpoint `selector` (latest, best or a step number) names among `checkpoints`."""
    if not checkpoints:
        raise NoSuchCheckpoint("the run has no complete checkpoint")
    kept = ", ".join(str(c.step) for c in sorted(checkpoints, key=lambda c: c.step))
    if selector == "latest":
        return max(checkpoints, key=lambda c: c.step)
    if selector == "best":
        evaluated = [c for c in checkpoints if c.eval_loss is not None]
        if not evaluated:
            raise NoSuchCheckpoint(f"no checkpoint has an eval loss (kept: {kept}); set dataset.evalSplit "
                                   "and an evalInterval that divides the checkpointPeriod")
        return min(evaluated, key=lambda c: (c.eval_loss, -c.step))
    if not selector.isdigit():
        raise ValueError(f"checkpoint {selector!r}: expected latest, best or a step number")
    for checkpoint in checkpoints:
        if checkpoint.step == int(selector):
            return checkpoint
    raise NoSuchCheckpoint(f"no complete checkpoint at step {selector} (kept: {kept})")


def checkpoints_to_keep(checkpoints: list[CheckpointRecord], newest: int) -> set[int]:
    """The steps a run keeps: the `newest` latest and the best by eval loss (export may ask for either)."""
    keep = {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-newest:]}
    if any(c.eval_loss is not None for c in checkpoints):
        keep.add(choose_checkpoint("best", checkpoints).step)
    return keep


@dataclass(frozen=True)
class ProgressRecord:
    """One progress update of a training run."""

    step: int
    total_steps: int | None
    loss: float | None = None
    tokens_per_second: float | None = None
    eta_seconds: float | None = None
    state: str | None = "running"
    """compiling, running, evaluating, succeeded, stopped_early, preempted or failed."""
    message: str = ""
    eval_loss: float | None = None
    """The latest eval loss, measured at `eval_step`."""
    eval_step: int | None = None
    checkpoints: tuple[CheckpointRecord, ...] | None = None
    """The complete checkpoints the run keeps, oldest first; None: unchanged since the last record."""
    expert_rows_dropped: int | None = None
    """(token, expert) rows the experts' all-to-alls dropped past their capacity since the train step started
    (expert parallelism: models/experts.py); None where no step dispatched tokens."""
    reward_accuracy: float | None = None
    """Preference methods: the share of the step's pairs whose chosen answer earned the higher reward."""
    reward_margin: float | None = None
    """Preference methods: the mean of chosen minus rejected reward over the step's pairs."""
    chosen_logps: float | None = None
    """Preference methods: the mean log-probability of the chosen answers (DPO: summed over each answer's tokens;
    ORPO: its per-token mean)."""
    rejected_logps: float | None = None
    """Preference methods: the same for the rejected answers."""
    eval_preference_accuracy: float | None = None
    """Preference methods: the share of the eval split's pairs the adapter ranks right (its chosen answer more
    likely than the rejected, relative to the reference for DPO), measured at `eval_step`."""
    tracking_urls: dict[str, str] | None = None
    """Each experiment tracker's run address by tracker name (`TRACKERS`); None where the run reports to none."""
    tracking_problem: str | None = None
    """Where the run reports to trackers: "" while every tracker takes what it is sent; otherwise which one fails
    and how (the metrics wait in a bounded queue; training goes on)."""
    updated: float | None = None
    """Unix time of the update."""

    def __post_init__(self):
        for name in ("loss", "tokens_per_second", "eta_seconds", "eval_loss", *PREFERENCE_PROGRESS):  # NaN, inf: unknown
            object.__setattr__(self, name, _finite_or_none(getattr(self, name)))
        if self.checkpoints is not None:
            object.__setattr__(self, "checkpoints", tuple(self.checkpoints))

    def to_json(self) -> str:
        values = {name: value for name, value in asdict(self).items() if value is not None or name == "total_steps"}
        return json.dumps(values, separators=(",", ":"))

    def line(self) -> str:
        return PROGRESS_LINE_PREFIX + self.to_json()

    @classmethod
    def from_line(cls, line: str) -> ProgressRecord | None:
        """The record of one progress line; None for any other line, or one cut short or garbled."""
        values = _json_after(PROGRESS_LINE_PREFIX, line)
        if values is None:
            return None
        step, total = values.get("step"), values.get("total_steps")
        if not _count(step) or not (total is None or (_count(total) and total > 0)):
            return None
        numbers = {name: values.get(name)
                   for name in ("loss", "tokens_per_second", "eta_seconds", "eval_loss", *PREFERENCE_PROGRESS)}
        if any(value is not None and not _finite(value) for value in numbers.values()):
            return None
        state, message, updated = values.get("state"), values.get("message", ""), values.get("updated")
        if not isinstance(state, (str, type(None))) or not isinstance(message, str):
            return None
        eval_step, checkpoints = values.get("eval_step"), values.get("checkpoints")
        if eval_step is not None and not _count(eval_step):
            return None
        dropped = values.get("expert_rows_dropped")
        if dropped is not None and not _count(dropped):
            return None
        if checkpoints is not None:
            records = [CheckpointRecord.from_json(c) for c in checkpoints] if isinstance(checkpoints, list) else [None]
            if None in records:
                return None
            checkpoints = tuple(records)
        urls, problem = values.get("tracking_urls"), values.get("tracking_problem")
        if urls is not None and not (isinstance(urls, dict) and all(
                name in TRACKERS and isinstance(url, str) for name, url in urls.items())):
            return None
        if not isinstance(problem, (str, type(None))):
            return None
        return cls(step=step, total_steps=total, state=state, message=message, eval_step=eval_step,
                   checkpoints=checkpoints, expert_rows_dropped=dropped, tracking_urls=urls, tracking_problem=problem,
                   updated=updated if _finite(updated) else None, **numbers)


def last_progress(log: str) -> ProgressRecord | None:
    """The last readable progress record in a log tail (None when it holds none)."""
    return _last_record(log, ProgressRecord.from_line)


def _last_record(log: str, from_line):
    for line in reversed(log.splitlines()):
        record = from_line(line)
        if record is not None:
            return record
    return None


DATA_LINE_PREFIX = "LORAJOB_DATA "
"""Starts the data check's one machine-readable line (`DataRecord.line`), which the operator lifts into status.data."""


@dataclass(frozen=True)
class DataRecord:
    """The data check's figures (lorajob_trainer.datacheck)."""

    examples: int
    tokens: int
    """Tokens of every example, the chat template rendered."""
    trained_tokens: int
    """Tokens the loss is computed on (the answers), before truncation."""
    epochs: float
    """Passes over the data that steps x the global batch amounts to."""
    truncated_examples: int
    """Examples longer than max_target_length."""
    truncated_share: float
    """Share (0 to 1) of the trained tokens max_target_length cuts off."""

    def line(self) -> str:
        return DATA_LINE_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> DataRecord | None:
        """The record of one data line; None for any other line, or one cut short or garbled."""
        values = _json_after(DATA_LINE_PREFIX, line)
        if values is None:
            return None
        counts = {name: values.get(name) for name in ("examples", "tokens", "trained_tokens", "truncated_examples")}
        shares = {name: values.get(name) for name in ("epochs", "truncated_share")}
        if not all(_count(value) for value in counts.values()) or not all(_finite(v) and v >= 0 for v in shares.values()):
            return None
        return cls(**counts, **shares)


def last_data(log: str) -> DataRecord | None:
    """The last readable data record in a log (None when it holds none)."""
    return _last_record(log, DataRecord.from_line)


PLAN_LINE_PREFIX = "LORAJOB_PLAN "
"""Starts the fit check's one machine-readable line (`PlanRecord.line`), which the operator lifts into status.plan."""


@dataclass(frozen=True)
class PlanRecord:
    """The fit check's figures for the LoRAJob's own target (lorajob_trainer.fit), per chip."""

    fits: bool
    target: str
    """Machine type, topology, chips and batch the step was compiled for."""
    chips: int
    hbm_bytes_per_chip: int | None
    """What the TPU compiler assigns (arguments, outputs, temporaries); None when it refused the step."""
    capacity_bytes: int
    """The chip's HBM less the plan's safety margin."""
    step_seconds: float | None = None
    tokens_per_second_per_chip: float | None = None
    mfu: float | None = None
    """The roofline's MFU ceiling (0 to 1)."""
    bound: str | None = None
    """What bounds the roofline's step time: compute, HBM bandwidth or ICI collectives (NVLink all-gathers for a GPU)."""
    compile_seconds: float | None = None
    suggestion: str | None = None
    """When it does not fit: the smallest change that fits, compiled."""
    remat_policy: str | None = None
    """The remat policy the step was compiled with: the LoRAJob's, or what remat auto chose."""

    def line(self) -> str:
        return PLAN_LINE_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> PlanRecord | None:
        """The record of one plan line; None for any other line, or one cut short or garbled."""
        values = _json_after(PLAN_LINE_PREFIX, line)
        if values is None or not isinstance(values.get("fits"), bool) or not isinstance(values.get("target"), str):
            return None
        if not _count(values.get("capacity_bytes")) or not _count(values.get("chips")) or not (values.get("hbm_bytes_per_chip") is None
                                                             or _count(values["hbm_bytes_per_chip"])):
            return None
        numbers = {name: _finite_or_none(values.get(name))
                   for name in ("step_seconds", "tokens_per_second_per_chip", "mfu", "compile_seconds")}
        texts = {name: values.get(name) if isinstance(values.get(name), str) else None
                 for name in ("bound", "suggestion", "remat_policy")}
        return cls(fits=values["fits"], target=values["target"], chips=values["chips"], hbm_bytes_per_chip=values.get("hbm_bytes_per_chip"),
                   capacity_bytes=values["capacity_bytes"], **numbers, **texts)


def last_plan(log: str) -> PlanRecord | None:
    """The last readable plan record in a log (None when it holds none)."""
    return _last_record(log, PlanRecord.from_line)


EVAL_SCORERS = ("exact_match", "contains", "regex", "gsm8k")
"""How an answer is scored against the reference (lorajob_trainer.evaluate): equal after normalisation, the
reference within the answer, the answer a regex extracts from both equal, or GSM8K's `#### <number>` as that regex."""
EVAL_LINE_PREFIX = "LORAJOB_EVAL "
"""Starts the evaluation's one machine-readable line (`EvalRecord.line`), which the operator lifts into status.evaluation."""
EVAL_SAMPLE_CHARACTERS = 300
"""A sample's prompt and answers are cut to this many characters in the record (the samples file keeps them whole)."""


@dataclass(frozen=True)
class ModelScore:
    """One model's results on the evaluated examples."""

    score: float
    """Share (0 to 1) of the examples the scorer counts as right."""
    stop_rate: float
    """Share of the generations that ended with an end-of-turn or EOS token before max_new_tokens."""
    mean_length: float
    """Mean generated tokens per example."""
    preference_accuracy: float | None = None
    """Preference methods: the share (0 to 1) of the evaluation split's pairs whose chosen answer the model finds
    likelier than the rejected one, per token (the answers' mean log-probabilities: a sum would favour the shorter)."""


@dataclass(frozen=True)
class EvalSample:
    prompt: str
    reference: str
    base: str
    adapter: str


@dataclass(frozen=True)
class EvalRecord:
    """Base model against the trained adapter, greedy generations on the same prompts (lorajob_trainer.evaluate)."""

    scorer: str
    examples: int
    step: int
    """The training step whose adapter was evaluated."""
    max_new_tokens: int
    seconds: float
    """Wall time of both models' generations and the scoring."""
    base: ModelScore
    adapter: ModelScore
    samples: tuple[EvalSample, ...] = ()

    def to_json(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return EVAL_LINE_PREFIX + json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, values: object) -> EvalRecord | None:
        """The record of a JSON object; None for one that is not a whole, well-formed record."""
        if not isinstance(values, dict) or values.get("scorer") not in EVAL_SCORERS:
            return None
        if not all(_count(values.get(name)) for name in ("examples", "step", "max_new_tokens")) or not _finite(values.get("seconds")):
            return None
        scores = [_model_score(values.get(name)) for name in ("base", "adapter")]
        samples = values.get("samples", [])
        if None in scores or not isinstance(samples, (list, tuple)):
            return None
        fields = ("prompt", "reference", "base", "adapter")
        if not all(isinstance(s, dict) and all(isinstance(s.get(f), str) for f in fields) for s in samples):
            return None
        return cls(scorer=values["scorer"], examples=values["examples"], step=values["step"],
                   max_new_tokens=values["max_new_tokens"], seconds=values["seconds"], base=scores[0], adapter=scores[1],
                   samples=tuple(EvalSample(**{f: s[f] for f in fields}) for s in samples))

    @classmethod
    def from_line(cls, line: str) -> EvalRecord | None:
        values = _json_after(EVAL_LINE_PREFIX, line)
        return None if values is None else cls.from_json(values)


def _model_score(values: object) -> ModelScore | None:
    if not isinstance(values, dict):
        return None
    numbers = [values.get(name) for name in ("score", "stop_rate", "mean_length")]
    if not all(_finite(number) and number >= 0 for number in numbers) or numbers[0] > 1 or numbers[1] > 1:
        return None
    accuracy = values.get("preference_accuracy")
    if accuracy is not None and not (_finite(accuracy) and 0 <= accuracy <= 1):
        return None
    return ModelScore(*numbers, preference_accuracy=accuracy)


def last_evaluation(log: str) -> EvalRecord | None:
    """The last readable evaluation record in a log (None when it holds none)."""
    return _last_record(log, EvalRecord.from_line)


@dataclass(frozen=True)
class ExportGate:
    """What the evaluation must show for the export step to run (LoRAJob spec.export)."""

    require_improvement: bool = False
    """The adapter's score must be above the base's; a preference method's: its preference accuracy."""
    minimum_score: float | None = None
    minimum_stop_rate: float | None = None

    @property
    def active(self) -> bool:
        return self.require_improvement or self.minimum_score is not None or self.minimum_stop_rate is not None

    def refusal(self, record: EvalRecord) -> str | None:
        """Why the adapter of `record` must not be exported (both models' figures in it); None: export it."""
        base, adapter = record.base, record.adapter
        reasons = []
        ranked = base.preference_accuracy is not None and adapter.preference_accuracy is not None
        if self.require_improvement and ranked and adapter.preference_accuracy <= base.preference_accuracy:
            reasons.append(f"its preference accuracy ({_percent(adapter.preference_accuracy)}) is not above the "
                           f"base model's ({_percent(base.preference_accuracy)})")
        elif self.require_improvement and not ranked and adapter.score <= base.score:
            reasons.append("it does not score above the base model")
        if self.minimum_score is not None and adapter.score < self.minimum_score:
            reasons.append(f"its score is below export.minimumScore={self.minimum_score:g}")
        if self.minimum_stop_rate is not None and adapter.stop_rate < self.minimum_stop_rate:
            reasons.append(f"its stop rate is below export.minimumStopRate={self.minimum_stop_rate:g}")
        if not reasons:
            return None
        return (f"the adapter of step {record.step} is not exported: {' and '.join(reasons)} "
                f"({record.scorer} on {record.examples} examples: adapter {_percent(adapter.score)}, base "
                f"{_percent(base.score)}; stop rate adapter {_percent(adapter.stop_rate)}, base {_percent(base.stop_rate)})")


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def duration(seconds: float) -> str:
    """A duration as the trainer's log lines and the operator's run view write it: 1h02m03s, 4m05s, 6s."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
