"""LoRA fine-tuning entry point: `python -m lorajob_trainer.train [config.yaml] key=value...`.

One optimizer step is one jitted call: it scans over the gradient-accumulation micro-batches,
differentiates only the LoRA parameters (the frozen base weights are a plain input, so no
weight-gradient GEMMs are built for them), normalises by the number of trained tokens of the
whole step, clips and applies AdamW. The run resumes from the latest complete checkpoint in
`<base_output_directory>/<run_name>/checkpoints`, including the data position.

Exit status: the codes of `lorajob_trainer.exit_codes` (0 when all steps ran), each non-zero one
with a line on stderr naming what failed and at which step. On SIGTERM the run finishes the step
it is in, saves a checkpoint at that step and exits `exit_codes.PREEMPTED`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lorajob_trainer import checkpoint as ckpt
from lorajob_trainer import data as data_lib
from lorajob_trainer import distributed, exit_codes, preemption
from lorajob_trainer import evaluate as evaluate_lib
from lorajob_trainer import generate as generate_lib
from lorajob_trainer import lora as lora_lib
from lorajob_trainer import loss as loss_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import metrics as metrics_lib
from lorajob_trainer import remat as remat_lib
from lorajob_trainer import models, weights
from lorajob_trainer.models import decoder, experts
from lorajob_trainer.config import TrainConfig, describe_keys, parse_or_report, resolve_target_modules
from lorajob_trainer.console import ConsoleProgress, configure_logging
from lorajob_trainer.contract import EVALUATING, STOPPED_EARLY, CheckpointRecord
from lorajob_trainer.optim import build_optimizer, learning_rate_per_step

log = logging.getLogger("lorajob_trainer.train")

Batch = dict[str, jax.Array]

PREFETCH_BATCHES = 2
"""Training batches prepared ahead of the device step (evaluation reads synchronously)."""


class TrainingFailed(RuntimeError):
    """The run cannot complete its requested steps; the message names what and the step."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------- model


@dataclass
class LoraModel:
    """A base model with LoRA adapters applied, its arrays placed on the mesh."""

    model: nnx.Module
    target_modules: list[str] | None
    attention_width: int
    """Sum over layers of query heads * head_dim (for the FLOPs model)."""
    active: dict[str, float] = field(default_factory=dict)
    """Routed experts' module paths (with a trailing ".") -> share a token uses (for the FLOPs model)."""
    aux_loss_coef: float | None = None
    """Weight of the MoE load-balancing loss in the training loss; None: the model has none."""
    layer_period: int | None = None
    """The family's layer period (Family.layer_period): the step scans over its repeats; None: unrolled."""


def compute_dtype(config: TrainConfig, platform: str | None = None) -> jnp.dtype:
    """The dtype of the base weights and activations; "auto": float32 on CPU, else bfloat16. `platform`: the
    devices the step is for (default: JAX's default backend)."""
    if config.dtype == "auto":
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    return jnp.dtype(config.dtype)


def load_lora_model(config: TrainConfig, mesh: Mesh, dtype: jnp.dtype) -> LoraModel:
    """Load the base weights (sharded over `mesh`) and apply the configured LoRA adapters.

    A MaxText base takes its config.json from the tokenizer directory (see models.load_model)."""
    model, spec = models.load_model(
        config.model_name, config.load_parameters_path, mesh=mesh, dtype=dtype, config_dir=config.tokenizer_directory
    )
    family = spec.family.name
    targets = resolve_target_modules(config, lora_lib.default_targets(family))
    regex = lora_lib.target_regex(family, targets, config.lora.lora_module_path)
    if targets is None:
        targets = lora_lib.names_for_regex(family, regex, spec.tunix_config.num_layers) or None
    model = lora_lib.apply_lora(
        model, rank=config.lora.lora_rank, alpha=config.lora.lora_alpha, target_regex=regex, mesh=mesh,
        rngs=nnx.Rngs(config.seed), rslora=config.lora.use_rslora, dora=config.lora.use_dora,
        base_quantization=config.lora.base_quantization,
    )
    return LoraModel(
        model, targets, attention_width(spec.tunix_config), experts.active_shares(model),
        aux_loss_coef(config.router_aux_loss_coef, spec.hf_config, model),
        spec.family.layer_period(spec.tunix_config),
    )


