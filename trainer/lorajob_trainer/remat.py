"""Rematerialisation of the decoder layers: which activations the backward pass recomputes instead of keeping.

Policies (the names and meanings of MaxText's `remat_policy`), applied to each decoder layer
(models/decoder.py `call_layer`):
  none     keep every activation of every layer (most memory, no recompute);
  minimal  keep the outputs of the weight matmuls (projections, MLP, LoRA), recompute the cheap rest
           (norms, RoPE, activations, attention scores and softmax), per layer;
  full     keep only each layer's input and recompute the whole layer.
The setting `auto` (the default) runs the first of these whose step fits the devices, as the compiler judges
it (`plan.choose_remat`; the fit check records its choice for the train step: `train.remat_for_run`).
"""

from __future__ import annotations

from typing import Literal

import jax

from lorajob_trainer.contract.records import REMAT_POLICIES

RematPolicy = Literal["none", "minimal", "full"]

_SAVEABLE = {
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
assert set(REMAT_POLICIES) == {"none", *_SAVEABLE}


def saveable(policy: RematPolicy):
    """The `jax.checkpoint` policy of a remat policy other than "none"."""
    if policy not in _SAVEABLE:
        raise ValueError(f"remat policy {policy!r} has no checkpoint policy (one of {', '.join(_SAVEABLE)})")
    return _SAVEABLE[policy]
