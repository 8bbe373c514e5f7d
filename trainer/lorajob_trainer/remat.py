"""Rematerialisation of the decoder layers: which activations the backward pass recomputes instead of keeping.

Policies (the names and meanings of MaxText's `remat_policy`):
  none     keep every activation of every layer (most memory, no recompute);
  minimal  keep the outputs of the weight matmuls (projections, MLP, LoRA), recompute the cheap rest
           (norms, RoPE, activations, attention scores and softmax), per layer;
  full     keep only each layer's input and recompute the whole layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Literal

import jax
from flax import nnx

RematPolicy = Literal["none", "minimal", "full"]

_SAVEABLE = {
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def saveable(policy: RematPolicy):
    """The `jax.checkpoint` policy of a remat policy other than "none"."""
    return _SAVEABLE[policy]


@contextlib.contextmanager
def rematerialised_layers(model: nnx.Module, policy: RematPolicy) -> Iterator[None]:
    """While active, each of `model.layers` runs under `nnx.remat` with `policy` (none: unchanged)."""
    if policy == "none":
        yield
        return
    layers = list(model.layers)
    originals = [type(layer) for layer in layers]
    for layer, original in zip(layers, originals):
        layer.__class__ = _rematerialised_class(original, policy)
    try:
        yield
    finally:
        for layer, original in zip(layers, originals):
            layer.__class__ = original


@functools.cache
def _rematerialised_class(cls: type, policy: RematPolicy) -> type:
    # A pure function of the layer's state under jax.checkpoint (nnx.remat would write the Qwix
    # adapters' Variables back across trace levels, which NNX refuses). Intermediates the layer
    # records (experts.RouterLogits) leave it as outputs and are set on the layer again.
    def __call__(self, *args, **kwargs):
        graphdef, state = nnx.split(self)

        def layer(state, *args, **kwargs):
            module = nnx.merge(graphdef, state)
            return cls.__call__(module, *args, **kwargs), nnx.pop(module, nnx.Intermediate)

        outputs, recorded = jax.checkpoint(layer, policy=_SAVEABLE[policy])(state, *args, **kwargs)
        nnx.update(self, recorded)
        return outputs

    return type(cls.__name__, (cls,), {"__call__": __call__})
