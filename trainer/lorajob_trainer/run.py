"""One run, built once: what the train step is made of, from a config and a model.

A `LoraModel` is the base model with the configured LoRA adapters applied, from one of two sources:
`loaded_model` reads the checkpoint's weights onto the mesh (the trainer), `abstract_model` builds it from
config.json alone with every array a ShapeDtypeStruct (the plan, which compiles for a TPU it does not hold;
the chip bench, which fills it with random values). `build` turns either into a `Run`: the graph and its
adapter layout (the layers stacked for the scan), the base weights, the optimizer, the shardings, the
jitted train and eval steps, the FLOPs model and the batch the step takes. The same code builds the step the
trainer runs and the one the plan compiles (tests/trainer/test_plan_is_the_trainers_step.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from lorajob_trainer import generate as generate_lib
from lorajob_trainer import loading, models
from lorajob_trainer import lora as lora_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import metrics as metrics_lib
from lorajob_trainer import step as step_lib
from lorajob_trainer.contract.config import LoraConfig, StepShape, TrainConfig, resolve_target_modules
from lorajob_trainer.models import experts
from lorajob_trainer.optim import build_optimizer


@dataclass(frozen=True)
class LoraModel:
    """A base model with LoRA adapters applied, its arrays placed on the mesh (or ShapeDtypeStructs)."""

    model: nnx.Module
    target_modules: list[str] | None
    tunix_config: Any
    """The Tunix ModelConfig the model was built from."""
    hf_config: dict[str, Any]
    """The checkpoint's config.json (remat auto compiles the step from it: plan.choose_remat)."""
    layer_period: int | None
    """The family's layer period (Family.layer_period): the step scans over its repeats; None: unrolled."""
    abstract: bool = False
    """Every array a ShapeDtypeStruct (`abstract_model`): nothing read or allocated."""
    active: dict[str, float] = field(default_factory=dict)
    """Routed experts' module paths (with a trailing ".") -> share a token uses (for the FLOPs model)."""
    aux_loss_coef: float | None = None
    """Weight of the MoE load-balancing loss in the training loss; None: the model has none."""

    @property
    def attention_width(self) -> int:
        """Sum over layers of query heads * head_dim (for the FLOPs model)."""
        c = self.tunix_config
        return c.num_layers * c.num_heads * c.head_dim

    def flops(self, seq_len: int) -> metrics_lib.LoraFlops:
        """The FLOPs model's counts for sequences of `seq_len`, of the model before `build` stacks its layers."""
        _, lora, base = nnx.split(self.model, nnx.LoRAParam, ...)
        return lora_flops(base, step_lib.LoraLayout(lora).flat(lora), self.attention_width, seq_len, self.active)


def compute_dtype(config: TrainConfig, platform: str | None = None) -> jnp.dtype:
    """The dtype of the base weights and activations; "auto": float32 on CPU, else bfloat16. `platform`: the
    devices the step is for (default: JAX's default backend)."""
    if config.dtype == "auto":
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    return jnp.dtype(config.dtype)


def _with_adapters(model: nnx.Module, lora: LoraConfig, target_regex: str, mesh: Mesh, rngs: nnx.Rngs) -> nnx.Module:
    return lora_lib.apply_lora(
        model, rank=lora.lora_rank, alpha=lora.lora_alpha, target_regex=target_regex, mesh=mesh, rngs=rngs,
        rslora=lora.use_rslora, dora=lora.use_dora, base_quantization=lora.base_quantization,
    )


def _targets(lora: LoraConfig, family: str, num_layers: int) -> tuple[list[str] | None, str]:
    """(the adapted modules' names, None where a regex alone names them; the regex that selects them)."""
    targets = resolve_target_modules(lora, lora_lib.default_targets(family))
    regex = lora_lib.target_regex(family, targets, lora.lora_module_path)
    if targets is None:
        targets = lora_lib.names_for_regex(family, regex, num_layers) or None
    return targets, regex


