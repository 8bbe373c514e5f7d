"""The TPU and GPU machine catalogue: one place for what each machine type allows.

Machine types, accelerator labels, chips per VM and slice topologies follow xpk's
`system_characteristics.py` (AI-Hypercomputer/xpk) and GKE's TPU machine-type tables, which list
the single-host shapes (1t/4t/8t) that xpk leaves out; Pathways `--instance_type` prefixes follow
the Pathways JobSets that GKE's tooling generates (`tpuv6e:16x16`, `tpu7x:4x4x4`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lorajob_trainer.contract.fit import Chip, TpuChip


@dataclass(frozen=True)
class TpuMachine:
    generation: str
    accelerator: str
    """Value of the node label cloud.google.com/gke-tpu-accelerator."""
    chips_per_vm: int
    topologies: tuple[str, ...]
    pathways_type: str
    """Pathways resource manager `--instance_type` prefix (e.g. tpuv6e:16x16)."""


_MULTI_HOST_2D = ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
"""v5e and v6e slices of several 4-chip VMs."""

_V5P_TOPOLOGIES = (
    "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x4x12", "4x8x8", "4x4x20", "4x8x12",
    "4x4x28", "8x8x8", "4x12x12", "4x8x20", "4x4x44", "8x8x12", "4x4x52", "4x8x28", "4x12x20",
    "8x8x16", "4x4x68", "8x12x12", "4x4x76", "8x8x20", "4x12x28", "4x8x44", "4x4x92", "8x12x16",
    "4x20x20", "4x8x52", "12x12x12", "8x8x28", "4x4x116", "8x12x20", "4x4x124", "8x16x16",
    "4x12x44", "4x8x68", "4x20x28", "12x12x16", "4x4x148", "4x8x76", "4x12x52", "8x16x20",
    "4x4x164", "8x12x28", "4x4x172", "8x8x44", "12x12x20", "4x8x92", "4x4x188", "12x16x16",
    "4x28x28", "8x20x20", "4x12x68", "8x8x52", "4x4x212", "12x12x24", "4x20x44", "8x16x28",
    "4x12x76", "4x8x116", "4x4x236", "12x16x20", "4x4x244", "4x8x124", "12x12x28", "16x16x16",
    "4x20x52", "8x12x44", "8x8x68", "4x12x92", "8x20x28", "12x16x24", "4x8x148", "12x20x20",
    "8x8x76", "4x28x44", "8x12x52", "16x16x20", "12x12x36", "4x8x164", "12x16x28", "4x20x68",
    "4x8x172", "4x12x116", "8x16x44", "12x20x24", "4x28x52", "8x8x92", "4x12x124", "4x8x188",
    "4x20x76", "16x16x24", "12x24x24", "16x20x28",
)

_V7X_TOPOLOGIES = (
    "2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x4x12", "4x4x20", "4x4x28", "4x4x44",
    "4x4x52", "4x4x68", "4x4x76", "4x4x92", "4x4x116", "4x4x124", "4x4x148", "4x4x164", "4x4x172",
    "4x4x188", "4x4x212", "4x4x236", "4x4x244", "4x8x8", "4x8x12", "4x8x20", "4x8x28", "4x8x44",
    "4x8x52", "4x8x68", "4x8x76", "4x8x92", "4x8x116", "4x8x124", "4x8x148", "4x8x164", "4x8x172",
    "4x8x188", "4x12x12", "4x12x20", "4x12x28", "4x12x44", "4x12x52", "4x12x68", "4x12x76",
    "4x12x92", "4x12x116", "4x12x124", "4x20x20", "4x20x28", "4x20x44", "4x20x52", "4x20x68",
    "4x20x76", "4x28x28", "4x28x44", "4x28x52", "8x8x8", "8x8x12", "8x8x16", "8x8x20", "8x8x28",
    "8x8x44", "8x8x52", "8x8x68", "8x8x76", "8x8x92", "8x12x12", "8x12x16", "8x12x20", "8x12x28",
    "8x12x44", "8x12x52", "8x16x16", "8x16x20", "8x16x28", "8x16x44", "8x20x20", "8x20x28",
    "12x12x12", "12x12x16", "12x12x20", "12x12x24", "12x12x28", "12x12x36", "12x16x16",
    "12x16x20", "12x16x24", "12x16x28", "12x20x20", "12x20x24", "12x24x24", "16x16x16",
    "16x16x20", "16x16x24", "16x16x32", "16x20x28", "16x24x24",
)


def _v5e(chips_per_vm: int, topologies: tuple[str, ...]) -> TpuMachine:
    return TpuMachine("v5e", "tpu-v5-lite-podslice", chips_per_vm, topologies, "tpuv5e")


def _v6e(chips_per_vm: int, topologies: tuple[str, ...]) -> TpuMachine:
    return TpuMachine("v6e", "tpu-v6e-slice", chips_per_vm, topologies, "tpuv6e")


def _v7x(chips_per_vm: int, topologies: tuple[str, ...]) -> TpuMachine:
    return TpuMachine("v7x", "tpu7x", chips_per_vm, topologies, "tpu7x")


TPU_MACHINES: dict[str, TpuMachine] = {
    # TPU v7x (Ironwood): 2 TensorCores (JAX devices) per chip.
    "tpu7x-standard-4t": _v7x(4, _V7X_TOPOLOGIES),
    "tpu7x-standard-1t": _v7x(1, ("1x1x1",)),
    # TPU v6e (Trillium): 2x2 on a 4-chip VM and 2x4 on an 8-chip VM are single-host slices.
    "ct6e-standard-4t": _v6e(4, ("2x2", *_MULTI_HOST_2D)),
    # The name GKE's Cluster Toolkit and MaxText's tutorials use for the same v6e machine.
    "ct6e-hightpu-4t": _v6e(4, ("2x2", *_MULTI_HOST_2D)),
    "ct6e-standard-8t": _v6e(8, ("2x4",)),
    "ct6e-standard-1t": _v6e(1, ("1x1",)),
    "ct5p-hightpu-4t": TpuMachine("v5p", "tpu-v5p-slice", 4, _V5P_TOPOLOGIES, "tpuv5"),
    "ct5lp-hightpu-4t": _v5e(4, ("2x2", *_MULTI_HOST_2D)),
    "ct5lp-hightpu-8t": _v5e(8, ("2x4",)),
    "ct5lp-hightpu-1t": _v5e(1, ("1x1",)),
}


GB = 10**9
GPU_CHIPS: dict[str, Chip] = {
    "nvidia-gb200": Chip(186 * GB, 2.5e15, 8.0e12, 1.8e12),
    "nvidia-b200": Chip(180 * GB, 2.25e15, 7.7e12, 1.8e12),
    "nvidia-h200-141gb": Chip(141 * GB, 989e12, 4.8e12, 900e9),
    "nvidia-h100-mega-80gb": Chip(80 * GB, 989e12, 3.35e12, 900e9),
    "nvidia-h100-80gb": Chip(80 * GB, 989e12, 3.35e12, 900e9),
    "nvidia-a100-80gb": Chip(80 * GB, 312e12, 2.039e12, 600e9),
    "nvidia-tesla-a100": Chip(40 * GB, 312e12, 1.555e12, 600e9),
    "nvidia-l4": Chip(24 * GB, 121e12, 300e9, 64e9),
}
"""Per-GPU facts from NVIDIA's datasheets (GB200 NVL72, HGX B200, H200, H100 SXM, A100, L4): HBM, dense bf16
tensor FLOP/s (without sparsity), HBM bandwidth, NVLink bandwidth per GPU (PCIe Gen4 for the L4), for the
analytic plan of a GPU LoRAJob."""

GPU_ACCELERATORS: tuple[str, ...] = tuple(GPU_CHIPS)
"""Values of the node label cloud.google.com/gke-accelerator that lorajob schedules onto (GKE's A4X,
A4, A3 Ultra, A3 Mega, A3 High, A2 Ultra, A2 and G2 machine families)."""


GIB = 2**30
TPU_CHIPS: dict[str, TpuChip] = {
    "v4": TpuChip(32 * GIB, 275e12, 1228e9, 2400e9 / 8, "v4"),
    "v5e": TpuChip(16 * GIB, 197e12, 819e9, 1600e9 / 8, "v5e"),
    "v5p": TpuChip(95 * GIB, 459e12, 2765e9, 4800e9 / 8, "v5p"),
    "v6e": TpuChip(32 * GIB, 918e12, 1640e9, 3584e9 / 8, "v6e"),
    "v7x": TpuChip(192 * GIB, 4614e12, 7380e9, 9600e9 / 8, "tpu7x", devices_per_chip=2),
}
"""Per-chip facts of each TPU generation from the Cloud TPU documentation's system-architecture pages
(cloud.google.com/tpu/docs/v4, v5e, v5p, v6e, tpu7x): HBM, peak bf16 FLOP/s, HBM bandwidth, ICI bandwidth per
chip (the docs' Gbps / 8), the name libtpu's topologies use, and JAX devices per chip (a tpu7x chip's two
TensorCores are two devices; the compiler gives each 94.75 GiB), for planning a step before it holds a TPU."""


def chips_in(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def vms_per_slice(machine_type: str, topology: str) -> int:
    machine = TPU_MACHINES[machine_type]
    return max(1, chips_in(topology) // machine.chips_per_vm)
