"""Optimizer: AdamW with linear warmup and cosine (or linear/constant) decay, global-norm clipping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lorajob_trainer.contract.config import TrainConfig


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    peak = config.learning_rate
    warmup_steps = int(config.warmup_steps_fraction * config.steps)
    decay_steps = max(config.steps - warmup_steps, 1)
    final = peak * config.learning_rate_final_fraction
    if config.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.learning_rate_final_fraction)
    elif config.lr_schedule == "linear":
        decay = optax.linear_schedule(peak, final, decay_steps)
    else:
        decay = optax.constant_schedule(peak)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, warmup_steps)
    return optax.join_schedules([warmup, decay], boundaries=[warmup_steps])


def learning_rate_per_step(config: TrainConfig) -> np.ndarray:
    """The learning rate of optimizer steps 0 .. steps-1, computed once for reporting: evaluating the
    schedule at every step would queue device work behind the running training step."""
    return np.asarray(jax.jit(jax.vmap(learning_rate_schedule(config)))(jnp.arange(config.steps)))


def build_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate_schedule(config),
        b1=config.adam_b1,
        b2=config.adam_b2,
        eps=config.adam_eps,
        weight_decay=config.adam_weight_decay,
    )
    if config.gradient_clipping_threshold <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
