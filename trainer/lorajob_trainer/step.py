"""The jitted train and eval steps, and what they are built from.

One optimizer step is one jitted call: it scans over the gradient-accumulation micro-batches,
differentiates only the LoRA parameters (the frozen base weights are a plain input, so no
weight-gradient GEMMs are built for them), normalises by the number of trained tokens of the
whole step, clips and applies AdamW. The adapters are float32 buffers of their own, laid out by
`LoraLayout` (the layers stacked for the scan, models/decoder.py); the base argument as `BaseLayout` stores it
(on tpu7x each stacked weight with its layers on its second axis); `step_shardings` places them, the optimizer
state and the base on the mesh. run.py builds the step from these parts, for the trainer and the plan.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lorajob_trainer import loss as loss_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import preference as preference_lib
from lorajob_trainer import remat as remat_lib
from lorajob_trainer import weights
from lorajob_trainer.contract.config import PreferenceConfig
from lorajob_trainer.models import decoder, experts

Batch = dict[str, jax.Array]
BATCH_FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")
"""A batch's arrays, each [accumulation, rows, length]: weights float32, the others int32."""


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


LAYERS_SECOND_DEVICE_KINDS = ("TPU7x",)
"""Devices (a substring of `jax.Device.device_kind`) whose step takes its stacked base weights layers-second
(`BaseLayout`). A bf16 argument reaches the step in the default T(8,128) tiling, and tpu7x's matrix unit takes its
weights in T(16,128): stored with the layers first, each stacked weight is converted twice, once before the
forward layer loop and once before the backward one, and the two copies are live together; stored layers-second,
the transpose that brings the layers first is one conversion both loops read (docs/train-step-memory.md). Other
chips' matrix units take T(8,128), where the transpose would be a copy of each weight the step need not make."""


def stores_layers_second(mesh: Mesh) -> bool:
    """Whether the step on `mesh` takes its stacked base weights layers-second (`LAYERS_SECOND_DEVICE_KINDS`)."""
    device_kind = mesh.devices.flat[0].device_kind
    return any(kind in device_kind for kind in LAYERS_SECOND_DEVICE_KINDS)


@dataclass(frozen=True)
class BaseLayout:
    """How the step's base argument holds the frozen weights: as the model merges them, or with `layers_second`
    each stacked weight of a matrix or more per layer ([layers, d, f]) with its layers on axis 1 ([d, layers, f];
    models/decoder.py: `layers_second`), its sharding's spec permuted alike. A stacked vector per layer ([layers, d])
    stays: its layers would become the minor dimension, padded to 128. A stacked routed experts' bf16 weight
    ([layers, experts, d, f]) stays layers-first and is held as `experts.packed_rows` instead,
    which each layer unpacks in a kernel: converted to the matrix unit's tiling one layer at a time, not whole.
    `stored` makes the argument once, as the run is built; each step moves the layers back first (`for_model`) before
    it merges the model."""

    stacking: decoder.Stacking | None = None
    layers_second: bool = False

    def _moved(self, path: tuple, value: Any) -> bool:
        return (self.layers_second and self.stacking is not None and self.stacking.is_stacked(path)
                and len(value.shape) >= 3 and not self._packed(path, value))

    def _packed(self, path: tuple, value: Any) -> bool:
        """A stacked routed experts' bf16 weight (`experts.ExpertsLinear.w`) of an even number of rows, held
        `experts.packed_rows` (or so held)."""
        return (self.layers_second and self.stacking is not None and self.stacking.is_stacked(path)
                and experts.EXPERTS_NAME in path and path[-1] == "w"
                and (value.dtype == experts.PACKED_DTYPE or (value.dtype == jnp.bfloat16 and value.shape[-2] % 2 == 0)))

    def stored(self, base: nnx.State) -> nnx.State:
        """`base` as split from the model (arrays or ShapeDtypeStructs) as the step takes it. A moved weight's
        array is deleted as its copy is made, as `stack_layers` deletes the unstacked ones, so that device memory
        does not double: the model's own values of those weights are gone, the returned state holds them."""
        if not self.layers_second:
            return base

        def store(path: tuple, variable: nnx.Variable) -> nnx.Variable:
            value = variable.get_value()
            if self._packed(path, value):
                moved = experts.packed_rows(value) if isinstance(value, jax.ShapeDtypeStruct) else (
                    _packer(value.sharding)(value))
            elif self._moved(path, value):
                moved = decoder.layers_second(value)
            else:
                return variable
            if isinstance(value, jax.Array):
                value.delete()
            return variable.replace(moved)

        return nnx.from_flat_state([(path, store(path, variable)) for path, variable in nnx.to_flat_state(base)])

    def for_model(self, base: nnx.State) -> nnx.State:
        """The step's base argument (`stored`) as the model merges it: inside the step, before its layer loops."""
        if not self.layers_second:
            return base
        return nnx.from_flat_state([
            (path, variable.replace(decoder.layers_first(variable.get_value()))
             if self._moved(path, variable.get_value()) else variable)
            for path, variable in nnx.to_flat_state(base)
        ])