def lora_model_of(model: nnx.Module, family: models.Family, tunix_config: Any, hf_config: dict[str, Any],
                  targets: list[str] | None, abstract: bool, *, aux_loss_override: float | None = None,
                  expert_axis: int = 1, expert_capacity_factor: float = 0.0) -> LoraModel:
    """`model` (adapters applied) with the facts the run is built from; `aux_loss_override`: the config's
    router_aux_loss_coef (None: the checkpoint's). Its routed-experts blocks are set to dispatch over
    `expert_axis` devices at `expert_capacity_factor` (MeshError where the axis does not divide their experts)."""
    experts.configure_dispatch(model, expert_axis, expert_capacity_factor)
    return LoraModel(
        model, targets, tunix_config, hf_config, family.layer_period(tunix_config), abstract,
        experts.active_shares(model), aux_loss_coef(aux_loss_override, hf_config, model),
    )


def loaded_model(config: TrainConfig, mesh: Mesh, dtype: jnp.dtype) -> LoraModel:
    """The base weights of the config's checkpoint, read onto `mesh` in `dtype`, with the configured adapters.

    A MaxText base takes its config.json from the tokenizer directory (see loading.load_model)."""
    model, spec = loading.load_model(
        config.model_name, config.load_parameters_path, mesh=mesh, dtype=dtype, config_dir=config.tokenizer_directory
    )
    targets, regex = _targets(config.lora, spec.family.name, spec.tunix_config.num_layers)
    model = _with_adapters(model, config.lora, regex, mesh, nnx.Rngs(config.seed))
    return lora_model_of(model, spec.family, spec.tunix_config, spec.hf_config, targets, abstract=False,
                         aux_loss_override=config.router_aux_loss_coef, expert_axis=config.mesh.expert_degree,
                         expert_capacity_factor=config.expert_capacity_factor)


LOADED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The dtypes of weights as a checkpoint holds them (the trainer loads them in its compute dtype); a quantised
weight's own type (int8, uint4, float8) stays."""


def _abstract(variable: nnx.Variable, mesh: Mesh, dtype: Any) -> jax.ShapeDtypeStruct:
    value = variable.get_value()
    value_dtype = dtype if jnp.dtype(value.dtype) in LOADED_DTYPES else value.dtype
    return jax.ShapeDtypeStruct(value.shape, value_dtype, sharding=mesh_lib.variable_sharding(mesh, variable))


def abstract_model(hf_config: dict[str, Any], lora: LoraConfig, mesh: Mesh, dtype: Any,
                   aux_loss_override: float | None = None, expert_capacity_factor: float = 0.0) -> LoraModel:
    """The model `loaded_model` would load for a checkpoint with this config.json and `lora`'s adapters, every
    value a ShapeDtypeStruct placed on `mesh`, the base weights in `dtype` as the trainer loads them; its routed
    experts dispatch over the mesh's expert axis."""
    family = models.family_for_hf_config(hf_config)
    tunix_config = family.config_from_hf(hf_config, dtype)
    targets, regex = _targets(lora, family.name, tunix_config.num_layers)

    def build() -> nnx.Module:
        model = family.build(tunix_config, hf_config, models.tracing_rngs())
        return _with_adapters(model, lora, regex, mesh, models.tracing_rngs())

    model = nnx.eval_shape(build)
    for _, variable in nnx.to_flat_state(nnx.state(model)):
        variable.set_value(_abstract(variable, mesh, dtype))
    return lora_model_of(model, family, tunix_config, hf_config, targets, abstract=True,
                         aux_loss_override=aux_loss_override, expert_axis=mesh.shape[experts.EXPERT_AXIS],
                         expert_capacity_factor=expert_capacity_factor)


def aux_loss_coef(override: float | None, hf_config: dict[str, Any], model: nnx.Module) -> float | None:
    """`override` (config key router_aux_loss_coef), else the checkpoint's (experts.aux_loss_coef); None for a
    model without load-balanced MoE blocks."""
    if not any(isinstance(module, experts.LoadBalanced) for _, module in nnx.iter_graph(model)):
        return None
    return experts.aux_loss_coef(hf_config) if override is None else override


