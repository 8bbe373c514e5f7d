"""The trainer's own train step, compiled for devices it does not run on (a TPU topology, without a TPU).

`compile_train_step(config, hf_config, devices)` builds what `train.Trainer` builds (run_setup.py, step.py),
from config.json alone: the model and its LoRA adapters as abstract arrays (`nnx.eval_shape`, nothing read or
allocated) with the shardings of the run's mesh over `devices`, the layers stacked for the scan, the float32
adapters, the optimizer state and a batch of the run's shape, and compiles the same jitted step
(`step.build_step_functions`). The compiler's memory and cost analyses are per JAX device: a chip, or half of
one on tpu7x (two TensorCores per chip).

TPU devices come from `jax.experimental.topologies` (libtpu installed; no TPU needed):
`topology_devices("v6e:2x4")`, multi-slice with `num_slices`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from lorajob_trainer import lora as lora_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import models, run_setup
from lorajob_trainer import step as step_lib
from lorajob_trainer.models import experts, splash
from lorajob_trainer.contract.config import TrainConfig, resolve_target_modules
from lorajob_trainer.contract.records import REMAT_POLICIES
from lorajob_trainer.optim import build_optimizer


class PlanError(RuntimeError):
    """The step cannot be compiled for the target (no libtpu, an unknown topology)."""


CHIPS_PER_HOST_BOUNDS = {1: (1, 1, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
"""libtpu's host shape for a machine with this many chips (a 1-chip VM's slice is not a 2x2 host's)."""

DEVICELESS_LIBTPU_ENV = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}
"""What libtpu reads as it starts, for a compile without a TPU (values already set win): no machine-wide lock, which
a second planning process or test worker would fail on; and this machine as the one host of its slice, which
libtpu otherwise asks the GCE metadata server for, printing "Failed to find host bounds" and "unexpected worker
hostname" errors that make a good plan look failed. The topology compiled for is `get_topology_desc`'s."""


def topology_devices(topology: str, num_slices: int = 1, chips_per_host: int = 4) -> list[jax.Device]:
    """The devices of a TPU topology such as `v6e:2x4` or `v5p:2x2x1` (`num_slices` > 1: multi-slice) on
    hosts of `chips_per_host` chips."""
    from jax.experimental import topologies

    for name, value in DEVICELESS_LIBTPU_ENV.items():
        os.environ.setdefault(name, value)
    try:
        description = topologies.get_topology_desc(
            topology_name=topology, platform="tpu", num_slices=num_slices,
            chips_per_host_bounds=CHIPS_PER_HOST_BOUNDS[chips_per_host],
        )
    except Exception as error:  # the plugin's own errors: missing libtpu, unknown topology names
        raise PlanError(f"cannot describe TPU topology {topology!r} ({num_slices} slice(s)): {error}") from error
    return list(description.devices)


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Bytes per device: what the compiler assigns, and the inputs' parts from their shapes and shardings."""

    arguments: int
    outputs: int
    aliased: int
    """Output bytes that reuse donated argument buffers (counted once in `total`)."""
    temporaries: int
    base_weights: int
    adapters: int
    optimizer_state: int
    batch: int

    @property
    def total(self) -> int:
        """Peak HBM the step needs: arguments + outputs not aliased to them + temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temporaries


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    memory: StepMemory
    flops: float | None
    """The compiler's cost analysis (a scanned loop's body counted once, so not the step's total)."""
    flops_per_token: float
    """The 4N LoRA cost model (metrics.LoraFlops) of one trained token."""
    executed_flops_per_token: float
    """What the step runs per token, recompute and masked attention included (LoraFlops.executed_per_token)."""
    attention_block: int | None
    """The block of the splash-attention kernel the step's attention runs in (models/splash.py); None: dense."""
    kernel_flops_per_token: float
    """Of `executed_flops_per_token`, the splash kernel's, which the compiler's cost analysis does not count (a
    Pallas kernel is a custom call to it)."""
    tokens_per_device: int
    """Tokens one device runs per step (batch rows x length x accumulation)."""
    compile_seconds: float
    devices: int
    layers_scanned: int
    """Decoder layers inside the scan (0: unrolled)."""
    executable: Any = None
    """The compiled step (`jax.stages.Compiled`): callable with the step's arguments where its devices are real."""


