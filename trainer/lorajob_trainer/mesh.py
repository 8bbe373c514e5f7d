"""Device mesh from named axes: `data` across slices (DCN), `fsdp` and `tp` within a slice.

The axis names `fsdp` and `tp` are the ones Tunix model sharding configs use; `data` is ours.
Batches are split over (`data`, `fsdp`); LoRA adapters inherit their base layer's sharding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lorajob_trainer.config import MeshConfig

AXES = ("data", "fsdp", "tp")
BATCH_AXES = ("data", "fsdp")


class MeshError(ValueError):
    """The requested mesh does not fit the available devices."""


def mesh_shape(config: MeshConfig, num_devices: int, num_slices: int) -> tuple[int, int, int]:
    """(data, fsdp, tp) with -1 entries filled in; MeshError if it does not use every device exactly."""
    data = num_slices if config.data == -1 else config.data
    if num_devices % (data * config.tensor):
        raise MeshError(f"mesh.data={data} x mesh.tensor={config.tensor} does not divide {num_devices} devices")
    fsdp = num_devices // (data * config.tensor) if config.fsdp == -1 else config.fsdp
    if data * fsdp * config.tensor != num_devices:
        raise MeshError(
            f"mesh data={data} x fsdp={fsdp} x tensor={config.tensor} = {data * fsdp * config.tensor} "
            f"devices, but {num_devices} are available"
        )
    return data, fsdp, config.tensor


def build_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    num_slices = 1 + max(getattr(device, "slice_index", 0) or 0 for device in devices)
    shape = mesh_shape(config, len(devices), num_slices)
    if num_slices > 1:
        if shape[0] % num_slices:
            raise MeshError(f"mesh.data={shape[0]} must be a multiple of the {num_slices} slices")
        ici = (shape[0] // num_slices, shape[1], shape[2])
        grid = mesh_utils.create_hybrid_device_mesh(ici, (num_slices, 1, 1), devices)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, AXES)


def host_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The trainer's axes over this process's devices (all on fsdp), for work outside training: convert, export."""
    return build_mesh(MeshConfig(), jax.local_devices() if devices is None else devices)


def batch_sharding(mesh: Mesh, leading_dims: int = 1) -> NamedSharding:
    """Sharding of `[leading..., batch, ...]` arrays: batch split over the data-parallel axes."""
    return NamedSharding(mesh, PartitionSpec(*([None] * leading_dims), BATCH_AXES))


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
