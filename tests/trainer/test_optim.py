"""Learning-rate schedules, clipping and weight decay of the optimizer, against closed forms."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from lorajob_trainer import optim
from lorajob_trainer.contract.config import TrainConfig

PEAK = 1e-3


def config(*overrides: str) -> TrainConfig:
    return TrainConfig.from_args([
        "run_name=r", "base_output_directory=/tmp/out", "model_name=tiny-qwen3", "load_parameters_path=/tmp/model",
        "hf_train_files=['/tmp/train.jsonl']", "train_data_columns=['question','answer']", "steps=20",
        f"learning_rate={PEAK}", "warmup_steps_fraction=0.2", "learning_rate_final_fraction=0.1", *overrides,
    ])


def expected_rate(count: int, schedule: str, steps: int = 20, warmup: int = 4, final_fraction: float = 0.1) -> float:
    if count < warmup:
        return PEAK * count / warmup
    progress = min((count - warmup) / (steps - warmup), 1.0)
    if schedule == "cosine":
        return PEAK * ((1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * progress)) + final_fraction)
    if schedule == "linear":
        return PEAK + (PEAK * final_fraction - PEAK) * progress
    return PEAK


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_warmup_then_decay_to_the_final_fraction(schedule):
    rates = optim.learning_rate_per_step(config(f"lr_schedule={schedule}"))
    assert rates.shape == (20,)
    np.testing.assert_allclose(rates, [expected_rate(count, schedule) for count in range(20)], rtol=1e-5, atol=1e-12)
    assert rates[4] == pytest.approx(PEAK)


def test_no_warmup_starts_at_the_peak():
    rates = optim.learning_rate_per_step(config("warmup_steps_fraction=0", "lr_schedule=linear"))
    np.testing.assert_allclose(rates, [expected_rate(count, "linear", warmup=0) for count in range(20)], rtol=1e-5)


def first_update(cfg: TrainConfig, gradient: float) -> float:
    """The update of step 2 (step 1 has learning rate 0 under warmup, so warmup is off here)."""
    optimizer = optim.build_optimizer(cfg)
    params = {"w": jnp.zeros(4)}
    updates, _ = optimizer.update({"w": jnp.full(4, gradient)}, optimizer.init(params), params)
    return float(updates["w"][0])


def test_the_global_gradient_norm_is_clipped_to_the_threshold():
    # With a large epsilon Adam's step is ~ lr * g / eps, so it shows the gradient that reached Adam.
    common = ("warmup_steps_fraction=0", "lr_schedule=constant", "adam_eps=1000", "adam_b1=0", "adam_b2=0")
    clipped = first_update(config(*common, "gradient_clipping_threshold=1.0"), gradient=5.0)  # norm 10 -> 1
    unclipped = first_update(config(*common, "gradient_clipping_threshold=0"), gradient=5.0)
    assert unclipped == pytest.approx(-PEAK * 5.0 / (5.0 + 1000), rel=1e-4)
    assert clipped == pytest.approx(-PEAK * 0.5 / (0.5 + 1000), rel=1e-4)


def test_weight_decay_is_decoupled_and_scaled_by_the_learning_rate():
    optimizer = optim.build_optimizer(config("warmup_steps_fraction=0", "lr_schedule=constant",
                                             "adam_weight_decay=0.5"))
    params = {"w": jnp.full(3, 2.0)}
    updates, _ = optimizer.update({"w": jnp.zeros(3)}, optimizer.init(params), params)
    np.testing.assert_allclose(updates["w"], -PEAK * 0.5 * 2.0, rtol=1e-5)