def aux_loss_coef(override: float | None, hf_config: dict[str, Any], model: nnx.Module) -> float | None:
    """`override` (config key router_aux_loss_coef), else the checkpoint's (experts.aux_loss_coef); None for a
    model without load-balanced MoE blocks."""
    if not any(isinstance(module, experts.LoadBalanced) for _, module in nnx.iter_graph(model)):
        return None
    return experts.aux_loss_coef(hf_config) if override is None else override


def attention_width(tunix_config: Any) -> int:
    """Sum over layers of query heads * head_dim, from a Tunix ModelConfig."""
    return tunix_config.num_layers * tunix_config.num_heads * tunix_config.head_dim


class LoraLayout:
    """Converts between the trainer's flat `{NNX path: array}` adapters, keyed per layer as checkpoints hold
    them (`layers.3.attn.q_proj.w_lora_a`), and the NNX state the model merges, whose layers may be stacked
    for the scan (models/decoder.py: `stacking`)."""

    def __init__(self, state: nnx.State, stacking: decoder.Stacking | None = None):
        self._template = list(nnx.to_flat_state(state))
        self._stacking = stacking

    @property
    def stacking(self) -> decoder.Stacking | None:
        return self._stacking

    def _keys(self, path: tuple) -> list[str]:
        paths = self._stacking.layer_paths(path) if self._stacking else [path]
        return [weights.path_key(layer_path) for layer_path in paths]

    def _stacked(self, path: tuple) -> bool:
        return self._stacking is not None and self._stacking.is_stacked(path)

    def flat(self, state: nnx.State) -> dict[str, jax.Array]:
        flat = {}
        for path, variable in nnx.to_flat_state(state):
            value = variable.get_value()
            rows = decoder.unstacked_rows(value) if self._stacked(path) else [value]
            flat.update(zip(self._keys(path), rows, strict=True))
        return flat

    def state(self, flat: dict[str, jax.Array]) -> nnx.State:
        def value(path: tuple) -> jax.Array:
            rows = [flat[key] for key in self._keys(path)]
            return jnp.stack(rows) if self._stacked(path) else rows[0]

        return nnx.from_flat_state([(path, variable.replace(value(path))) for path, variable in self._template])


def split_for_step(model: nnx.Module, layer_period: int | None) -> tuple[nnx.GraphDef, LoraLayout, nnx.State, nnx.State]:
    """(graphdef, LoraLayout, LoRA state, base state) of the model as the step runs it: its layers stacked for
    the scan when `layer_period` is given (in place: `model` is changed; models/decoder.py)."""
    stacking = decoder.stack_layers(model, layer_period) if layer_period else None
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    return graphdef, LoraLayout(lora, stacking), lora, base


# ---------------------------------------------------------------- loss and steps


@dataclass
class StepFunctions:
    train: Callable[..., Any]
    evaluate: Callable[..., Any]
    traces: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})