def bits(dtype: Any) -> int:
    """Bits per element as a TPU holds them: 4 for int4 and NF4's uint4, whose numpy itemsize says 8."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return 8 * dtype.itemsize


def per_chip_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.ceil(math.prod(shape) * bits(leaf.dtype) / 8)
    return total


LOADED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The dtypes of weights as a checkpoint holds them (the trainer loads them in its compute dtype); a quantised
weight's own type (int8, uint4, float8) stays."""


def _abstract(variable: nnx.Variable, mesh: jax.sharding.Mesh, dtype: Any) -> jax.ShapeDtypeStruct:
    value = variable.get_value()
    value_dtype = dtype if jnp.dtype(value.dtype) in LOADED_DTYPES else value.dtype
    return jax.ShapeDtypeStruct(value.shape, value_dtype, sharding=mesh_lib.variable_sharding(mesh, variable))


def abstract_lora_model(config: TrainConfig, hf_config: dict[str, Any], mesh: jax.sharding.Mesh, dtype: Any):
    """(model, family, tunix_config): the base model with LoRA applied as `run_setup.load_lora_model` builds it,
    every value a ShapeDtypeStruct placed on `mesh`, the base weights in `dtype` as the trainer loads them."""
    family = models.family_for_hf_config(hf_config)
    tunix_config = family.config_from_hf(hf_config, dtype)
    targets = resolve_target_modules(config, lora_lib.default_targets(family.name))
    regex = lora_lib.target_regex(family.name, targets, config.lora.lora_module_path)

    def build() -> nnx.Module:
        model = family.build(tunix_config, hf_config, models.tracing_rngs())
        return lora_lib.apply_lora(
            model, rank=config.lora.lora_rank, alpha=config.lora.lora_alpha, target_regex=regex, mesh=mesh,
            rslora=config.lora.use_rslora, dora=config.lora.use_dora, base_quantization=config.lora.base_quantization,
            rngs=models.tracing_rngs(config.seed),
        )

    model = nnx.eval_shape(build)
    for _, variable in nnx.to_flat_state(nnx.state(model)):
        variable.set_value(_abstract(variable, mesh, dtype))
    return model, family, tunix_config


@dataclasses.dataclass(frozen=True)
class AbstractStep:
    """The train step of a config as the trainer builds it, and its arguments as ShapeDtypeStructs placed on the
    mesh: what `compile_train_step` compiles, and what bench/chip_bench.py fills with random values to run."""

    mesh: jax.sharding.Mesh
    steps: step_lib.StepFunctions
    adapters: dict[str, jax.ShapeDtypeStruct]
    optimizer_state: Any
    base: nnx.State
    batch: dict[str, jax.ShapeDtypeStruct]
    flops: Any
    """metrics.LoraFlops of the model."""
    layers_scanned: int
    """Decoder layers inside the scan (0: unrolled)."""

    def arguments(self) -> tuple[Any, ...]:
        return self.adapters, self.optimizer_state, self.base, self.batch


def abstract_step(
    config: TrainConfig, hf_config: dict[str, Any], devices: Sequence[jax.Device], scan_layers: bool = True
) -> AbstractStep:
    """The train step of `config` (a concrete remat policy) over `devices`, and its abstract arguments."""
    mesh = mesh_lib.build_mesh(config.mesh, devices)
    dtype = run_setup.compute_dtype(config, devices[0].platform)
    model, family, tunix_config = abstract_lora_model(config, hf_config, mesh, dtype)
    flops = run_setup.model_flops(
        model, run_setup.attention_width(tunix_config), config.max_target_length, experts.active_shares(model)
    )
    period = family.layer_period(tunix_config) if scan_layers else None
    graphdef, layout, lora, base = step_lib.split_for_step(model, period)
    stacking = layout.stacking
    adapters = {
        name: jax.ShapeDtypeStruct(value.shape, jnp.float32, sharding=value.sharding)
        for name, value in layout.flat(lora).items()
    }
    optimizer = build_optimizer(config)
    opt_state = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        jax.eval_shape(optimizer.init, adapters),
        step_lib.optimizer_state_shardings(optimizer, adapters, mesh),
    )
    shardings = step_lib.step_shardings(adapters, opt_state, base, mesh)
    steps = step_lib.build_step_functions(
        graphdef, layout, optimizer, dtype, shardings, config.loss_chunk_length, config.remat_policy,
        run_setup.aux_loss_coef(config.router_aux_loss_coef, hf_config, model),
    )
    rows = mesh_lib.global_batch_rows(config.per_device_batch_size, mesh)
    shape = (config.gradient_accumulation_steps, rows, config.max_target_length)
    batch = {
        name: jax.ShapeDtypeStruct(shape, jnp.float32 if name == "weights" else jnp.int32, sharding=shardings["batch"])
        for name in step_lib.BATCH_FIELDS
    }
    return AbstractStep(mesh, steps, adapters, opt_state, base, batch, flops,
                        stacking.period * stacking.repeats if stacking else 0)


