"""Device mesh from named axes: `data` across slices (DCN), `fsdp`, `expert` and `tp` within a slice.

The axis names `fsdp` and `tp` are the ones Tunix model sharding configs use; `data` and `expert` are
ours. `expert` splits the routed experts' stacked weights and their adapters along the expert
dimension (with `fsdp`: models/experts.EXPERT_AXES); every other weight that `fsdp` splits is split over
`expert` too (FSDP over both, as MaxText shards its dense weights over its expert axis), and replicated
over `data`. Batches are split over (`data`, `fsdp`, `expert`); LoRA adapters inherit their base
layer's sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lorajob_trainer.contract.config import MeshConfig

FSDP = "fsdp"
EXPERT = "expert"
AXES = ("data", FSDP, EXPERT, "tp")
BATCH_AXES = ("data", FSDP, EXPERT)


class MeshError(ValueError):
    """The requested mesh does not fit the available devices."""


def mesh_shape(config: MeshConfig, num_devices: int, num_slices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, expert, tp) with -1 entries filled in; MeshError if it does not use every device exactly."""
    data = num_slices if config.data == -1 else config.data
    expert = config.expert_degree
    fixed = data * expert * config.tensor
    if num_devices % fixed:
        raise MeshError(
            f"mesh.data={data} x mesh.expert={expert} x mesh.tensor={config.tensor} does not divide "
            f"{num_devices} devices"
        )
    fsdp = num_devices // fixed if config.fsdp == -1 else config.fsdp
    if fsdp * fixed != num_devices:
        raise MeshError(
            f"mesh data={data} x fsdp={fsdp} x expert={expert} x tensor={config.tensor} = {fsdp * fixed} "
            f"devices, but {num_devices} are available"
        )
    return data, fsdp, expert, config.tensor


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    num_slices = 1 + max(getattr(device, "slice_index", 0) or 0 for device in devices)
    shape = mesh_shape(config, len(devices), num_slices)
    if num_slices > 1:
        if shape[0] % num_slices:
            raise MeshError(f"mesh.data={shape[0]} must be a multiple of the {num_slices} slices")
        ici = (shape[0] // num_slices, *shape[1:])
        grid = mesh_utils.create_hybrid_device_mesh(ici, (num_slices, 1, 1, 1), devices)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, AXES)


def is_tpu(mesh: jax.sharding.AbstractMesh | None) -> bool:
    """Whether `mesh` (the one a function is traced under, or None) is made of TPUs: where the Pallas TPU kernels
    run."""
    return mesh is not None and not mesh.empty and mesh.abstract_device.platform == "tpu"


def host_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The trainer's axes over this process's devices (all on fsdp), for work outside training: convert, export."""
    return build_mesh(MeshConfig(), jax.local_devices() if devices is None else devices)


def batch_sharding(mesh: Mesh, leading_dims: int = 1) -> NamedSharding:
    """Sharding of `[leading..., batch, ...]` arrays: batch split over the data-parallel axes."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading_dims), BATCH_AXES))


def global_batch_rows(per_device_batch_size: int, mesh: Mesh) -> int:
    """Rows of one micro-batch of the whole mesh: `per_device_batch_size` per device (MaxText's meaning), every
    device counted, a tensor-parallel one too."""
    return per_device_batch_size * mesh.size


def data_parallel_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def local_batch_rows(sharding: NamedSharding, global_shape: tuple[int, ...], batch_dim: int) -> range:
    """The contiguous range of batch rows whose data lives on this process's devices."""
    starts, stops = [], []
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        rows = index[batch_dim]
        starts.append(rows.start or 0)
        stops.append(global_shape[batch_dim] if rows.stop is None else rows.stop)
    covered = np.zeros(global_shape[batch_dim], dtype=bool)
    for start, stop in zip(starts, stops):
        covered[start:stop] = True
    first, last = min(starts), max(stops)
    if not covered[first:last].all():
        raise MeshError("this process's devices hold a non-contiguous set of batch rows; reorder the mesh devices")
    return range(first, last)