def build_step_functions(
    graphdef: nnx.GraphDef,
    layout: LoraLayout,
    optimizer: optax.GradientTransformation,
    dtype: jnp.dtype,
    shardings: dict[str, Any],
    loss_chunk_length: int,
    remat_policy: remat_lib.RematPolicy,
    aux_loss_coef: float | None = None,
) -> StepFunctions:
    """Jitted train and eval steps with fixed in/out shardings, so each compiles once.

    `aux_loss_coef` (LoraModel.aux_loss_coef): the step minimises LM loss + coef * load-balancing loss,
    the latter the mean over micro-batches of each one's (as transformers computes it per forward), and
    reports it as `aux_loss`; None: the model has none."""
    traces = {"train": 0, "eval": 0}

    def losses(lora, base, micro_batch, aux_weight=0.0):
        """(objective: weighted NLL sum + aux_weight * load-balancing loss, (NLL sum, weight sum, that loss))."""
        adapters = layout.state({name: value.astype(dtype) for name, value in lora.items()})
        model = nnx.merge(graphdef, adapters, base)
        loss_sum, weight_sum, aux = loss_lib.losses_with_load_balancing(model, micro_batch, loss_chunk_length, remat_policy)
        trained_aux = aux if aux_loss_coef else jax.lax.stop_gradient(aux)
        return loss_sum + aux_weight * trained_aux, (loss_sum, weight_sum, aux)

    grad_fn = jax.value_and_grad(losses, has_aux=True)

    def train_step(lora, opt_state, base, batch):
        traces["train"] += 1
        accumulation = batch["weights"].shape[0]
        weight_sum = jnp.sum(batch["weights"])
        scale = 1.0 / jnp.maximum(weight_sum, 1.0)
        # Gradients are summed, then scaled by `scale`: this weight makes the aux term's coef / accumulation.
        aux_weight = (aux_loss_coef or 0.0) / (accumulation * scale)

        def accumulate(carry, micro_batch):
            grads, loss_sum, aux_sum = carry
            (_, (micro_loss, _, micro_aux)), micro_grads = grad_fn(lora, base, micro_batch, aux_weight)
            return (jax.tree.map(jnp.add, grads, micro_grads), loss_sum + micro_loss, aux_sum + micro_aux), None

        zeros = jax.tree.map(jnp.zeros_like, lora)
        (grads, loss_sum, aux_sum), _ = jax.lax.scan(accumulate, (zeros, 0.0, 0.0), batch)
        grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = optimizer.update(grads, opt_state, lora)
        step_metrics = {
            "loss": loss_sum * scale,
            "trained_tokens": weight_sum,
            "real_tokens": jnp.sum(batch["segment_ids"] != 0),
            "grad_norm": optax.global_norm(grads),
        }
        if aux_loss_coef is not None:
            step_metrics["aux_loss"] = aux_sum / accumulation
        return optax.apply_updates(lora, updates), opt_state, step_metrics

    def eval_step(lora, base, batch):
        traces["eval"] += 1

        def accumulate(carry, micro_batch):
            _, (loss_sum, weight_sum, _) = losses(lora, base, micro_batch)
            return (carry[0] + loss_sum, carry[1] + weight_sum), None

        (loss_sum, weight_sum), _ = jax.lax.scan(accumulate, (0.0, 0.0), batch)
        return {"loss_sum": loss_sum, "weight_sum": weight_sum}

    replicated = shardings["replicated"]
    train = jax.jit(
        train_step,
        in_shardings=(shardings["lora"], shardings["optimizer"], shardings["base"], shardings["batch"]),
        out_shardings=(shardings["lora"], shardings["optimizer"], replicated),
        donate_argnums=(0, 1),
    )
    evaluate = jax.jit(
        eval_step,
        in_shardings=(shardings["lora"], shardings["base"], shardings["batch"]),
        out_shardings=replicated,
    )
    return StepFunctions(train, evaluate, traces)


def optimizer_state_shardings(optimizer: optax.GradientTransformation, lora: dict[str, Any], mesh: Mesh) -> Any:
    """Per-parameter moments sharded like their parameter, scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def sharding(path, leaf):
        for entry in reversed(path):
            name = getattr(entry, "key", None)
            if name in lora and leaf.shape == lora[name].shape:
                return lora[name].sharding
        return replicated

    return jax.tree_util.tree_map_with_path(sharding, jax.eval_shape(optimizer.init, lora))


def init_optimizer_state(optimizer: optax.GradientTransformation, lora: dict[str, jax.Array], mesh: Mesh) -> Any:
    """Optimizer state on the mesh (`optimizer_state_shardings`)."""
    return jax.jit(optimizer.init, out_shardings=optimizer_state_shardings(optimizer, lora, mesh))(lora)


def step_shardings(lora: dict[str, jax.Array], opt_state: Any, base: nnx.State, mesh: Mesh) -> dict[str, Any]:
    return {
        "lora": jax.tree.map(lambda x: x.sharding, lora),
        "optimizer": jax.tree.map(lambda x: x.sharding, opt_state),
        "base": jax.tree.map(lambda x: x.sharding, base),
        "batch": mesh_lib.batch_sharding(mesh, leading_dims=1),
        "replicated": NamedSharding(mesh, PartitionSpec()),
    }


def trainable_adapters(layout: LoraLayout, lora: nnx.State) -> dict[str, jax.Array]:
    """float32 adapters in buffers of their own: the step donates them, the model's own must stay valid."""
    return {name: jnp.copy(value).astype(jnp.float32) for name, value in layout.flat(lora).items()}


def model_flops(
    model: nnx.Module, attention_width_sum: int, seq_len: int, active: dict[str, float] | None = None
) -> metrics_lib.LoraFlops:
    """`lora_flops` of a model whose layers are not stacked yet (its paths are the ones `active` names)."""
    _, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    return lora_flops(base, LoraLayout(lora).flat(lora), attention_width_sum, seq_len, active)


def lora_flops(
    base: nnx.State,
    lora: dict[str, jax.Array],
    attention_width_sum: int,
    seq_len: int,
    active: dict[str, float] | None = None,
) -> metrics_lib.LoraFlops:
    """The FLOPs model's counts; `active` as `LoraModel.active` (None: no routed experts)."""
    return metrics_lib.LoraFlops(
        frozen_matmul_params=metrics_lib.frozen_matmul_params(_shapes(base), active),
        attention_width=attention_width_sum,
        adapter_params=round(sum(x.size * metrics_lib.active_share(name, active) for name, x in lora.items())),
        seq_len=seq_len,
    )


