"""Each bad input to the trainer fails fast (before step 1) with a message naming the problem and the
documented exit code of `lorajob_trainer.contract.exit_codes` (what the operator turns into a Failed condition).

The real entry point (`train.main`) runs in this process on a tiny generated Qwen3 checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

from lorajob_trainer.contract import exit_codes
from lorajob_trainer import train as train_lib


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture
def run(tmp_path, tiny_model, capsys, monkeypatch):
    """`run(*overrides, model=..., data=...)` -> (exit code, stderr) of the trainer on question/answer data."""
    package_logger = logging.getLogger("lorajob_trainer")  # main() configures it; undo after the test
    for attribute in ("handlers", "propagate", "level"):
        monkeypatch.setattr(package_logger, attribute, getattr(package_logger, attribute))
    default_data = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(8))

    def run_trainer(*overrides: str, model: Path = tiny_model, data: Path = default_data,
                    output: Path = tmp_path / "out") -> tuple[int, str]:
        code = train_lib.main(base_args(model, output, data, "steps=2", "enable_tensorboard=False", *overrides))
        return code, capsys.readouterr().err

    return run_trainer


def assert_fails(outcome: tuple[int, str], code: int, *words: str) -> None:
    returncode, stderr = outcome
    assert returncode == code, f"exit {returncode}, expected {exit_codes.BY_CODE[code].name} ({code}):\n{stderr[-3000:]}"
    last_line = stderr.strip().splitlines()[-1]  # what Kubernetes keeps as the termination message
    assert all(word in last_line for word in words), f"{words} not in the last line: {last_line}"
    assert "Traceback" not in stderr


def test_an_unknown_config_key_is_named(run):
    assert_fails(run("lora.rank=4"), exit_codes.CONFIG, "lora.rank")


def test_a_malformed_config_value_is_named(run):
    assert_fails(run("steps=many"), exit_codes.CONFIG, "steps")


def test_a_dataset_missing_the_columns_is_named(run):
    assert_fails(run("train_data_columns=['prompt','completion']"), exit_codes.DATA, "prompt", "column")


def test_an_empty_dataset(run, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_fails(run(data=empty), exit_codes.DATA, "empty")


def test_a_chat_template_that_does_not_render(run, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for message in messages %}{{ message.content }")  # unclosed block and expression
    assert_fails(run(f"chat_template_path={template}"), exit_codes.DATA, "chat template", str(template))


def test_adapter_targets_the_model_does_not_have(run):
    assert_fails(run("lora.target_modules=['no_such_proj']"), exit_codes.MODEL, "no_such_proj")


def test_a_rank_larger_than_the_adapted_weights(run):
    assert_fails(run("lora.lora_rank=512"), exit_codes.MODEL, "lora.lora_rank=512", "k_proj")


def test_an_adapter_of_another_rank(run, tmp_path):
    assert run("checkpoint_period=1", "async_checkpointing=False", output=tmp_path / "earlier")[0] == 0
    earlier = tmp_path / "earlier" / "run" / "checkpoints" / "2"
    assert_fails(run("lora.lora_rank=8", f"lora.lora_restore_path={earlier}"), exit_codes.MODEL, "rank")


@pytest.mark.parametrize("option", ["use_rslora", "use_dora"])
def test_an_adapter_of_another_variant(run, tmp_path, option):
    """An rsLoRA or DoRA adapter (trained here) restored into a plain LoRA run: the same weights would make
    another update."""
    assert run("checkpoint_period=1", "async_checkpointing=False", f"lora.{option}=true",
               output=tmp_path / "earlier")[0] == 0
    earlier = tmp_path / "earlier" / "run" / "checkpoints" / "2"
    assert_fails(run(f"lora.lora_restore_path={earlier}"), exit_codes.MODEL, f"{option}=True", f"lora.{option}=False")


def test_a_truncated_safetensors_file(run, tiny_model, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert_fails(run(model=broken), exit_codes.MODEL, weights.name)


def test_a_checkpoint_of_another_model_in_the_run_directory(run, tmp_path):
    llama = tiny_checkpoint(tmp_path / "tiny-llama3", family="llama3")
    assert run("model_name=tiny-llama3", model=llama, output=tmp_path / "shared")[0] == 0
    assert_fails(run(output=tmp_path / "shared"), exit_codes.MODEL, "another run", "tiny-llama3", "tiny-qwen3")


def test_an_output_location_that_cannot_be_written(run, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert_fails(run(output=blocker / "out"), exit_codes.OUTPUT, str(blocker / "out"))


def test_the_user_guide_shows_the_exit_code_table():
    guide = (Path(__file__).resolve().parents[2] / "docs" / "user-guide.md").read_text()
    assert exit_codes.markdown_table() in guide