def lora_flops(
    base: nnx.State,
    lora: dict[str, jax.Array],
    attention_width_sum: int,
    seq_len: int,
    active: dict[str, float] | None = None,
) -> metrics_lib.LoraFlops:
    """The FLOPs model's counts; `active` as `LoraModel.active` (None: no routed experts)."""
    shapes = {"/".join(str(part) for part in path): tuple(value.shape) for path, value in base.flat_state()}
    return metrics_lib.LoraFlops(
        frozen_matmul_params=metrics_lib.frozen_matmul_params(shapes, active),
        head_params=metrics_lib.output_head_params(shapes),
        attention_width=attention_width_sum,
        adapter_params=round(sum(x.size * metrics_lib.active_share(name, active) for name, x in lora.items())),
        seq_len=seq_len,
    )


def _float32_shapes(adapters: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """The trainable adapters' shapes and places (the step trains them in float32), nothing allocated."""
    return {name: jax.ShapeDtypeStruct(value.shape, jnp.float32, sharding=value.sharding)
            for name, value in adapters.items()}


@dataclass(frozen=True)
class Run:
    """The train step of one run and everything it is built from (`build`). Immutable: the adapters and the
    optimizer state the step updates (and donates) are the caller's, made by `adapters` and `optimizer_state`."""

    mesh: Mesh
    dtype: jnp.dtype
    """The base weights' and the activations' dtype (`compute_dtype`)."""
    shape: StepShape
    remat_policy: str
    model: LoraModel
    graphdef: nnx.GraphDef
    layout: step_lib.LoraLayout
    lora_state: nnx.State
    """The adapters as the model holds them as it starts (B = 0, DoRA's magnitudes = the weights' norms)."""
    base: nnx.State
    """The base weights as the step takes them: stored as `base_layout` says."""
    base_layout: step_lib.BaseLayout
    optimizer: optax.GradientTransformation
    shardings: dict[str, Any]
    steps: step_lib.StepFunctions
    flops: metrics_lib.LoraFlops
    batch: dict[str, jax.ShapeDtypeStruct]
    """A training batch as the step takes it: [accumulation, global rows, length], sharded over the mesh."""

    @property
    def layers_scanned(self) -> int:
        """Decoder layers inside the scan (0: unrolled)."""
        stacking = self.layout.stacking
        return stacking.period * stacking.repeats if stacking else 0

    def adapters(self) -> dict[str, Any]:
        """The trainable adapters as they start: float32, in buffers of their own (the step donates them; the
        model's stay valid), or ShapeDtypeStructs for an abstract model."""
        flat = self.layout.flat(self.lora_state)
        if self.model.abstract:
            return _float32_shapes(flat)
        return {name: jnp.copy(value).astype(jnp.float32) for name, value in flat.items()}

    def optimizer_state(self, adapters: dict[str, Any]) -> Any:
        """The optimizer's state for `adapters`, placed like them (ShapeDtypeStructs for an abstract model)."""
        if self.model.abstract:
            return jax.tree.map(
                lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                jax.eval_shape(self.optimizer.init, adapters), self.shardings["optimizer"],
            )
        return jax.jit(self.optimizer.init, out_shardings=self.shardings["optimizer"])(adapters)

    def arguments(self) -> tuple[Any, ...]:
        """(adapters, optimizer state, base, batch[, reference adapters]): what the train step takes, to lower or
        compile it."""
        adapters = self.adapters()
        reference = (self.adapters(),) if self.steps.takes_reference else ()
        return adapters, self.optimizer_state(adapters), self.base, self.batch, *reference

    def generator(self, max_new_tokens: int, stop_ids: list[int]) -> generate_lib.Generator:
        """Greedy generation with this run's model, adapters and shardings (generate.py)."""
        return generate_lib.Generator(self.graphdef, self.layout, self.base_layout, self.dtype, self.mesh,
                                      self.shardings["lora"], self.shardings["base"], max_new_tokens, stop_ids)


def batch_spec(shape: StepShape, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of `shape.accumulation` micro-batches of `shape.rows` rows per device (every device of the mesh
    counts towards the global batch) of `shape.length` positions."""
    dims = (shape.accumulation, mesh_lib.global_batch_rows(shape.rows, mesh), shape.length)
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    return {name: jax.ShapeDtypeStruct(dims, jnp.float32 if name == "weights" else jnp.int32, sharding=sharding)
            for name in step_lib.BATCH_FIELDS}


def build(shape: StepShape, optimizer: optax.GradientTransformation, model: LoraModel, mesh: Mesh,
          dtype: jnp.dtype, remat_policy: str, scan_layers: bool = True,
          objective: step_lib.Objective = step_lib.SUPERVISED, base_layers_second: bool | None = None) -> Run:
    """The step over `model` on `mesh` for batches of `shape`, minimising `objective`, updating the adapters with
    `optimizer` (optim.build_optimizer), with a concrete `remat_policy` (train.remat_for_run resolves auto).
    `scan_layers=False` leaves the layers unrolled, as the trainer never does, so that the compiler's cost
    analysis counts every layer (bench/tpu_plan.py --executed-flops). The model's layers are stacked in place, and
    its stacked base weights stored layers-second (step.BaseLayout; their arrays in the model deleted) where
    `base_layers_second` says, by default where the mesh's devices want it (step.stores_layers_second)."""
    flops = replace(model.flops(shape.length), reference_forward=objective.needs_reference)
    graphdef, layout, lora, base = step_lib.split_for_step(model.model, model.layer_period if scan_layers else None)
    if base_layers_second is None:
        base_layers_second = step_lib.stores_layers_second(mesh)
    base_layout = step_lib.BaseLayout(layout.stacking, base_layers_second)
    base = base_layout.stored(base)
    shardings = step_lib.step_shardings(_float32_shapes(layout.flat(lora)), optimizer, base, mesh)
    steps = step_lib.build_step_functions(
        graphdef, layout, optimizer, dtype, shardings, shape.loss_chunk, remat_policy, model.aux_loss_coef,
        expert_parallel=bool(model.active) and mesh.shape[experts.EXPERT_AXIS] > 1, objective=objective,
        base_layout=base_layout,
    )
    return Run(mesh, dtype, shape, remat_policy, model, graphdef, layout, lora, base, base_layout, optimizer,
               shardings, steps, flops, batch_spec(shape, mesh))


def resolve_expert_axis(
    config: TrainConfig, hf_config: Callable[[], dict[str, Any]], devices: list[jax.Device]
) -> TrainConfig:
    """`config` with mesh.expert "auto" made a number on `devices` for the model of the config.json `hf_config`
    returns (read only where there is a choice): `experts.expert_axis_for` over the devices of a slice that data
    and tensor leave; 1 where fsdp is fixed or they leave one device."""
    mesh = config.mesh
    if mesh.expert != "auto":
        return config
    slices = 1 + max(getattr(device, "slice_index", 0) or 0 for device in devices)
    available = len(devices) // ((slices if mesh.data == -1 else mesh.data) * mesh.tensor)
    expert = 1
    if mesh.fsdp == -1 and available > 1:
        hf = hf_config()
        family = models.family_for_hf_config(hf)
        model = models.abstract_model(family, family.config_from_hf(hf, jnp.bfloat16), hf)
        tokens = config.per_device_batch_size * config.max_target_length
        expert = experts.expert_axis_for(model, available, tokens, config.expert_capacity_factor)
    return config.model_copy(update={"mesh": mesh.model_copy(update={"expert": expert})})


def abstract_run(config: TrainConfig, hf_config: dict[str, Any], devices: list[jax.Device],
                 scan_layers: bool = True, expert_adapter_kernel: str | None = None,
                 base_layers_second: bool | None = None) -> Run:
    """The run of `config` (a concrete remat policy) over `devices`, every array abstract: what the plan compiles.
    `expert_adapter_kernel` overrides the routed experts' adapter kernel (experts.use_adapter_kernel);
    `base_layers_second` the base weights' storage (`build`)."""
    config = resolve_expert_axis(config, lambda: hf_config, devices)
    mesh = mesh_lib.build_mesh(config.mesh, devices)
    dtype = compute_dtype(config, devices[0].platform)
    model = abstract_model(hf_config, config.lora, mesh, dtype, config.router_aux_loss_coef,
                           config.expert_capacity_factor)
    if expert_adapter_kernel is not None:
        experts.use_adapter_kernel(model.model, expert_adapter_kernel)
    return build(config.step_shape, build_optimizer(config), model, mesh, dtype, config.remat_policy, scan_layers,
                 objective_of(config), base_layers_second)


def objective_of(config: TrainConfig) -> step_lib.Objective:
    """The step's objective of `config` (its method and preference settings)."""
    return step_lib.Objective(config.method, config.preference)