def compile_train_step(
    config: TrainConfig, hf_config: dict[str, Any], devices: Sequence[jax.Device], scan_layers: bool = True
) -> CompiledStep:
    """Compile the trainer's train step for `config` on `devices` (see module docstring); the compiler's
    errors (RESOURCE_EXHAUSTED when it does not fit) propagate. `scan_layers=False` unrolls the layers, as the
    trainer never does, so that the cost analysis counts every layer (bench/tpu_plan.py --executed-flops)."""
    started = time.perf_counter()
    step = abstract_step(config, hf_config, devices, scan_layers)
    with jax.set_mesh(step.mesh):
        compiled = step.steps.train.lower(*step.arguments()).compile()
    return describe_compiled(compiled, step, config, started)


def describe_compiled(compiled: Any, step: AbstractStep, config: TrainConfig, started: float) -> CompiledStep:
    """The figures of a compiled train step (`jax.stages.Compiled`) of `step`; `started`: when building began."""
    attention_block = splash.block_size(config.max_target_length) if splash.ran_in(compiled.as_text()) else None
    analysis = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    memory = StepMemory(
        arguments=analysis.argument_size_in_bytes,
        outputs=analysis.output_size_in_bytes,
        aliased=analysis.alias_size_in_bytes,
        temporaries=analysis.temp_size_in_bytes,
        base_weights=per_chip_bytes(step.base),
        adapters=per_chip_bytes(step.adapters),
        optimizer_state=per_chip_bytes(step.optimizer_state),
        batch=per_chip_bytes(step.batch),
    )
    flops = step.flops
    return CompiledStep(
        memory=memory,
        flops=cost.get("flops"),
        flops_per_token=flops.per_token,
        executed_flops_per_token=flops.executed_per_token(config.remat_policy, attention_block),
        attention_block=attention_block,
        kernel_flops_per_token=(
            0.0 if attention_block is None else flops.executed_attention_per_token(config.remat_policy, attention_block)
        ),
        tokens_per_device=config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps,
        compile_seconds=time.perf_counter() - started,
        devices=len(step.mesh.devices.flat),
        layers_scanned=step.layers_scanned,
        executable=compiled,
    )


OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"
"""How the TPU compiler's refusal of a step too large for the device's memory begins."""


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """What `choose_remat` found: the policy taken (the one that keeps the least when none fits) and why the ones
    with less recompute were not."""

    policy: str
    fits: bool
    step: CompiledStep | None
    """The taken policy's compiled step; None when the compiler refused it (`error`)."""
    error: str | None
    rejected: tuple[str, ...]
    """One line per policy tried before `policy` and refused, in order."""


def choose_remat(
    config: TrainConfig, hf_config: dict[str, Any], devices: Sequence[jax.Device], capacity_bytes: int
) -> RematChoice:
    """The remat policy with the least recompute (`REMAT_POLICIES` in order) whose train step, compiled for
    `devices`, needs at most `capacity_bytes` per device. The policy that keeps the least is compiled first: when
    even it does not fit, none does, and one compile says so (a LoRAJob too large for its chips)."""

    def compiled(policy: str) -> tuple[CompiledStep | None, str | None]:
        try:
            return compile_train_step(config.model_copy(update={"remat_policy": policy}), hf_config, devices), None
        except Exception as refusal:  # the compiler's RESOURCE_EXHAUSTED says by how much; anything else is a fault
            if OUT_OF_MEMORY not in str(refusal):
                raise
            return None, str(refusal).strip().splitlines()[0]

    *less_recompute, least_memory = REMAT_POLICIES
    fallback, error = compiled(least_memory)
    if fallback is None or fallback.memory.total > capacity_bytes:
        return RematChoice(least_memory, False, fallback, error, ())
    rejected: list[str] = []
    for policy in less_recompute:
        step, error = compiled(policy)
        if step is not None and step.memory.total <= capacity_bytes:
            return RematChoice(policy, True, step, None, tuple(rejected))
        rejected.append(f"{policy}: " + (error or f"{step.memory.total / 1e9:.2f} GB > {capacity_bytes / 1e9:.2f} GB"))
    return RematChoice(least_memory, True, fallback, None, tuple(rejected))
