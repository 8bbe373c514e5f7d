"""Process start-up: Pathways (single controller), multi-controller JAX, or one local process.

The operator's JobSets set the environment (its names: `contract.environment`); this is the one place that reads it.

- `JAX_PLATFORMS` containing `proxy`: Pathways. `pathwaysutils.initialize()` connects the
  controller to the proxy (`JAX_BACKEND_TARGET`); there is one process.
- `JAX_NUM_PROCESSES` > 1: multi-controller JAX (GPU, TPU without Pathways, CPU tests). Also needs
  `JAX_COORDINATOR_ADDRESS` (host or host:port, port defaults to `JAX_COORDINATOR_PORT`, 8476)
  and `JAX_PROCESS_ID`.
- otherwise nothing: a single process sees its local devices.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from lorajob_trainer.contract.environment import (
    DEFAULT_COORDINATOR_PORT, ENV_COORDINATOR_ADDRESS, ENV_COORDINATOR_PORT, ENV_NUM_PROCESSES, ENV_PLATFORMS,
    ENV_PROCESS_ID, PATHWAYS_PLATFORM,
)

log = logging.getLogger(__name__)

Mode = Literal["pathways", "multi-controller", "single"]


class DistributedConfigError(ValueError):
    """The distributed environment variables are incomplete or inconsistent."""


@dataclass(frozen=True)
class Launch:
    mode: Mode
    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0


def is_pathways(env: Mapping[str, str] = os.environ) -> bool:
    return PATHWAYS_PLATFORM in env.get(ENV_PLATFORMS, "")


def launch_from_env(env: Mapping[str, str] = os.environ) -> Launch:
    if is_pathways(env):
        return Launch("pathways")
    num_processes = _int_env(env, ENV_NUM_PROCESSES, default=1)
    if num_processes <= 1:
        return Launch("single")
    address = env.get(ENV_COORDINATOR_ADDRESS, "")
    if not address:
        raise DistributedConfigError(f"{ENV_NUM_PROCESSES}={num_processes} but {ENV_COORDINATOR_ADDRESS} is not set")
    if ":" not in address:
        address = f"{address}:{_int_env(env, ENV_COORDINATOR_PORT, default=DEFAULT_COORDINATOR_PORT)}"
    process_id = _int_env(env, ENV_PROCESS_ID, default=-1)
    if not 0 <= process_id < num_processes:
        raise DistributedConfigError(f"{ENV_PROCESS_ID} must be in [0, {num_processes}), got {env.get(ENV_PROCESS_ID)!r}")
    return Launch("multi-controller", address, num_processes, process_id)


def initialize(env: Mapping[str, str] = os.environ) -> Launch:
    """Connect this process to the others (if any). Call before any other JAX use."""
    launch = launch_from_env(env)
    if launch.mode == "pathways":
        import pathwaysutils

        pathwaysutils.initialize()
    elif launch.mode == "multi-controller":
        import jax

        jax.distributed.initialize(
            coordinator_address=launch.coordinator_address,
            num_processes=launch.num_processes,
            process_id=launch.process_id,
        )
    log.info("distributed start-up: %s", launch)
    return launch


def _int_env(env: Mapping[str, str], name: str, *, default: int) -> int:
    raw = env.get(name, "")
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise DistributedConfigError(f"{name} must be an integer, got {raw!r}") from None
