"""Which checkpoints a run keeps (the newest few and the best by eval loss) and which one export takes
(`--step latest | best | N`), on real Orbax checkpoints of small arrays."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from lorajob_trainer import checkpoint as ckpt
from lorajob_trainer import export
from lorajob_trainer.contract.records import CheckpointRecord, NoSuchCheckpoint, checkpoints_to_keep, choose_checkpoint

EVAL_LOSSES = {1: 0.5, 2: 0.9, 3: 1.0, 4: None, 5: 0.7}


def _metadata(step: int, eval_loss: float | None) -> ckpt.CheckpointMetadata:
    return ckpt.CheckpointMetadata(
        step=step, lora_rank=2, lora_alpha=4.0, target_modules=["q_proj"], lora_module_path="", base_model="tiny-qwen3",
        family="qwen3", load_parameters_path="/base", train_loss=2.0 / step, eval_loss=eval_loss, time=1000.0 + step,
    )


@pytest.fixture(scope="module")
def checkpoint_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    checkpointer = ckpt.Checkpointer(root, ckpt.StorageOptions(asynchronous=False, max_to_keep=2))
    lora = {"layers.0.attn.q_einsum.lora_a": jnp.ones((4, 2))}
    for step, eval_loss in EVAL_LOSSES.items():
        checkpointer.save(step, lora, {"count": jnp.array(step)}, jnp.zeros((1, 1), jnp.int32), _metadata(step, eval_loss))
        checkpointer.wait()
    kept = checkpointer.complete()
    checkpointer.close()
    return root, kept


def test_a_run_keeps_its_newest_checkpoints_and_the_best_one(checkpoint_root):
    root, kept = checkpoint_root
    assert [c.step for c in kept] == [1, 4, 5]  # 1 is the best (eval loss 0.5); 4 and 5 are the newest two
    assert sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) == [1, 4, 5]
    assert kept[0] == CheckpointRecord(1, 2.0, 0.5, 1001.0) and kept[1].eval_loss is None


def test_export_takes_the_step_asked_for(checkpoint_root):
    root, _ = checkpoint_root
    assert export.select_checkpoint(root, "best") == f"{root}/1"
    assert export.select_checkpoint(root, "4") == f"{root}/4"
    assert export.select_checkpoint(root, "latest") == str(root)  # its newest step is read
    with pytest.raises(export.ExportError, match=r"--step 2 .*no complete checkpoint at step 2 \(kept: 1, 4, 5\)"):
        export.select_checkpoint(root, "2")


@pytest.mark.parametrize("selector, checkpoints, chosen", [
    ("latest", [CheckpointRecord(3), CheckpointRecord(9), CheckpointRecord(6)], 9),
    ("best", [CheckpointRecord(3, eval_loss=0.4), CheckpointRecord(6, eval_loss=0.4), CheckpointRecord(9)], 6),
    ("6", [CheckpointRecord(3), CheckpointRecord(6)], 6),
])
def test_choose_checkpoint(selector, checkpoints, chosen):
    assert choose_checkpoint(selector, checkpoints).step == chosen


@pytest.mark.parametrize("selector, checkpoints, message", [
    ("latest", [], "no complete checkpoint"),
    ("best", [CheckpointRecord(3)], "no checkpoint has an eval loss .kept: 3.; set dataset.evalSplit"),
    ("7", [CheckpointRecord(3), CheckpointRecord(6)], r"no complete checkpoint at step 7 \(kept: 3, 6\)"),
])
def test_a_checkpoint_that_is_not_there_is_named(selector, checkpoints, message):
    with pytest.raises(NoSuchCheckpoint, match=message):
        choose_checkpoint(selector, checkpoints)


def test_without_eval_losses_only_the_newest_are_kept():
    assert checkpoints_to_keep([CheckpointRecord(step) for step in range(1, 6)], 3) == {3, 4, 5}