# ---------------------------------------------------------------- data on the mesh


@dataclass
class DataFeed:
    """This process's rows of `[accumulation, global_batch, seq_len]` batches, as global arrays."""

    packer: data_lib.PackedRows | data_lib.PrefetchedRows
    sharding: NamedSharding
    position_sharding: NamedSharding
    global_shape: tuple[int, int, int]
    local_rows: range

    @property
    def local_shape(self) -> tuple[int, int, int]:
        return (self.global_shape[0], len(self.local_rows), self.global_shape[2])

    def next_batch(self, step: int) -> Batch:
        rows = self.packer.next_rows(step)
        return {
            name: jax.make_array_from_process_local_data(self.sharding, values.reshape(self.local_shape), self.global_shape)
            for name, values in rows.items()
        }

    def positions(self) -> jax.Array:
        local = self.packer.state().astype(np.int32).reshape(self.local_shape[:2])
        return jax.make_array_from_process_local_data(self.position_sharding, local, self.global_shape[:2])

    def restore(self, positions: jax.Array) -> None:
        local = np.zeros(self.local_shape[:2], dtype=np.int64)
        for shard in positions.addressable_shards:
            rows = shard.index[1]
            start = (rows.start or 0) - self.local_rows.start
            local[:, start : start + shard.data.shape[1]] = np.asarray(shard.data)
        self.packer.restore(local.reshape(-1))

    def close(self) -> None:
        if isinstance(self.packer, data_lib.PrefetchedRows):
            self.packer.close()


def make_feed(
    dataset,
    encode,
    mesh: Mesh,
    accumulation: int,
    rows_per_micro_batch: int,
    options: data_lib.PackingOptions,
    prefetch: int = 0,
) -> DataFeed:
    """`prefetch` > 0: that many batches are prepared ahead by a background thread."""
    global_shape = (accumulation, rows_per_micro_batch, options.seq_len)
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    local_rows = mesh_lib.local_batch_rows(sharding, global_shape, batch_dim=1)
    row_ids = [a * rows_per_micro_batch + row for a in range(accumulation) for row in local_rows]
    packer = data_lib.PackedRows(len(dataset), encode, row_ids, accumulation * rows_per_micro_batch, options)
    if prefetch:
        packer = data_lib.PrefetchedRows(packer, depth=prefetch)
    return DataFeed(packer, sharding, mesh_lib.batch_sharding(mesh, leading_dims=1), global_shape, local_rows)


# ---------------------------------------------------------------- the run


@dataclass
class RunResult:
    final_step: int
    final_loss: float | None
    resumed_from: int | None
    eval_loss: float | None = None
    stopped_early: bool = False
    """The eval loss stopped improving (early_stopping_patience) before the last step."""


@dataclass
class Plateau:
    """Early stopping: the eval loss has not improved on the best by `min_delta` for `patience` evaluations."""

    patience: int
    min_delta: float
    best: float | None = None
    without_improvement: int = 0

    def update(self, eval_loss: float | None) -> bool:
        """Record an evaluation; True when training should stop."""
        if eval_loss is None:
            return False
        if self.best is None or eval_loss < self.best - self.min_delta:
            self.best, self.without_improvement = eval_loss, 0
        else:
            self.without_improvement += 1
        return 0 < self.patience <= self.without_improvement

    def describe(self) -> str:
        return (f"eval loss did not improve on {self.best:.4f} by more than {self.min_delta:g} "
                f"in {self.without_improvement} evaluations")