@functools.cache
def _packer(sharding: Any) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(experts.packed_rows, out_shardings=sharding)


PLAIN_BASE = BaseLayout()
"""The base argument as the model merges it."""


def split_for_step(model: nnx.Module, layer_period: int | None) -> tuple[nnx.GraphDef, LoraLayout, nnx.State, nnx.State]:
    """(graphdef, LoraLayout, LoRA state, base state) of the model as the step runs it: its layers stacked for
    the scan when `layer_period` is given (in place: `model` is changed; models/decoder.py)."""
    stacking = decoder.stack_layers(model, layer_period) if layer_period else None
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    return graphdef, LoraLayout(lora, stacking), lora, base


@dataclass
class StepFunctions:
    train: Callable[..., Any]
    """(adapters, optimizer state, base, batch[, reference adapters]) -> (adapters, optimizer state, metrics)."""
    evaluate: Callable[..., Any]
    """(adapters, base, batch[, reference adapters]) -> sums (`evaluation_result` reads them)."""
    traces: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    takes_reference: bool = False
    """Both steps take the reference adapters as their last argument (DPO)."""


@dataclass(frozen=True)
class Objective:
    """What the step minimises: `method` (contract.records.TRAINING_METHODS), with a preference method's settings."""

    method: str = "sft"
    preference: PreferenceConfig = PreferenceConfig()

    @property
    def is_preference(self) -> bool:
        return self.method != "sft"

    @property
    def needs_reference(self) -> bool:
        return self.method in preference_lib.REFERENCE_METHODS


SUPERVISED = Objective()
"""Supervised fine-tuning: the answers' next-token loss."""


def evaluation_result(objective: Objective, sums: dict[str, float]) -> dict[str, float] | None:
    """The eval loss (and a preference method's preference accuracy) from the eval step's sums over an evaluation's
    batches; None when they hold nothing to evaluate."""
    if not objective.is_preference:
        if not sums["weight_sum"]:
            return None
        return {"eval_loss": sums["loss_sum"] / sums["weight_sum"], "eval_tokens": sums["weight_sum"]}
    if not sums["pairs"]:
        return None
    counts = preference_lib.StepCounts(sums["pairs"], sums["chosen_tokens"])
    metrics = preference_lib.step_metrics(objective.method, sums, counts)
    return {"eval_loss": float(metrics["loss"]), "eval_preference_accuracy": float(metrics["reward_accuracy"]),
            "eval_pairs": sums["pairs"], "chosen_likelier": sums["likelier"] / sums["pairs"]}


