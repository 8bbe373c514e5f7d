"""Orbax checkpoints of a LoRA run: adapters, optimizer state, data position and metadata.

Layout: `<base_output_directory>/<run_name>/checkpoints/<step>/` with three items

- `lora`: the LoRA parameters, a flat `{NNX path: array}` dict nested on "." with string keys
  (the layout lorajob_trainer.lora documents and export reads);
- `optimizer`: the optax state;
- `data`: `{"positions": int32[accumulation, global_batch]}`, examples consumed per batch row;

and custom metadata (`CheckpointMetadata`: rank, alpha, target modules, base model, step) so
export needs nothing else. Orbax writes a step to a temporary directory and renames it when
complete (on gs://, where renames are not atomic, it marks completion with a commit file), so
`latest_step()` only ever sees complete checkpoints: a process killed mid-write leaves a
temporary directory that is never restored.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from lorajob_trainer import distributed, weights
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.contract.records import DEFAULTS, CheckpointRecord, checkpoints_to_keep

log = logging.getLogger(__name__)

ITEMS = ("lora", "optimizer", "data")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class OutputNotWritable(CheckpointError):
    """The run's output directory cannot be created or written."""


def ensure_writable(directory: str | Path) -> None:
    """Create `directory` and write a file into it, so an output that cannot be written fails before the model loads."""
    path = epath.Path(directory)
    probe = path / f".write-probe-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except Exception as error:
        raise OutputNotWritable(f"cannot write the output directory {directory}: {error}") from error


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    step: int
    lora_rank: int
    lora_alpha: float
    target_modules: list[str] | None
    """Hugging Face projection names, or None when `lora_module_path` chose the layers."""
    lora_module_path: str
    base_model: str
    """The model name (catalog) of the base model."""
    family: str
    load_parameters_path: str
    tokenizer_path: str = ""
    """Where the base's config.json and tokenizer came from (the run's tokenizer_path; a MaxText base
    has no config.json of its own); empty = load_parameters_path."""
    use_rslora: bool = False
    """The adapter's scale is alpha/√r (rsLoRA), not alpha/r."""
    use_dora: bool = False
    """DoRA: the adapter also holds a magnitude per output feature of each adapted weight."""
    base_quantization: str = "none"
    """How the frozen base was held while this adapter trained (QLoRA: contract.BASE_QUANTIZATIONS)."""
    train_loss: float | None = None
    """Training loss at this step."""
    eval_loss: float | None = None
    """Loss on the evaluation split at this step, when it was evaluated."""
    time: float | None = None
    """Unix time of the save."""

    def record(self) -> CheckpointRecord:
        return CheckpointRecord(self.step, self.train_loss, self.eval_loss, self.time)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> CheckpointMetadata:
        """Fields with a default may be absent (checkpoints written before the field existed)."""
        return cls(
            **{
                field.name: values[field.name]
                for field in dataclasses.fields(cls)
                if field.name in values or field.default is dataclasses.MISSING
            }
        )


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    use_zarr3: bool = DEFAULTS.use_zarr3
    use_ocdbt: bool = DEFAULTS.use_ocdbt
    asynchronous: bool = True
    max_to_keep: int = 3
    """The newest checkpoints kept; the best by eval loss is kept as well."""


def _pytree_handler(options: StorageOptions) -> ocp.PyTreeCheckpointHandler:
    return ocp.PyTreeCheckpointHandler(use_ocdbt=options.use_ocdbt, use_zarr3=options.use_zarr3)