class Trainer:
    """Holds the objects of one run; `run()` trains to `config.steps`."""

    def __init__(self, config: TrainConfig, lora_model: LoraModel, mesh: Mesh):
        self.config = config
        self.mesh = mesh
        self.dtype = compute_dtype(config)
        self.lora_model = lora_model
        self.flops = model_flops(lora_model.model, lora_model.attention_width, config.max_target_length,
                                 lora_model.active)
        self.graphdef, self.layout, lora, base = split_for_step(lora_model.model, lora_model.layer_period)
        self.lora = trainable_adapters(self.layout, lora)
        self.base = base
        self.base_adapters = jax.tree.map(jnp.copy, self.lora) if config.generation_eval.enabled else None
        """The adapters as they start (B = 0, DoRA magnitudes = the weights' norms): the base model, for evaluate.py."""
        self.optimizer = build_optimizer(config)
        self.learning_rates = learning_rate_per_step(config)
        self.opt_state = init_optimizer_state(self.optimizer, self.lora, mesh)
        self.shardings = step_shardings(self.lora, self.opt_state, base, mesh)
        self.steps = build_step_functions(
            self.graphdef, self.layout, self.optimizer, self.dtype, self.shardings,
            config.loss_chunk_length, config.remat_policy, lora_model.aux_loss_coef,
        )
        self.tokenizer = data_lib.load_tokenizer(
            str(models.local_config_directory(config.tokenizer_directory)), config.chat_template_path
        )
        self.train_feed = self._feed(self._load(data_lib.train_source(config)), config.gradient_accumulation_steps,
                                     config.epoch_policy)
        self.eval_data = self._load(data_lib.eval_source(config)) if config.eval_interval else None
        self.is_lead = jax.process_index() == 0
        self.writer = metrics_lib.MetricsWriter(
            config.layout, config.steps, enabled=self.is_lead, tensorboard=config.enable_tensorboard,
            progress_lines=config.progress_lines,
        )
        self.peak_flops = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind, config.peak_tflops_per_device)
        self.checkpointer = self._checkpointer()
        self.stop = preemption.StopSignal()
        self.current_step = 0
        self.last_tokens_per_second = 0.0
        self.last_loss: float | None = None
        self.last_eval: tuple[int | None, float | None] = (None, None)
        """(step, loss) of the latest evaluation."""
        self.kept_checkpoints: tuple[CheckpointRecord, ...] = ()
        """The complete checkpoints the run keeps, reported in every progress record."""
        self.plateau = Plateau(config.early_stopping_patience, config.early_stopping_min_delta)

    # Setup helpers.
    def _rows_per_micro_batch(self) -> int:
        return self.config.per_device_batch_size * self.mesh.size

    def _load(self, source: data_lib.DataSource) -> tuple[Any, Callable[[int], data_lib.EncodedExample]]:
        columns = self.config.train_data_columns
        dataset = data_lib.load_dataset_split(source, columns)
        return dataset, data_lib.make_encoder(dataset, self.tokenizer, columns)

    def _feed(self, loaded, accumulation: int, on_end: data_lib.OnDataEnd) -> DataFeed:
        c = self.config
        dataset, encode = loaded
        training = on_end != "pad"
        options = data_lib.PackingOptions(
            seq_len=c.max_target_length,
            packing=c.packing,
            shuffle=c.shuffle and training,
            seed=c.data_shuffle_seed,
            on_end=on_end,
        )
        prefetch = PREFETCH_BATCHES if training else 0
        return make_feed(dataset, encode, self.mesh, accumulation, self._rows_per_micro_batch(), options, prefetch)

    def _checkpointer(self) -> ckpt.Checkpointer | None:
        c = self.config
        if not c.enable_checkpointing:
            return None
        pathways = distributed.is_pathways()
        if pathways and (c.checkpoint_storage_use_ocdbt or c.checkpoint_storage_use_zarr3):
            log.warning("Pathways: writing checkpoints without OCDBT/zarr3 (its array handler cannot read them)")
        options = ckpt.StorageOptions(
            use_zarr3=c.checkpoint_storage_use_zarr3 and not pathways,
            use_ocdbt=c.checkpoint_storage_use_ocdbt and not pathways,
            asynchronous=c.async_checkpointing,
            max_to_keep=c.max_num_checkpoints_to_keep,
        )
        return ckpt.Checkpointer(c.checkpoint_directory, options)

    def metadata(self, step: int) -> ckpt.CheckpointMetadata:
        c = self.config
        return ckpt.CheckpointMetadata(
            step=step,
            lora_rank=c.lora.lora_rank,
            lora_alpha=c.lora.lora_alpha,
            use_rslora=c.lora.use_rslora,
            use_dora=c.lora.use_dora,
            base_quantization=c.lora.base_quantization,
            target_modules=self.lora_model.target_modules,
            lora_module_path=c.lora.lora_module_path,
            base_model=c.model_name,
            family=c.family,
            load_parameters_path=c.load_parameters_path,
            tokenizer_path=c.tokenizer_path,
        )

    # Start point.
    def restore_or_start(self) -> int:
        """Resume from the latest complete checkpoint, else start (from lora_restore_path if set)."""
        latest = self.checkpointer.latest_step() if self.checkpointer else None
        if latest is not None:
            self.checkpointer.check_matches(latest, self.metadata(latest))
            self.lora, self.opt_state, positions = self.checkpointer.restore(
                latest, self.lora, self.opt_state, self.train_feed.positions()
            )
            self.train_feed.restore(positions)
            self.kept_checkpoints = tuple(self.checkpointer.complete())
            log.info("resumed from checkpoint step %d in %s", latest, self.checkpointer.directory)
            return latest
        if self.config.lora.lora_restore_path:
            self.lora = self._adapter_from(self.config.lora.lora_restore_path)
        return 0

    def _adapter_from(self, path: str) -> dict[str, jax.Array]:
        """LoRA weights of an earlier adapter checkpoint, placed like the current ones."""
        params, metadata = lora_lib.load_adapter_checkpoint(path)
        for option in ("use_rslora", "use_dora"):
            if getattr(metadata, option) != getattr(self.config.lora, option):
                raise lora_lib.LoraError(
                    f"lora.lora_restore_path {path}: adapter has {option}={getattr(metadata, option)}, this run has "
                    f"lora.{option}={getattr(self.config.lora, option)}; the same weights would mean another update"
                )
        if metadata.lora_rank != self.config.lora.lora_rank or set(params) != set(self.lora):
            raise lora_lib.LoraError(
                f"lora.lora_restore_path {path}: adapter has rank {metadata.lora_rank} and "
                f"{len(params)} tensors, this run has lora.lora_rank={self.config.lora.lora_rank} and {len(self.lora)}"
            )
        log.info("starting from adapter %s (step %d of %s)", path, metadata.step, metadata.base_model)
        return {
            name: jax.make_array_from_callback(
                current.shape, current.sharding, lambda index, host=params[name]: host[index].astype(current.dtype)
            )
            for name, current in self.lora.items()
        }

    # Loop.
    def run(self) -> RunResult:
        start = self.current_step = self.restore_or_start()
        total = self.config.steps
        result = RunResult(final_step=start, final_loss=None, resumed_from=start or None)
        if start >= total:
            log.info("nothing to do: checkpoint step %d >= steps=%d", start, total)
            if self.config.generation_eval.enabled:
                loss = next((c.train_loss for c in self.kept_checkpoints if c.step == start), None)
                self._evaluate_generations(start, loss)
                self.report_progress(start, loss=loss, tokens_per_second=0.0, eta_seconds=0.0, state="succeeded")
            return result
        timer = metrics_lib.StepTimer()
        pending: tuple[int, dict[str, jax.Array]] | None = None
        # The operator's pods print progress lines for the operator instead.
        self.console = ConsoleProgress(total, start, enabled=self.is_lead and not self.config.progress_lines)
        with jax.set_mesh(self.mesh), self.stop, self.console:
            for step in range(start + 1, total + 1):
                try:
                    batch = self._next_batch(step)
                except TrainingFailed:
                    if pending is not None:
                        self._report(*pending, timer)
                    raise
                self.lora, self.opt_state, step_metrics = self.steps.train(self.lora, self.opt_state, self.base, batch)
                if pending is not None:
                    result.final_loss = self._report(*pending, timer)
                pending = (step, step_metrics)
                if self._checkpoint_due(step) or self._eval_due(step):
                    result.final_loss = self._report(*pending, timer)
                    pending = None
                    if self._eval_due(step):
                        result.eval_loss = self._evaluate(step)
                        result.stopped_early = self.plateau.update(result.eval_loss) and step < total
                    if self._checkpoint_due(step) or result.stopped_early:
                        self._save(step, result.final_loss)
                    timer.reset()
                result.final_step = self.current_step = step
                if result.stopped_early:
                    log.info("stopping early at step %d: %s", step, self.plateau.describe())
                    break
                if step < total and self.stop.due(step):
                    if pending is not None:
                        result.final_loss = self._report(*pending, timer)
                    self._stop_preempted(step)
            if pending is not None:
                result.final_loss = self._report(*pending, timer)
        if self.checkpointer:
            self._finish_checkpoints()
        if self.config.generation_eval.enabled:
            self._evaluate_generations(result.final_step, result.final_loss)
        if result.stopped_early:
            self.report_progress(result.final_step, loss=result.final_loss, tokens_per_second=self.last_tokens_per_second,
                                 eta_seconds=0.0, state=STOPPED_EARLY, message=self.plateau.describe())
        else:
            self.report_progress(total, loss=result.final_loss, tokens_per_second=self.last_tokens_per_second,
                                 eta_seconds=0.0, state="succeeded")
        return result

    def _next_batch(self, step: int) -> Batch:
        try:
            return self.train_feed.next_batch(step)
        except data_lib.DataExhausted as error:
            raise TrainingFailed(str(error), exit_codes.DATA) from None
        except data_lib.DataError as error:
            raise TrainingFailed(f"data error at step {step}: {error}", exit_codes.DATA) from None

    def _checkpoint_due(self, step: int) -> bool:
        return self.checkpointer is not None and (step % self.config.checkpoint_period == 0 or step == self.config.steps)

    def _eval_due(self, step: int) -> bool:
        interval = self.config.eval_interval
        return interval > 0 and (step % interval == 0 or step == self.config.steps)

    def _save(self, step: int, train_loss: float | None) -> None:
        eval_step, eval_loss = self.last_eval
        metadata = replace(self.metadata(step), train_loss=train_loss, time=time.time(),
                                       eval_loss=eval_loss if eval_step == step else None)
        try:
            self.checkpointer.save(step, self.lora, self.opt_state, self.train_feed.positions(), metadata)
        except ckpt.CheckpointError as error:
            raise TrainingFailed(str(error), exit_codes.CHECKPOINT_WRITE) from None
        self.kept_checkpoints = tuple(self.checkpointer.complete())

    def _finish_checkpoints(self) -> None:
        try:
            self.checkpointer.wait()
        except ckpt.CheckpointError as error:
            raise TrainingFailed(str(error), exit_codes.CHECKPOINT_WRITE) from None
        self.kept_checkpoints = tuple(self.checkpointer.complete())

    def report_progress(self, step: int, **values) -> None:
        eval_step, eval_loss = self.last_eval
        self.writer.progress(step, eval_loss=eval_loss, eval_step=eval_step, checkpoints=self.kept_checkpoints,
                             **values)

    def _stop_preempted(self, step: int) -> None:
        """SIGTERM: a complete checkpoint at `step`, the last step run, before exiting."""
        if self.checkpointer is None:
            raise TrainingFailed(f"stopped by SIGTERM after step {step}; checkpointing is off, nothing saved",
                                 exit_codes.PREEMPTED)
        if not self._checkpoint_due(step):
            self._save(step, self.last_loss)
        self._finish_checkpoints()
        raise TrainingFailed(f"stopped by SIGTERM after step {step}; checkpoint saved at step {step}",
                             exit_codes.PREEMPTED)

    def _report(self, step: int, step_metrics: dict[str, jax.Array], timer: metrics_lib.StepTimer) -> float:
        values = {name: float(value) for name, value in jax.device_get(step_metrics).items()}
        if not math.isfinite(values["loss"]):
            raise TrainingFailed(f"loss is {values['loss']} at step {step}", exit_codes.DIVERGED)
        step_time = timer.lap()
        tokens_per_second = self.last_tokens_per_second = values["real_tokens"] / step_time
        eta = timer.eta_seconds(self.config.steps - step)
        if step % self.config.log_period == 0 or step == self.config.steps:
            record = {
                **values,
                "learning_rate": float(self.learning_rates[step - 1]),
                "step_time_s": step_time,
                "tokens_per_second": tokens_per_second,
                "mfu": metrics_lib.mfu(tokens_per_second, self.flops, jax.device_count(), self.peak_flops),
                "peak_host_memory_bytes": metrics_lib.peak_host_memory_bytes(),
                "peak_device_memory_bytes": metrics_lib.peak_device_memory_bytes(jax.local_devices()),
            }
            self.writer.write(step, record)
            aux = f" aux_loss {values['aux_loss']:.4f}" if "aux_loss" in values else ""
            log.info("step %d/%d loss %.4f%s  %.0f tok/s  %.3f s/step", step, self.config.steps, values["loss"], aux,
                     tokens_per_second, step_time)
        self.last_loss = values["loss"]
        self.report_progress(step, loss=values["loss"], tokens_per_second=tokens_per_second, eta_seconds=eta,
                       state="running")
        self.console.update(step, loss=values["loss"], tokens_per_second=tokens_per_second)
        return values["loss"]

    def _evaluate(self, step: int) -> float | None:
        feed = self._feed(self.eval_data, accumulation=1, on_end="pad")
        loss_sum = weight_sum = 0.0
        for _ in range(self.config.eval_steps):
            totals = jax.device_get(self.steps.evaluate(self.lora, self.base, feed.next_batch(step)))
            loss_sum += float(totals["loss_sum"])
            weight_sum += float(totals["weight_sum"])
        if weight_sum == 0:
            log.warning("evaluation at step %d saw no trained tokens", step)
            return None
        eval_loss = loss_sum / weight_sum
        self.writer.write(step, {"eval_loss": eval_loss, "eval_tokens": weight_sum})
        self.last_eval = (step, eval_loss)
        log.info("step %d eval loss %.4f", step, eval_loss)
        return eval_loss

    def _evaluate_generations(self, step: int, loss: float | None) -> None:
        self.report_progress(step, loss=loss, tokens_per_second=0.0, eta_seconds=0.0, state=EVALUATING,
                             message="generating answers with the base model and with the adapter")
        with jax.set_mesh(self.mesh):
            evaluate_lib.evaluate(self, step)

    def eval_loaded(self) -> tuple[Any, Callable[[int], data_lib.EncodedExample]]:
        """The evaluation split (loaded once)."""
        if self.eval_data is None:
            self.eval_data = self._load(data_lib.eval_source(self.config))
        return self.eval_data

    def generator(self, max_new_tokens: int, stop_ids: list[int]) -> generate_lib.Generator:
        """Greedy generation with this run's model, adapters and shardings (generate.py)."""
        return generate_lib.Generator(self.graphdef, self.layout, self.dtype, self.mesh, self.shardings["lora"],
                                      self.shardings["base"], max_new_tokens, stop_ids)

    def close(self) -> None:
        self.train_feed.close()
        if self.checkpointer:
            self.checkpointer.close()
        self.writer.close()


