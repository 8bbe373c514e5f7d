"""Stopping on SIGTERM at a step every process agrees on, so the checkpoint saved there is collective.

Kubernetes sends SIGTERM to every pod of a step when Kueue preempts it, a node is drained, a spot
VM is reclaimed or the LoRAJob is suspended, then SIGKILL after `terminationGracePeriodSeconds`.
With several JAX processes, `jax.distributed.initialize` has already installed JAX's preemption
notifier (it catches SIGTERM and agrees with the other processes on a step to stop at); a single
process (or Pathways' single controller) catches SIGTERM itself.
"""

from __future__ import annotations

import signal
import threading

from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils


class StopSignal:
    """`due(step)`: SIGTERM arrived and `step` is where every process stops. Active inside `with`."""

    def __init__(self) -> None:
        self._received = threading.Event()
        self._previous = None

    @staticmethod
    def _coordinated() -> bool:
        return jax_distributed.global_state.preemption_sync_manager is not None

    def __enter__(self) -> StopSignal:
        if not self._coordinated() and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._received.set())
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def due(self, step: int) -> bool:
        if self._coordinated():
            return multihost_utils.reached_preemption_sync_point(step)
        return self._received.is_set()
