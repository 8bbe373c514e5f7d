"""Early stopping: training ends when the eval loss has not improved for `early_stopping_patience`
evaluations, with a checkpoint at the stop that export can take as the best."""

from __future__ import annotations

import json

import pytest
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

from lorajob_trainer import checkpoint as ckpt
from lorajob_trainer import export
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import ConfigError, TrainConfig
from lorajob_trainer.contract.records import STOPPED_EARLY


@pytest.mark.parametrize("losses, patience, min_delta, stops_at", [
    ([3.0, 2.0, 1.0, 0.5], 1, 0.0, None),  # always improving
    ([3.0, 3.0, 3.0], 2, 0.0, 3),  # an equal loss is no improvement
    ([3.0, 2.95, 2.92], 2, 0.1, 3),  # improvements smaller than min_delta do not count
    ([3.0, 3.1, 2.0, 2.5, 2.4], 2, 0.0, 5),  # the count restarts at an improvement
])
def test_plateau(losses, patience, min_delta, stops_at):
    plateau = train_lib.Plateau(patience, min_delta)
    stops = [index + 1 for index, loss in enumerate(losses) if plateau.update(loss)]
    assert (stops[0] if stops else None) == stops_at


def test_patience_without_evaluations_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="early_stopping_patience needs evaluations"):
        TrainConfig.from_args(base_args(tmp_path, tmp_path, tmp_path / "t.jsonl", "steps=4", "early_stopping_patience=2"))


def test_a_run_whose_eval_loss_stops_improving_ends_early_with_a_checkpoint_at_the_stop(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(100))
    eval_file = write_jsonl(tmp_path / "eval.jsonl", arithmetic_rows(8, seed=1))
    # No eval loss can improve by 100, so the second evaluation (step 8) ends the run.
    config = TrainConfig.from_args(base_args(
        model_dir, tmp_path / "out", train_file, "steps=20", f"hf_eval_files=['{eval_file}']", "eval_interval=4",
        "checkpoint_period=6", "early_stopping_patience=1", "early_stopping_min_delta=100",
        "enable_tensorboard=False", "async_checkpointing=False",
    ))
    result = train_lib.train(config)
    assert (result.stopped_early, result.final_step) == (True, 8)
    progress = json.loads((config.run_directory / "progress.json").read_text())
    assert progress["state"] == STOPPED_EARLY and progress["step"] == 8
    assert progress["message"].startswith("eval loss did not improve on ") and "in 1 evaluations" in progress["message"]
    kept = ckpt.complete_checkpoints(config.checkpoint_directory)
    assert [(c.step, c.eval_loss is not None) for c in kept] == [(6, False), (8, True)]
    assert export.select_checkpoint(config.checkpoint_directory, "best").endswith("/8")