def _shapes(state: nnx.State) -> dict[str, tuple[int, ...]]:
    return {
        "/".join(str(part) for part in path): tuple(value.shape)
        for path, value in state.flat_state()
    }


SETUP_ERRORS = {
    data_lib.DataError: exit_codes.DATA,
    mesh_lib.MeshError: exit_codes.CONFIG,
    lora_lib.LoraError: exit_codes.MODEL,
    weights.WeightsError: exit_codes.MODEL,
    models.ModelConfigError: exit_codes.MODEL,
    ckpt.CheckpointError: exit_codes.MODEL,
    ckpt.OutputNotWritable: exit_codes.OUTPUT,
}
"""Bad inputs found while setting up, by exit code: reported without a traceback (most specific type first)."""


def build_trainer(
    config: TrainConfig, load_model: Callable[[TrainConfig, Mesh, jnp.dtype], LoraModel] = load_lora_model
) -> Trainer:
    mesh = mesh_lib.build_mesh(config.mesh)
    ckpt.ensure_writable(config.run_directory)
    with jax.set_mesh(mesh):
        lora_model = load_model(config, mesh, compute_dtype(config))
    return Trainer(config, lora_model, mesh)


def train(config: TrainConfig) -> RunResult:
    trainer = build_trainer(config)
    try:
        return trainer.run()
    except TrainingFailed as error:
        state = "preempted" if error.code == exit_codes.PREEMPTED else "failed"
        trainer.report_progress(trainer.current_step, loss=float("nan"), tokens_per_second=0.0,
                          eta_seconds=float("nan"), state=state, message=str(error))
        raise
    finally:
        trainer.close()


USAGE = """usage: python -m lorajob_trainer.train [CONFIG.yaml] KEY=VALUE...

Keys come from the YAML file, then the KEY=VALUE overrides (nested keys with dots: lora.lora_rank=8;
lists in YAML flow style: train_data_columns=['question','answer']).
"""


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(arguments):
        print(USAGE + "\n" + describe_keys(), end="")
        return 0
    configure_logging()
    config = parse_or_report(arguments)
    if config is None:
        return exit_codes.CONFIG
    try:
        distributed.initialize()
    except distributed.DistributedConfigError as error:
        print(f"distributed config error: {error}", file=sys.stderr)
        return exit_codes.CONFIG
    started = time.time()
    try:
        result = train(config)
    except TrainingFailed as error:
        print(f"training {'stopped' if error.code == exit_codes.PREEMPTED else 'failed'}: {error}", file=sys.stderr)
        return error.code
    except tuple(SETUP_ERRORS) as error:
        print(f"training failed before step 1: {type(error).__name__}: {error}", file=sys.stderr)
        return next(code for kind, code in reversed(SETUP_ERRORS.items()) if isinstance(error, kind))
    log.info("done: step %d, loss %.4f, %.1f s", result.final_step, result.final_loss, time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
