"""End-to-end training on a tiny generated Qwen3: the loss falls, only adapters train, one compile,
metrics / progress / checkpoints are written, and the loss respects packing and accumulation."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl

from lorajob_trainer import checkpoint as ckpt
from lorajob_trainer import lora as lora_lib
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import TrainConfig

STEPS = 30


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    """One 30-step run with evaluation, accumulation and checkpoints; the trainer is kept for inspection."""
    root = tmp_path_factory.mktemp("train")
    train_file = write_jsonl(root / "train.jsonl", arithmetic_rows(200))
    eval_file = write_jsonl(root / "eval.jsonl", arithmetic_rows(20, seed=1))
    config = TrainConfig.from_args(base_args(
        tiny_model, root / "out", train_file,
        f"steps={STEPS}", f"hf_eval_files=['{eval_file}']", "eval_interval=10", "eval_steps=2",
        "gradient_accumulation_steps=2", "checkpoint_period=10", "peak_tflops_per_device=1",
    ))
    trainer = train_lib.build_trainer(config)
    base_before = jax.tree.map(np.array, trainer.run.base)
    lora_before = {name: np.array(value) for name, value in trainer.lora.items()}
    result = trainer.train()
    trainer.close()
    records = [json.loads(line) for line in (config.run_directory / "metrics.jsonl").read_text().splitlines()]
    return {"config": config, "trainer": trainer, "result": result, "records": records,
            "base_before": base_before, "lora_before": lora_before}


def test_loss_goes_down(run):
    losses = [r["loss"] for r in run["records"] if "loss" in r]
    assert len(losses) == STEPS
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3]), losses
    evals = [r["eval_loss"] for r in run["records"] if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0]
    assert run["result"].final_step == STEPS


def test_train_and_eval_steps_compile_once(run):
    assert run["trainer"].run.steps.traces == {"train": 1, "eval": 1}


def test_only_lora_parameters_change(run):
    trainer = run["trainer"]
    unchanged = jax.tree.map(lambda before, after: np.array_equal(before, np.asarray(after)), run["base_before"], trainer.run.base)
    assert all(jax.tree.leaves(unchanged))
    moved = [name for name, before in run["lora_before"].items() if not np.array_equal(before, np.asarray(trainer.lora[name]))]
    assert sorted(moved) == sorted(run["lora_before"]), "every adapter tensor (A and B) is trained"
    assert all("lora" in name for name in trainer.lora)


def test_metrics_progress_and_tensorboard(run):
    step_records = [r for r in run["records"] if "loss" in r]
    for record in step_records:
        assert record["tokens_per_second"] > 0 and record["step_time_s"] > 0
        assert 0 < record["trained_tokens"] < record["real_tokens"] <= 2 * 4 * 64
        assert record["mfu"] is not None and record["mfu"] > 0
    # The rate the step used: warmup over 3 steps from 0 (optax counts from 0), then cosine to 10 % of the peak.
    peak, warmup = 1e-2, 3
    for record in step_records:
        count = record["step"] - 1
        progress = max(count - warmup, 0) / (STEPS - warmup)
        expected = peak * count / warmup if count < warmup else peak * (0.9 * 0.5 * (1 + math.cos(math.pi * progress)) + 0.1)
        assert record["learning_rate"] == pytest.approx(expected, rel=1e-5, abs=1e-12), record["step"]
    progress = json.loads((run["config"].run_directory / "progress.json").read_text())
    assert progress["state"] == "succeeded" and progress["step"] == progress["total_steps"] == STEPS
    assert progress["loss"] == pytest.approx(step_records[-1]["loss"])
    assert list((run["config"].run_directory / "tensorboard").glob("events.out.tfevents.*"))


def test_checkpoints_hold_adapter_and_metadata_export_can_read(run):
    config = run["config"]
    assert sorted(int(p.name) for p in config.checkpoint_directory.iterdir() if p.name.isdigit()) == [10, 20, 30]
    params, metadata = lora_lib.load_adapter_checkpoint(config.checkpoint_directory)
    assert metadata.step == STEPS and metadata.lora_rank == 4 and metadata.lora_alpha == 8.0
    assert metadata.base_model == "tiny-qwen3" and metadata.family == "qwen3"
    assert metadata.target_modules == lora_lib.default_targets("qwen3")
    trained = run["trainer"].lora
    assert set(params) == set(trained)
    for name, value in params.items():
        np.testing.assert_array_equal(value, np.asarray(trained[name]))


def test_every_progress_record_lists_the_kept_checkpoints_with_their_losses(run):
    config = run["config"]
    progress = json.loads((config.run_directory / "progress.json").read_text())
    losses = {r["step"]: r["loss"] for r in run["records"] if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in run["records"] if "eval_loss" in r}
    assert [c["step"] for c in progress["checkpoints"]] == [10, 20, 30]
    for listed in progress["checkpoints"]:
        assert listed["train_loss"] == pytest.approx(losses[listed["step"]])
        assert listed["eval_loss"] == pytest.approx(evals[listed["step"]])
    assert (progress["eval_step"], progress["eval_loss"]) == (30, pytest.approx(evals[30]))
    on_disk = ckpt.complete_checkpoints(config.checkpoint_directory)
    assert [(c.step, c.train_loss, c.eval_loss) for c in on_disk] == [
        (c["step"], c["train_loss"], c["eval_loss"]) for c in progress["checkpoints"]]


def test_mfu_counts_lora_cost_not_full_finetuning(run):
    flops = run["trainer"].run.flops
    # Tiny Qwen3 with untied lm_head: 2 layers of q,k,v,o (64x64, 64x32, 64x32, 64x64) + MLP (3 x 64x128) + lm_head 64x256.
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128
    assert flops.frozen_matmul_params == 2 * per_layer + 64 * 256
    assert flops.attention_width == 2 * 4 * 16
    expected = 4 * flops.frozen_matmul_params + 6 * 64 * flops.attention_width + 6 * flops.adapter_params
    assert flops.per_token == expected


def test_packing_never_attends_across_segments(run):
    """Two examples packed in one row give exactly the token losses they give in rows of their own."""
    trainer = run["trainer"]
    model = trainer.run.model.model
    first, second = np.arange(3, 13, dtype=np.int32), np.arange(20, 27, dtype=np.int32)

    def row(*examples):
        tokens = np.zeros(24, np.int32)
        segments = np.zeros(24, np.int32)
        positions = np.zeros(24, np.int32)
        start = 0
        for segment, example in enumerate(examples, start=1):
            tokens[start:start + len(example)] = example
            segments[start:start + len(example)] = segment
            positions[start:start + len(example)] = np.arange(len(example))
            start += len(example)
        return tokens, segments, positions

    def logits(tokens, segments, positions):
        return np.asarray(train_lib.models.forward(
            model, jnp.asarray(tokens[None]), jnp.asarray(positions[None]), jnp.asarray(segments[None])
        )[0])

    packed = logits(*row(first, second))
    alone_first, alone_second = logits(*row(first)), logits(*row(second))
    np.testing.assert_allclose(packed[:10], alone_first[:10], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[10:17], alone_second[:7], rtol=1e-5, atol=1e-5)


def test_accumulation_equals_one_large_batch(run):
    """Two micro-batches of B rows update the adapters like one batch of 2B rows (per-token mean)."""
    trainer = run["trainer"]
    feed = trainer.train_feed
    batch = feed.next_batch(step=STEPS + 1)
    accumulation, rows, length = feed.global_shape
    single = {name: value.reshape(1, accumulation * rows, length) for name, value in batch.items()}

    def one_step(step_batch):
        lora = {name: jnp.array(value) for name, value in trainer.lora.items()}
        opt_state = jax.tree.map(jnp.array, trainer.opt_state)
        new_lora, _, step_metrics = trainer.run.steps.train(lora, opt_state, trainer.run.base, step_batch)
        return new_lora, step_metrics

    accumulated_lora, accumulated_metrics = one_step(batch)
    single_lora, single_metrics = one_step(single)
    assert float(accumulated_metrics["loss"]) == pytest.approx(float(single_metrics["loss"]), rel=1e-5)
    assert float(accumulated_metrics["trained_tokens"]) == float(single_metrics["trained_tokens"])
    for name in accumulated_lora:
        np.testing.assert_allclose(accumulated_lora[name], single_lora[name], rtol=1e-4, atol=1e-6)


def test_lora_restore_path_starts_from_an_earlier_adapter(run, tiny_model, tmp_path):
    config = run["config"]
    train_file = Path(config.hf_train_files[0])
    restarted = TrainConfig.from_args(base_args(
        tiny_model, tmp_path / "out", train_file, "steps=1", "learning_rate=1e-9", "warmup_steps_fraction=0",
        f"lora.lora_restore_path={config.checkpoint_directory / '20'}", "enable_checkpointing=False",
    ))
    trainer = train_lib.build_trainer(restarted)
    trainer.train()
    trainer.close()
    params, _ = lora_lib.load_adapter_checkpoint(config.checkpoint_directory / "20")
    for name, value in params.items():
        np.testing.assert_allclose(np.asarray(trainer.lora[name]), value, atol=1e-6)


def test_invalid_config_exits_2_naming_the_key(capsys, monkeypatch):
    package_logger = logging.getLogger("lorajob_trainer")  # main() configures it; undo after the test
    for attribute in ("handlers", "propagate", "level"):
        monkeypatch.setattr(package_logger, attribute, getattr(package_logger, attribute))
    assert train_lib.main(["run_name=x", "lora.rank=4"]) == 2
    assert "lora.rank" in capsys.readouterr().err


def test_peak_memory_is_this_process_not_the_parent_it_was_started_from():
    """A trainer launched from a large parent (a test runner, a launcher) reports its own peak."""
    import subprocess
    import sys

    parent = bytearray(512 * 2**20)
    parent[:: 4096] = b"\1" * len(parent[:: 4096])  # touch every page: 512 MiB resident here
    code = "from lorajob_trainer.metrics import peak_host_memory_bytes; print(peak_host_memory_bytes())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(child.stdout) < 256 * 2**20, f"child reports {int(child.stdout) / 2**20:.0f} MiB"
    del parent
