"""The TPU and GPU machine catalogue: one place for what each machine type allows."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TpuMachine:
    generation: str
    accelerator: str
    """Value of the node label cloud.google.com/gke-tpu-accelerator."""
    chips_per_vm: int
    topologies: tuple[str, ...]
    pathways_type: str
    """Pathways resource manager `--instance_type` prefix (e.g. tpuv6e:16x16)."""


_TOPOLOGIES_2D = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_TOPOLOGIES_3D = (
    "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8",
    "8x8x8", "8x8x16", "8x16x16", "16x16x16", "16x16x24",
)
_V6E = TpuMachine("v6e", "tpu-v6e-slice", 4, _TOPOLOGIES_2D, "tpuv6e")

TPU_MACHINES: dict[str, TpuMachine] = {
    "ct6e-standard-4t": _V6E,
    # The name GKE's Cluster Toolkit and MaxText's tutorials use for the same v6e machine.
    "ct6e-hightpu-4t": _V6E,
    "ct5p-hightpu-4t": TpuMachine("v5p", "tpu-v5p-slice", 4, _TOPOLOGIES_3D, "tpuv5"),
    "ct5lp-hightpu-4t": TpuMachine("v5e", "tpu-v5-lite-podslice", 4, _TOPOLOGIES_2D, "tpuv5e"),
}

GPU_ACCELERATORS: tuple[str, ...] = (
    "nvidia-h100-80gb",
    "nvidia-h100-mega-80gb",
    "nvidia-h200-141gb",
    "nvidia-b200",
    "nvidia-a100-80gb",
    "nvidia-l4",
)
"""Values of the node label cloud.google.com/gke-accelerator that lorajob schedules onto."""


def chips_in(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def vms_per_slice(machine_type: str, topology: str) -> int:
    machine = TPU_MACHINES[machine_type]
    return max(1, chips_in(topology) // machine.chips_per_vm)
