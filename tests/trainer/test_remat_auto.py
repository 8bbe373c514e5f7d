"""remat auto, the default: the fit check (`python -m lorajob_trainer.fit`, the TPU compiler without a TPU) records
the policy it chose in the run's plan.json, and the train step of the same config runs that policy; a policy the
config names is run as named; without a record, on devices that report no memory limit (this CPU), minimal."""

from __future__ import annotations

import jax
import pytest
from trainer_testkit import base_args, tiny_checkpoint

from lorajob_trainer import fit
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract import records
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.contract.fit import Request, Target, TpuChip

V5E = TpuChip(16 * 2**30, 197e12, 819e9, 200e9, "v5e")
"""One v5e chip, as the operator's catalogue describes it (accelerators.TPU_CHIPS)."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("model"))


def config(model_dir, out, *overrides: str) -> TrainConfig:
    return TrainConfig.from_args(base_args(model_dir, out, out / "unused.jsonl", "steps=1", *overrides))


def test_the_fit_check_records_its_choice_and_the_train_step_runs_it(model_dir, tmp_path):
    run = config(model_dir, tmp_path)
    assert run.remat_policy == "auto"  # the default
    request = Request(V5E, 1, (Target("ct5lp-hightpu-1t", "1x1", 1, 1, run.per_device_batch_size, 1, "auto"),))
    assert fit.main(["--request", request.to_json(), "--model-config", str(model_dir),
                     *base_args(model_dir, tmp_path, tmp_path / "unused.jsonl", "steps=1")]) == 0
    recorded = records.last_plan((tmp_path / "run" / "plan.json").read_text())
    assert recorded.fits and recorded.remat_policy == "none"  # a tiny model keeps every activation
    assert train_lib.remat_for_run(run, {}, jax.devices()) == "none"

    (tmp_path / "run" / "plan.json").write_text(
        records.PlanRecord(fits=True, target="t", chips=1, hbm_bytes_per_chip=1, capacity_bytes=2,
                            remat_policy="full").line() + "\n")
    assert train_lib.remat_for_run(run, {}, jax.devices()) == "full"
    named = config(model_dir, tmp_path, "remat_policy=minimal")
    assert train_lib.remat_for_run(named, {}, jax.devices()) == "minimal"  # a named policy is never replaced


def test_without_a_record_a_cpu_runs_minimal(model_dir, tmp_path):
    assert jax.devices()[0].platform == "cpu"
    assert train_lib.remat_for_run(config(model_dir, tmp_path), {}, jax.devices()) == "minimal"
    (tmp_path / "run").mkdir()
    refused = records.PlanRecord(fits=False, target="t", chips=1, hbm_bytes_per_chip=3, capacity_bytes=2,
                                  remat_policy="full")
    (tmp_path / "run" / "plan.json").write_text(refused.line() + "\n")
    assert train_lib.remat_for_run(config(model_dir, tmp_path), {}, jax.devices()) == "minimal"
