"""Preference runs of the trainer on the tiny model: the pairs' rows, a DPO run that learns the generated preference
and evaluates both models' preference accuracy, an ORPO run, and the config's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from lorajob_trainer import data as data_lib
from lorajob_trainer import metrics, train
from lorajob_trainer.contract.config import ConfigError, TrainConfig
from lorajob_trainer.contract.records import EvalRecord
from trainer_testkit import base_args, preference_rows, tiny_checkpoint, write_jsonl

pytestmark = pytest.mark.slow(minutes=2)
PREFERENCE_COLUMNS = "train_data_columns=['prompt','chosen','rejected']"


class Pairs:
    """A stand-in encoder of pair i: chosen tokens [i, 100, 101], rejected [i, 200], answers masked."""

    def __call__(self, index: int) -> data_lib.EncodedPair:
        return data_lib.EncodedPair(
            data_lib.EncodedExample(np.array([index, 100, 101], np.int32), np.array([False, True, True])),
            data_lib.EncodedExample(np.array([index, 200], np.int32), np.array([False, True])),
        )


def test_each_pair_fills_two_rows_and_a_restored_reader_goes_on_where_it_stopped():
    options = data_lib.PackingOptions(seq_len=4, shuffle=False)
    rows = data_lib.PairedRows(10, Pairs(), row_ids=[2, 3, 4, 5], total_rows=6, options=options)
    batch = rows.next_rows(step=1)
    assert batch["inputs"][:, 0].tolist() == [1, 1, 2, 2]  # pair slots 1 and 2 read examples 1 and 2
    assert batch["targets"][0].tolist() == [100, 101, 0, 0] and batch["targets"][1].tolist() == [200, 0, 0, 0]
    assert batch["weights"][0].tolist() == [1, 1, 0, 0] and batch["weights"][1].tolist() == [1, 0, 0, 0]
    assert rows.state().tolist() == [1, 1, 1, 1]
    resumed = data_lib.PairedRows(10, Pairs(), row_ids=[2, 3, 4, 5], total_rows=6, options=options)
    resumed.restore(rows.state())
    assert resumed.next_rows(step=2)["inputs"][:, 0].tolist() == rows.next_rows(step=2)["inputs"][:, 0].tolist() == [
        4, 4, 5, 5]
    with pytest.raises(ValueError, match="two rows must be read together"):
        data_lib.PairedRows(10, Pairs(), row_ids=[1, 2], total_rows=6, options=options)


def test_conversational_pairs_must_share_all_but_the_answer():
    good = {"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    prompt, chosen, rejected = data_lib.to_preference_messages(good, ["chosen", "rejected"])
    assert (prompt, chosen[0]["content"], rejected[0]["content"]) == ([{"role": "user", "content": "q"}], "a", "b")
    other = {**good, "rejected": [{"role": "user", "content": "another"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(data_lib.DataError, match="differ only in their last message"):
        data_lib.to_preference_messages(other, ["chosen", "rejected"])


@pytest.mark.parametrize(("arguments", "message"), [
    (["method=dpo", "train_data_columns=['question','answer']"], "a preference method"),
    (["train_data_columns=['prompt','chosen','rejected']"], "a preference method"),
    (["method=dpo", PREFERENCE_COLUMNS, "preference.label_smoothing=0.1"], "applies to loss_type=robust only"),
])
def test_a_method_and_a_layout_that_do_not_match_are_refused(tmp_path, arguments, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_args(base_args(tmp_path, tmp_path, tmp_path / "t.jsonl", "steps=1", *arguments))


@pytest.fixture(scope="module")
def preference_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    return (tiny_checkpoint(root / "model"), write_jsonl(root / "train.jsonl", preference_rows(200)),
            write_jsonl(root / "eval.jsonl", preference_rows(16, seed=1)), root)


def run_method(preference_files, method: str, *extra: str, name: str = "") -> tuple[TrainConfig, list[dict]]:
    model, train_file, eval_file, root = preference_files
    config = TrainConfig.from_args(base_args(
        model, root / (name or method), train_file, f"method={method}", PREFERENCE_COLUMNS, "steps=12", "eval_interval=6",
        "eval_steps=4", f"hf_eval_files=['{eval_file}']", "checkpoint_period=6", "learning_rate=3e-3", *extra,
    ))
    train.train(config)
    return config, metrics.read_metrics(Path(config.layout.metrics))


def test_a_dpo_run_learns_the_preference_and_the_evaluation_ranks_both_models(preference_files):
    config, records = run_method(preference_files, "dpo", "generation_eval.enabled=true",
                                 "generation_eval.scorer=contains", "generation_eval.max_new_tokens=8",
                                 "generation_eval.examples=4")
    steps = [r for r in records if "reward_accuracy" in r]
    evaluations = [r for r in records if "eval_preference_accuracy" in r]
    # Step 1: the policy is the reference; its margins differ from 0 by float32 rounding only (the differentiated
    # forward and the reference's are compiled apart), so its reward accuracy is noise.
    assert len(steps) == 12 and abs(steps[0]["reward_margin"]) < 1e-3, steps[0]
    assert steps[-1]["reward_accuracy"] >= 0.9 and steps[-1]["reward_margin"] > 0.1, steps[-1]
    assert [r["step"] for r in evaluations] == [6, 12] and evaluations[-1]["eval_preference_accuracy"] >= 0.9
    record = EvalRecord.from_json(json.loads(Path(config.layout.evaluation).read_text()))
    assert record.adapter.preference_accuracy > record.base.preference_accuracy, record
    progress = json.loads(Path(config.layout.progress).read_text())
    assert progress["reward_accuracy"] == steps[-1]["reward_accuracy"], progress


def test_a_qlora_dpo_run_takes_its_reference_from_the_quantised_base_and_learns(preference_files):
    """The reference is the policy's own int8 base with the adapters as initialised: at step 1 the margins are 0 up
    to float32 rounding. A reference from the unquantised weights would be off by the quantisation error: step 1's
    log-probabilities differ by 0.04 (chosen) and 0.01 (rejected) between this base and the unquantised one, a margin
    of about 5e-3 at beta 0.1."""
    _, records = run_method(preference_files, "dpo", "lora.base_quantization=int8", name="dpo-int8")
    steps = [r for r in records if "reward_accuracy" in r]
    assert len(steps) == 12 and abs(steps[0]["reward_margin"]) < 5e-4, steps[0]
    assert steps[-1]["reward_accuracy"] >= 0.9 and steps[-1]["reward_margin"] > 0.1, steps[-1]


def test_an_orpo_run_lowers_its_chosen_answers_loss_without_a_reference(preference_files):
    _, records = run_method(preference_files, "orpo")
    steps = [r for r in records if "nll_loss" in r]
    assert len(steps) == 12 and steps[-1]["nll_loss"] < 0.8 * steps[0]["nll_loss"], (steps[0], steps[-1])
    assert steps[-1]["reward_margin"] > 0 and np.isfinite([r["loss"] for r in steps]).all()
