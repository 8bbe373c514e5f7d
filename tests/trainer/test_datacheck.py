"""The data check reads what the train step would read and says, before any accelerator is held, whether it
can be trained on and what `steps`, the global batch and `max_target_length` make of it."""

from __future__ import annotations

import pytest
from trainer_testkit import arithmetic_rows, base_args, preference_rows, tiny_checkpoint, write_jsonl

from lorajob_trainer import datacheck
from lorajob_trainer.contract import exit_codes
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.contract.records import last_data

EXAMPLES = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


def _args(model_dir, tmp_path, data, *overrides):
    return base_args(model_dir, tmp_path / "out", data, "steps=50", *overrides)


@pytest.fixture
def train_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(EXAMPLES))


def test_the_figures_of_good_data(model_dir, tmp_path, train_file):
    config = TrainConfig.from_args(_args(model_dir, tmp_path, train_file, "max_target_length=4096"))
    report = datacheck.check(config, devices=2)
    assert report.examples == EXAMPLES and 0 < report.trained_tokens < report.tokens
    assert (report.truncated_examples, report.truncated_trained_tokens) == (0, 0)
    assert report.rows_per_epoch == 1  # 40 short examples pack into one row of 4096 tokens
    assert report.rows_per_step == 4 * 2 * 1  # per_device_batch_size x devices x accumulation
    assert report.epochs == 8.0
    assert report.describe(50).startswith(f"{EXAMPLES} examples, {report.tokens:,} tokens")
    assert "50 steps x 8 rows = 400.00 epochs" in report.describe(50)


def test_truncation_and_unpacked_rows(model_dir, tmp_path, train_file):
    config = TrainConfig.from_args(_args(model_dir, tmp_path, train_file, "max_target_length=16", "packing=False"))
    report = datacheck.check(config, devices=1)
    assert report.truncated_examples == EXAMPLES and 0 < report.truncated_trained_tokens <= report.trained_tokens
    assert report.rows_per_epoch == EXAMPLES


def test_preference_pairs_count_both_conversations_and_two_unpacked_rows_each(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(EXAMPLES))
    config = TrainConfig.from_args(_args(model_dir, tmp_path, data, "method=dpo", "max_target_length=4096",
                                         "train_data_columns=['prompt','chosen','rejected']"))
    report = datacheck.check(config, devices=2)
    assert report.examples == EXAMPLES and 0 < report.trained_tokens < report.tokens
    assert report.rows_per_epoch == 2 * EXAMPLES  # a row per conversation, never packed
    assert report.rows_per_step == 2 * 4 * 2  # pairs per device x 2 rows x devices
    short = TrainConfig.from_args(_args(model_dir, tmp_path, data, "method=dpo", "max_target_length=16",
                                        "train_data_columns=['prompt','chosen','rejected']"))
    assert datacheck.check(short, devices=1).truncated_examples == EXAMPLES


@pytest.mark.parametrize("rows, columns, message", [
    ([], "['question','answer']", "dataset is empty"),
    ([{"prompt": "a", "completion": "b"}], "['question','answer']", "question"),
])
def test_bad_data_exits_with_the_data_code_and_says_what_is_wrong(model_dir, tmp_path, capsys, rows, columns, message):
    data = tmp_path / "bad.jsonl"
    data.write_text("") if not rows else write_jsonl(data, rows)
    code = datacheck.main(["--devices", "4", *_args(model_dir, tmp_path, data, f"train_data_columns={columns}")])
    assert code == exit_codes.DATA
    error = capsys.readouterr().err
    assert error.splitlines()[-1].startswith("data check failed: ") and message in error and "Traceback" not in error


def test_a_bad_key_exits_with_the_config_code(model_dir, tmp_path, train_file, capsys):
    assert datacheck.main(_args(model_dir, tmp_path, train_file, "no_such_key=1")) == exit_codes.CONFIG
    assert "no_such_key" in capsys.readouterr().err


def test_a_token_secret_without_its_key_exits_with_the_config_code(model_dir, tmp_path, train_file, capsys, monkeypatch):
    """The operator renders the token as an optional secretKeyRef and names its source: the check says what is missing."""
    monkeypatch.setenv("LORAJOB_HF_TOKEN_SECRET", "hf-token/token")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    assert datacheck.main(_args(model_dir, tmp_path, train_file)) == exit_codes.CONFIG
    assert capsys.readouterr().err.splitlines()[-1] == (
        "config error: the Hugging Face token is missing: no Secret hf-token with a non-empty key token in the "
        "LoRAJob's namespace (spec.credentials.huggingFaceToken)"
    )
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert datacheck.main(_args(model_dir, tmp_path, train_file)) == 0


def test_a_passing_check_prints_its_figures_as_the_one_line_the_operator_reads(model_dir, tmp_path, train_file, capsys):
    args = _args(model_dir, tmp_path, train_file, "max_target_length=16")
    assert datacheck.main(["--devices", "2", *args]) == 0
    record = last_data(capsys.readouterr().out)
    report = datacheck.check(TrainConfig.from_args(args), devices=2)
    assert record == report.record(50)
    assert record.epochs == 50 * report.epochs and 0 < record.truncated_share <= 1
