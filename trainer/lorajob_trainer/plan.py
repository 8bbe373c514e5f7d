"""The trainer's own train step, compiled for devices it does not run on (a TPU topology, without a TPU).

`compile_train_step(config, hf_config, devices)` builds the run the trainer builds (run.py), from config.json
alone: the model and its LoRA adapters as abstract arrays (`run.abstract_model`, nothing read or allocated)
with the shardings of the run's mesh over `devices`, and compiles the same jitted step. The compiler's memory and cost analyses are per JAX device: a chip, or half of
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

from lorajob_trainer import collectives
from lorajob_trainer import run as run_lib
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.contract.records import REMAT_POLICIES
from lorajob_trainer.models import experts, splash


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
    """The trained adapters and, for DPO, the reference adapters."""
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
    collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bytes one device sends to others per step, by collective kind, from the compiled step's HLO (collectives.py)."""
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    """The step's mesh axes and sizes (mesh.expert "auto" decided)."""
    weights_read_bytes: int = 0
    """Base-weight bytes one device reads per pass: every weight whole (gathered), the experts split over the
    expert axis only by it (`weights_read_per_pass`)."""
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


def array_bytes(shape: tuple[int, ...], dtype: Any, share: int = 1) -> int:
    """Bytes of a `share`-th of an array of `shape` and `dtype`, as a TPU holds it (`bits`)."""
    return math.ceil(math.prod(shape) * bits(dtype) / 8 / share)


def per_chip_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += array_bytes(shape, leaf.dtype)
    return total


def compile_train_step(
    config: TrainConfig, hf_config: dict[str, Any], devices: Sequence[jax.Device], scan_layers: bool = True
) -> CompiledStep:
    """Compile the trainer's train step for `config` on `devices` (see module docstring); the compiler's
    errors (RESOURCE_EXHAUSTED when it does not fit) propagate. `scan_layers=False` unrolls the layers, as the
    trainer never does, so that the cost analysis counts every layer (bench/tpu_plan.py --executed-flops)."""
    started = time.perf_counter()
    run = run_lib.abstract_run(config, hf_config, list(devices), scan_layers)
    arguments = run.arguments()
    with jax.set_mesh(run.mesh):
        compiled = run.steps.train.lower(*arguments).compile()
    return describe_compiled(compiled, run, arguments, started)


def describe_compiled(compiled: Any, run: run_lib.Run, arguments: tuple[Any, ...], started: float) -> CompiledStep:
    """The figures of a compiled train step (`jax.stages.Compiled`) of `run` for `arguments` (`Run.arguments`:
    adapters, optimizer state, base, batch and DPO's reference adapters, counted with the adapters); `started`: when
    building began."""
    head_dim = run.model.tunix_config.head_dim  # the kernel's blocks shrink for wide heads (Gemma's 256)
    attention_block = splash.block_size(run.shape.length, head_dim) if splash.ran_in(compiled.as_text()) else None
    analysis = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    adapters, optimizer_state, base, batch, *reference = arguments
    memory = StepMemory(
        arguments=analysis.argument_size_in_bytes,
        outputs=analysis.output_size_in_bytes,
        aliased=analysis.alias_size_in_bytes,
        temporaries=analysis.temp_size_in_bytes,
        base_weights=per_chip_bytes(base),
        adapters=per_chip_bytes(adapters) + sum(per_chip_bytes(r) for r in reference),
        optimizer_state=per_chip_bytes(optimizer_state),
        batch=per_chip_bytes(batch),
    )
    flops = run.flops
    return CompiledStep(
        memory=memory,
        flops=cost.get("flops"),
        flops_per_token=flops.per_token,
        executed_flops_per_token=flops.executed_per_token(run.remat_policy, attention_block),
        attention_block=attention_block,
        kernel_flops_per_token=(
            0.0 if attention_block is None else flops.executed_attention_per_token(run.remat_policy, attention_block)
        ),
        tokens_per_device=run.shape.tokens,
        compile_seconds=time.perf_counter() - started,
        devices=len(run.mesh.devices.flat),
        layers_scanned=run.layers_scanned,
        collective_bytes=collectives.collective_bytes(compiled.as_text()),
        mesh=dict(run.mesh.shape),
        weights_read_bytes=weights_read_per_pass(run.base, run.mesh),
        executable=compiled,
    )


def weights_read_per_pass(base: nnx.State, mesh: jax.sharding.Mesh) -> int:
    """Bytes of the base weights one device computes with in one pass over the layers: every weight gathered
    whole, except the routed experts' (`experts` modules), of which each device of the expert axis keeps its share."""
    total = 0
    for path, variable in nnx.to_flat_state(base):
        leaf = variable.get_value()
        share = mesh.shape[experts.EXPERT_AXIS] if experts.EXPERTS_NAME in map(str, path) else 1
        total += array_bytes(leaf.shape, leaf.dtype, share)
    return total


OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"
"""How the TPU compiler's refusal of a step too large for the device's memory begins."""
SCOPED_VMEM_OVERFLOW = "ScopedVmemOom"
"""The compiler's name for a kernel whose working set overflows its scoped VMEM (also RESOURCE_EXHAUSTED): set by the
kernel's blocks, not by the step's size, so no smaller batch, other remat policy or larger slice mends it."""


def too_large(refusal: Exception) -> bool:
    """Whether the compiler refused a step for the device's memory, the refusal a plan answers with another policy
    or more chips; any other refusal is a fault of the step's own, reported as it is."""
    text = str(refusal)
    return OUT_OF_MEMORY in text and SCOPED_VMEM_OVERFLOW not in text


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
            if not too_large(refusal):
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