class Checkpointer:
    """Saves and restores the trainable state of one run."""

    def __init__(self, directory: Path, options: StorageOptions):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_names=ITEMS,
            item_handlers={item: _pytree_handler(options) for item in ITEMS},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None,  # pruned here, to keep the best one as well (`checkpoints_to_keep`)
                enable_async_checkpointing=options.asynchronous,
                create=True,
            ),
        )
        self._max_to_keep = options.max_to_keep
        self._unfinished_step: int | None = None

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def complete(self) -> list[CheckpointRecord]:
        """The complete checkpoints, oldest first, with the losses their metadata records."""
        steps = sorted(step for step in self._manager.all_steps() if step != self._unfinished_step)
        return [self.metadata(step).record() for step in steps]

    def save(
        self, step: int, lora: dict[str, jax.Array], optimizer: Any, data_positions: jax.Array, metadata: CheckpointMetadata
    ) -> None:
        """Start writing step `step`; `lora` is the flat {NNX path: array} dict.

        A failure of the previous (asynchronous) write is reported with that write's step.
        """
        self.wait()
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    lora=ocp.args.PyTreeSave(weights.nest(lora)),
                    optimizer=ocp.args.PyTreeSave(optimizer),
                    data=ocp.args.PyTreeSave({"positions": data_positions}),
                ),
                custom_metadata=metadata.to_json(),
                force=True,
            )
            self._manager.check_for_errors()
        except Exception as error:
            raise CheckpointError(f"checkpoint write failed at step {step}: {error}") from error
        self._unfinished_step = step

    def restore(
        self, step: int, lora: dict[str, Any], optimizer: Any, data_positions: Any
    ) -> tuple[dict[str, jax.Array], Any, jax.Array]:
        """Restore into the shapes, dtypes and shardings of the given (abstract or concrete) trees."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                lora=_restore_args(weights.nest(lora)),
                optimizer=_restore_args(optimizer),
                data=_restore_args({"positions": data_positions}),
            ),
        )
        return weights.flatten(restored["lora"]), restored["optimizer"], restored["data"]["positions"]

    def metadata(self, step: int) -> CheckpointMetadata:
        return CheckpointMetadata.from_json(self._manager.metadata(step).custom_metadata)

    def check_matches(self, step: int, expected: CheckpointMetadata) -> None:
        """CheckpointError naming the differences when checkpoint `step` was written by a run of another
        model or adapter shape (e.g. a reused run_name), before a restore fails on mismatched arrays."""
        found = self.metadata(step)
        fields = ("base_model", "family", "lora_rank", "target_modules", "lora_module_path")
        differences = [
            f"{name} {getattr(found, name)!r} (this run: {getattr(expected, name)!r})"
            for name in fields if getattr(found, name) != getattr(expected, name)
        ]
        if differences:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} belongs to another run: {', '.join(differences)}; "
                "use another run_name or base_output_directory"
            )

    def wait(self) -> None:
        """Block until the last write is complete; CheckpointError naming its step on failure."""
        step, self._unfinished_step = self._unfinished_step, None
        try:
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        except Exception as error:
            raise CheckpointError(f"checkpoint write failed at step {step}: {error}") from error
        if step is not None and self._manager.latest_step() != step:
            raise CheckpointError(f"checkpoint write failed at step {step}: it did not complete")
        complete = self.complete()
        for stale in {c.step for c in complete} - checkpoints_to_keep(complete, self._max_to_keep):
            self._manager.delete(stale)

    def close(self) -> None:
        self._manager.close()


def complete_checkpoints(root: str | Path) -> list[CheckpointRecord]:
    """The complete checkpoints under a run's checkpoint root (local or gs://), oldest first, with their losses."""
    options = ocp.CheckpointManagerOptions(read_only=True, max_to_keep=None, save_interval_steps=0, create=False)
    handlers = {item: ocp.PyTreeCheckpointHandler() for item in ITEMS}
    try:
        with ocp.CheckpointManager(epath.Path(root), item_handlers=handlers, options=options) as manager:
            return [CheckpointMetadata.from_json(manager.metadata(step).custom_metadata).record()
                    for step in sorted(manager.all_steps())]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"cannot list the checkpoints in {root}: {error}") from error


def _restore_args(target: Any) -> ocp.args.PyTreeRestore:
    abstract = jax.tree.map(_abstract, target)
    return ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))


def _abstract(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)


def for_run(config: TrainConfig) -> Checkpointer | None:
    """The run's checkpointer (None with checkpointing off)."""
    if not config.enable_checkpointing:
        return None
    pathways = distributed.is_pathways()
    if pathways and (config.checkpoint_storage_use_ocdbt or config.checkpoint_storage_use_zarr3):
        log.warning("Pathways: writing checkpoints without OCDBT/zarr3 (its array handler cannot read them)")
    options = StorageOptions(
        use_zarr3=config.checkpoint_storage_use_zarr3 and not pathways,
        use_ocdbt=config.checkpoint_storage_use_ocdbt and not pathways,
        asynchronous=config.async_checkpointing,
        max_to_keep=config.max_num_checkpoints_to_keep,
    )
    return Checkpointer(config.checkpoint_directory, options)