def named_sharding(mesh: Mesh, axis_names: tuple[str | None, ...] | None, shape: tuple[int, ...]) -> NamedSharding:
    """NamedSharding from Tunix logical axis names; axes absent from `mesh` or not dividing the dim replicate."""
    spec = []
    for dim, name in zip(shape, axis_names or (None,) * len(shape)):
        usable = _usable_axes(mesh, name)
        size = math.prod(mesh.shape[n] for n in usable)
        spec.append((usable if len(usable) > 1 else usable[0]) if usable and dim % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def axis_moved(sharding: Any, ndim: int, source: int, destination: int) -> Any:
    """The sharding of an array of `ndim` dimensions placed by `sharding` once `jnp.moveaxis(x, source,
    destination)` has moved one of its axes: a NamedSharding's spec permuted the same way (each device keeps its
    own elements, so moving costs no communication); any other sharding as it is."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = [*sharding.spec, *([None] * (ndim - len(sharding.spec)))]
    spec.insert(destination, spec.pop(source))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _usable_axes(mesh: Mesh, name: str | tuple[str | None, ...] | None) -> tuple[str, ...]:
    """The mesh axes of one dimension's logical name(s) that `mesh` has."""
    names = name if isinstance(name, tuple) else (name,)
    return tuple(n for n in names if n is not None and n in mesh.shape)


def sharding_names(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a Tunix parameter was declared with (None: replicated)."""
    metadata = variable.get_metadata()
    return metadata.get("out_sharding") or metadata.get("sharding_names") or metadata.get("sharding")


def variable_sharding(mesh: Mesh, variable: nnx.Variable) -> NamedSharding:
    shape = tuple(variable.get_value().shape)
    names = _fsdp_over_expert(mesh, sharding_names(variable))
    if isinstance(variable, nnx.LoRAParam):
        names = _adapter_names(mesh, names, shape)
    return named_sharding(mesh, names, shape)


def _fsdp_over_expert(mesh: Mesh, names: tuple | None) -> tuple | None:
    """`names` with `expert` beside each `fsdp`, for a weight the expert axis does not already split (all but the
    routed experts'), on a mesh with an expert axis of more than one device: held whole on each of its devices,
    the dense weights of qwen3-30b-a3b would take 3 GB per chip."""
    if names is None or mesh.shape.get(EXPERT, 1) == 1:
        return names
    dims = [name if isinstance(name, tuple) else (name,) for name in names]
    if any(EXPERT in dim for dim in dims):
        return names
    return tuple((*dim, EXPERT) if FSDP in dim else name for dim, name in zip(dims, names))


TPU_TILE = (16, 128)
"""The second-minor and minor dimensions a TPU pads an array's shard to (bf16; float32 pads to 8 x 128)."""
ADAPTER_SPLIT_WASTE = 1.25
"""An adapter is split over fsdp only where its padded shards together take at most this much of it whole."""


def _adapter_names(mesh: Mesh, names: tuple | None, shape: tuple[int, ...]) -> tuple:
    """An adapter's axis names with `fsdp` added on one dimension, where `fsdp` splits none of them.

    An adapter inherits its base weight's names on its non-rank dimension only: B [rank, out] of a kernel split
    (fsdp, tp) gets (None, tp), so it, its gradient and its two Adam moments (float32) were whole on every chip
    of the fsdp axis (gemma3-27b on v6e-4: 0.74 GB per chip). Split over fsdp too, as FSDP splits the base
    weights, each is gathered for its matmul and its gradient reduce-scattered. The dimension is the one whose
    split leaves the smallest shard once padded to the TPU's tiles; none where no split saves most of it."""
    names = tuple(names or (None,) * len(shape))
    held = [_usable_axes(mesh, name) for name in names]
    fsdp = mesh.shape.get(FSDP, 1)
    if fsdp == 1 or any(FSDP in axes for axes in held):
        return names
    shard = [dim // math.prod(mesh.shape[n] for n in axes) for dim, axes in zip(shape, held)]
    best: tuple[int, int] | None = None
    for dim, axes in enumerate(held):
        split = math.prod(mesh.shape[n] for n in axes) * fsdp
        if shape[dim] % split:
            continue
        padded = _tiled_size(shard[:dim] + [shape[dim] // split] + shard[dim + 1:])
        if padded * fsdp <= ADAPTER_SPLIT_WASTE * _tiled_size(shard) and (best is None or padded < best[0]):
            best = (padded, dim)
    if best is None:
        return names
    dim = best[1]
    return names[:dim] + (held[dim] + (FSDP,),) + names[dim + 1:]


def _tiled_size(shape: list[int]) -> int:
    padded = list(shape)
    for offset, tile in zip((2, 1), TPU_TILE):
        if len(padded) >= offset:
            padded[-offset] = -(-padded[-offset] // tile) * tile
    return math.prod(padded)
