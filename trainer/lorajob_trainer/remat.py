"""Rematerialisation of the decoder layers: which activations the backward pass recomputes instead of keeping.

Policies (MaxText's `remat_policy` names where it has them), applied to each decoder layer
(models/decoder.py `call_layer`), least recompute and most memory first:
  none       keep every activation of every layer (no recompute);
  minimal    keep each projection's output (the weight matmul's with its adapter's added) and the attention
             kernel's, recompute the cheap rest (norms, RoPE, activations, the adapters' rank-wide products;
             dense attention's scores and softmax);
  attention  keep the attention's query, key and value projections and the attention kernel's output, recompute
             the MLP (most of a layer's matmuls, none of its attention);
  full       keep only each layer's input and recompute the whole layer.
The setting `auto` (the default) runs the first of these whose step fits the devices, as the compiler judges
it (`plan.choose_remat`; the fit check records its choice for the train step: `train.remat_for_run`).
"""

from __future__ import annotations

import jax

from lorajob_trainer.contract.records import REMAT_POLICIES, RematPolicy

PROJECTION_OUTPUTS = "projection_outputs"
"""The `jax.checkpoint_name` of every adapted or frozen projection's output in a decoder layer, its adapter's
contribution added (lora.LoraProvider): kept once, not as the base matmul's and the adapter's two outputs of the
same width."""
PROJECTIONS = "attention_projections"
"""The `jax.checkpoint_name` of the attention's query, key and value projections (models/attention.py)."""
KERNEL_OUTPUT = "attention_kernel_output"
"""The name the splash kernel gives what its backward pass needs of its forward (its output and log-sum-exp):
kept, the backward does not run the kernel's forward again (models/splash.py)."""

_SAVEABLE = {
    "minimal": jax.checkpoint_policies.save_only_these_names(PROJECTION_OUTPUTS, KERNEL_OUTPUT),
    "attention": jax.checkpoint_policies.save_only_these_names(PROJECTIONS, KERNEL_OUTPUT),
    "full": jax.checkpoint_policies.nothing_saveable,
}
assert set(REMAT_POLICIES) == {"none", *_SAVEABLE}


def saveable(policy: RematPolicy):
    """The `jax.checkpoint` policy of a remat policy other than "none"."""
    if policy not in _SAVEABLE:
        raise ValueError(f"remat policy {policy!r} has no checkpoint policy (one of {', '.join(_SAVEABLE)})")
    return _SAVEABLE[policy]
