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


HBM_REFUSAL = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (27.56G) "
               "exceeds available HBM (15.75G).")
SCOPED_VMEM_REFUSAL = (
    "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem while allocating on "
    "stack for %splash_mha_dkv_segmented_no_residuals.13 ... Scoped allocation with size 16.42M and limit 16.00M "
    "exceeded scoped vmem limit by 428.0K."
)
"""The TPU compiler's two refusals of 2026-12-07 (qwen3-30b-a3b without remat on one v5e chip; Gemma 4's step under
remat full, before its 256-wide heads got smaller kernel blocks), shortened."""


@pytest.mark.parametrize(("refusal", "too_large"), [(HBM_REFUSAL, True), (SCOPED_VMEM_REFUSAL, False)])
def test_only_the_devices_memory_makes_a_step_too_large(refusal, too_large, model_dir, tmp_path, monkeypatch):
    """auto steps past a policy whose step the device's memory cannot hold; a kernel's scoped VMEM overflow (also
    RESOURCE_EXHAUSTED) is no such verdict, since no policy or slice mends it: it reaches the caller as it is."""
    from lorajob_trainer import plan

    def refuse(config, hf_config, devices):
        raise RuntimeError(refusal)

    monkeypatch.setattr(plan, "compile_train_step", refuse)
    if too_large:
        choice = plan.choose_remat(config(model_dir, tmp_path), {}, [], capacity_bytes=2**30)
        assert not choice.fits and choice.step is None and choice.error == HBM_REFUSAL
    else:
        with pytest.raises(RuntimeError, match="CompileTimeScopedVmemOom"):
            plan.choose_remat(config(model_dir, tmp_path), {}, [], capacity_bytes=2**30)
