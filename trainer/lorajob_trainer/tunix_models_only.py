"""Imported before any `tunix.models` import: Tunix's model code without Tunix's trainers.

Not done in the package's `__init__`: the operator imports `lorajob_trainer.config` and must not see Tunix.
"""

import importlib.util
import sys


def register_tunix_without_its_api() -> None:
    """Make `import tunix.models...` skip tunix/__init__.py, which imports every Tunix trainer (RL,
    distillation, sampling) and through metrax's TensorBoard backend tensorboardX, and torch where it
    is installed: ~0.6 GiB of the trainer's peak RSS and seconds of start-up. The trainer uses only
    tunix.models; a process that imported the full package first keeps it."""
    if "tunix" in sys.modules:
        return
    spec = importlib.util.find_spec("tunix")
    if spec is not None:
        sys.modules["tunix"] = importlib.util.module_from_spec(spec)


register_tunix_without_its_api()