def build_step_functions(
    graphdef: nnx.GraphDef,
    layout: LoraLayout,
    optimizer: optax.GradientTransformation,
    dtype: jnp.dtype,
    shardings: dict[str, Any],
    loss_chunk_length: int,
    remat_policy: remat_lib.RematPolicy,
    aux_loss_coef: float | None = None,
    expert_parallel: bool = False,
    objective: Objective = SUPERVISED,
    base_layout: BaseLayout = PLAIN_BASE,
) -> StepFunctions:
    """Jitted train and eval steps with fixed in/out shardings, so each compiles once.

    `aux_loss_coef` (LoraModel.aux_loss_coef): the step minimises LM loss + coef * load-balancing loss,
    the latter the mean over micro-batches of each one's (as transformers computes it per forward), and
    reports it as `aux_loss`; None: the model has none. `expert_parallel` (routed experts split over the mesh's
    expert axis): the step also reports the (token, expert) rows its all-to-alls dropped and the empty slots they
    carried, summed over micro-batches, layers and devices (`expert_rows_dropped`, `expert_slots_padded`).
    `objective`: a preference method's steps come from `build_preference_steps`. `base_layout`: how the steps' base
    argument holds the weights (each step starts by `BaseLayout.for_model`)."""
    if objective.is_preference:
        return build_preference_steps(graphdef, layout, optimizer, dtype, shardings, loss_chunk_length, remat_policy,
                                      objective, aux_loss_coef, expert_parallel, base_layout)
    traces = {"train": 0, "eval": 0}

    def losses(lora, base, micro_batch, aux_weight=0.0):
        """(objective: weighted NLL sum + aux_weight * load-balancing loss, (NLL sum, weight sum, that loss,
        dispatch counts))."""
        adapters = layout.state({name: value.astype(dtype) for name, value in lora.items()})
        model = nnx.merge(graphdef, adapters, base)
        loss_sum, weight_sum, aux, dispatch = loss_lib.losses_with_load_balancing(
            model, micro_batch, loss_chunk_length, remat_policy
        )
        trained_aux = aux if aux_loss_coef else jax.lax.stop_gradient(aux)
        return loss_sum + aux_weight * trained_aux, (loss_sum, weight_sum, aux, dispatch)

    grad_fn = jax.value_and_grad(losses, has_aux=True)

    def train_step(lora, opt_state, base, batch):
        traces["train"] += 1
        base = base_layout.for_model(base)
        accumulation = batch["weights"].shape[0]
        weight_sum = jnp.sum(batch["weights"])
        scale = 1.0 / jnp.maximum(weight_sum, 1.0)
        # Gradients are summed, then scaled by `scale`: this weight makes the aux term's coef / accumulation.
        aux_weight = (aux_loss_coef or 0.0) / (accumulation * scale)

        def accumulate(carry, micro_batch):
            grads, loss_sum, aux_sum, dispatch_sum = carry
            (_, (micro_loss, _, micro_aux, dispatch)), micro_grads = grad_fn(lora, base, micro_batch, aux_weight)
            sums = (loss_sum + micro_loss, aux_sum + micro_aux, dispatch_sum + dispatch)
            return (jax.tree.map(jnp.add, grads, micro_grads), *sums), None

        zeros = jax.tree.map(jnp.zeros_like, lora)
        initial = (zeros, 0.0, 0.0, jnp.zeros(2, jnp.int32))
        (grads, loss_sum, aux_sum, dispatch_sum), _ = jax.lax.scan(accumulate, initial, batch)
        grads = jax.tree.map(lambda g: g * scale, grads)
        return apply_gradients(optimizer, lora, opt_state, grads, batch, {"loss": loss_sum * scale},
                               aux_sum / accumulation if aux_loss_coef is not None else None,
                               dispatch_sum if expert_parallel else None)

    def eval_step(lora, base, batch):
        traces["eval"] += 1
        base = base_layout.for_model(base)

        def accumulate(carry, micro_batch):
            _, (loss_sum, weight_sum, _, _) = losses(lora, base, micro_batch)
            return (carry[0] + loss_sum, carry[1] + weight_sum), None

        (loss_sum, weight_sum), _ = jax.lax.scan(accumulate, (0.0, 0.0), batch)
        return {"loss_sum": loss_sum, "weight_sum": weight_sum}

    return jitted_steps(train_step, eval_step, shardings, traces)


def jitted_steps(train_step: Callable, eval_step: Callable, shardings: dict[str, Any], traces: dict[str, int],
                 takes_reference: bool = False) -> StepFunctions:
    """The steps jitted with fixed in/out shardings (`step_shardings`), the adapters and optimizer state donated;
    `takes_reference`: both take the reference adapters last, placed like the adapters."""
    replicated = shardings["replicated"]
    reference = (shardings["lora"],) if takes_reference else ()
    train = jax.jit(
        train_step,
        in_shardings=(shardings["lora"], shardings["optimizer"], shardings["base"], shardings["batch"], *reference),
        out_shardings=(shardings["lora"], shardings["optimizer"], replicated),
        donate_argnums=(0, 1),
    )
    evaluate = jax.jit(
        eval_step,
        in_shardings=(shardings["lora"], shardings["base"], shardings["batch"], *reference),
        out_shardings=replicated,
    )
    return StepFunctions(train, evaluate, traces, takes_reference)


def apply_gradients(
    optimizer: optax.GradientTransformation, lora: Any, opt_state: Any, grads: Any, batch: Batch,
    metrics: dict[str, jax.Array], aux_loss: jax.Array | None, dispatch: jax.Array | None,
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """(updated adapters, optimizer state, the step's metrics): `metrics` with the batch's token counts, the
    gradient norm, and the load-balancing loss and the dispatch counts where the model has them."""
    updates, opt_state = optimizer.update(grads, opt_state, lora)
    step_metrics = {
        **metrics,
        "trained_tokens": jnp.sum(batch["weights"]),
        "real_tokens": jnp.sum(batch["segment_ids"] != 0),
        "grad_norm": optax.global_norm(grads),
    }
    if aux_loss is not None:
        step_metrics["aux_loss"] = aux_loss
    if dispatch is not None:
        step_metrics["expert_rows_dropped"], step_metrics["expert_slots_padded"] = dispatch
    return optax.apply_updates(lora, updates), opt_state, step_metrics


def build_preference_steps(
    graphdef: nnx.GraphDef,
    layout: LoraLayout,
    optimizer: optax.GradientTransformation,
    dtype: jnp.dtype,
    shardings: dict[str, Any],
    loss_chunk_length: int,
    remat_policy: remat_lib.RematPolicy,
    objective: Objective,
    aux_loss_coef: float | None = None,
    expert_parallel: bool = False,
    base_layout: BaseLayout = PLAIN_BASE,
) -> StepFunctions:
    """`build_step_functions` for a preference method (preference.py): the micro-batches' rows are pairs; the loss is
    averaged over the step's kept pairs. DPO's steps take the reference adapters as their last argument: the
    reference's forward runs in the same step, on the same base, undifferentiated. A model with a load-balancing loss
    adds coef times its mean over micro-batches, as transformers computes it per forward."""
    traces = {"train": 0, "eval": 0}
    method = objective.method

    def model_with(adapters, base):
        return nnx.merge(graphdef, layout.state({name: value.astype(dtype) for name, value in adapters.items()}), base)

    def micro_objective(lora, base, reference, micro_batch, counts, aux_weight):
        needed = preference_lib.needed_positions(method, micro_batch)
        model = model_with(lora, base)
        policy_nll, aux, dispatch = loss_lib.with_load_balancing(
            model, micro_batch, lambda: loss_lib.token_nll(model, micro_batch, needed, loss_chunk_length, remat_policy)
        )
        reference_nll = None
        if reference is not None:
            reference_nll = jax.lax.stop_gradient(
                loss_lib.token_nll(model_with(reference, base), micro_batch, needed, loss_chunk_length)
            )
        value, sums = preference_lib.micro_objective(method, objective.preference, micro_batch, policy_nll,
                                                     reference_nll, counts)
        trained_aux = aux if aux_loss_coef else jax.lax.stop_gradient(aux)
        return value + aux_weight * trained_aux, (sums, aux, dispatch)

    grad_fn = jax.value_and_grad(micro_objective, has_aux=True)

    def accumulated(fn, initial, batch):
        def accumulate(carry, micro_batch):
            return jax.tree.map(jnp.add, carry, fn(micro_batch)), None

        return jax.lax.scan(accumulate, initial, batch)[0]

    def sums_like(lora, base, reference, batch, counts):
        return jax.eval_shape(lambda: micro_objective(lora, base, reference, jax.tree.map(lambda x: x[0], batch),
                                                      counts, 0.0)[1])

    def train_step(lora, opt_state, base, batch, reference=None):
        traces["train"] += 1
        base = base_layout.for_model(base)
        counts = preference_lib.step_counts(method, batch)
        accumulation = batch["weights"].shape[0]
        aux_weight = (aux_loss_coef or 0.0) / accumulation

        def micro(micro_batch):
            (_, aux_sums), grads = grad_fn(lora, base, reference, micro_batch, counts, aux_weight)
            return grads, aux_sums

        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                             (jax.eval_shape(lambda: lora), sums_like(lora, base, reference, batch, counts)))
        grads, (sums, aux_sum, dispatch_sum) = accumulated(micro, zeros, batch)
        return apply_gradients(optimizer, lora, opt_state, grads, batch,
                               preference_lib.step_metrics(method, sums, counts),
                               aux_sum / accumulation if aux_loss_coef is not None else None,
                               dispatch_sum if expert_parallel else None)

    def eval_step(lora, base, batch, reference=None):
        traces["eval"] += 1
        base = base_layout.for_model(base)
        counts = preference_lib.step_counts(method, batch)
        initial = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), sums_like(lora, base, reference, batch, counts)[0])
        sums = accumulated(lambda micro_batch: micro_objective(lora, base, reference, micro_batch, counts, 0.0)[1][0],
                           initial, batch)
        # micro_objective divides by the step's counts: the sums are not; the counts go out for the whole evaluation.
        return {**sums, "pairs": counts.pairs, "chosen_tokens": counts.chosen_tokens}

    return jitted_steps(train_step, eval_step, shardings, traces, takes_reference=objective.needs_reference)


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


def step_shardings(adapters: dict[str, Any], optimizer: optax.GradientTransformation, base: nnx.State,
                   mesh: Mesh) -> dict[str, Any]:
    """Where the step's arguments live: the adapters and the base as placed, the optimizer state like its
    parameters (`optimizer_state_shardings`), the batch's rows over the mesh."""
    return {
        "lora": jax.tree.map(lambda x: x.sharding, adapters),
        "optimizer": optimizer_state_shardings(optimizer, adapters, mesh),
        "base": jax.tree.map(lambda x: x.sharding, base),
        "batch": mesh_lib.batch_sharding(mesh, leading_dims=1),
        "replicated": NamedSharding(mesh, PartitionSpec()),
    }
