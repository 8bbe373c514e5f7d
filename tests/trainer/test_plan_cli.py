"""`lorajob plan`: a LoRAJob whose step does not fit its TPU chip is refused, with the smallest change that fits,
each judged by compiling the trainer's step for the chip (libtpu, no TPU).

The model is Qwen3 0.6B's width at two layers (the catalogue's config.json facts, depth cut so that each
compile takes seconds), on one v5e chip (16 GiB): a per-device batch of 48 rows of 4,096 tokens holds every
row's projection outputs and loss logits and does not fit under remat minimal; the planner offers 24 rows x 2
accumulation steps or smaller, the same global batch. Under remat auto, the default, the same LoRAJob fits as it
is: the plan takes the policy with the least recompute that fits, remat full (at 48 rows even remat attention,
which keeps only the attention's projections and output, holds too much).
"""

from __future__ import annotations

import pytest
import yaml

from lorajob_operator import planning
from lorajob_trainer.contract import catalog, fit, records

pytestmark = pytest.mark.slow(minutes=4)

LORAJOB = """
apiVersion: lorajob.dev/v1alpha1
kind: LoRAJob
metadata: {name: too-wide}
spec:
  model: {name: qwen3-0.6b, huggingFace: Qwen/Qwen3-0.6B}
  dataset: {name: openai/gsm8k, dataDir: main, columns: [question, answer]}
  training: {steps: 10, perDeviceBatchSize: 48, maxTargetLength: 4096, remat: minimal}
  compute: {backend: mcjax, tpu: {machineType: ct5lp-hightpu-1t, topology: 1x1}}
  output: {baseOutputDirectory: gs://bucket/out}
"""
ROWS = 48


@pytest.fixture
def two_layer_catalogue(monkeypatch):
    released = catalog.released_config

    def two_layers(name: str) -> dict:
        return dict(released(name), num_hidden_layers=2)

    monkeypatch.setattr(catalog, "released_config", two_layers)


def test_a_step_that_does_not_fit_gets_the_smallest_change_that_does(two_layer_catalogue):
    result = planning.plan_lorajob(yaml.safe_load(LORAJOB)).plan
    refused = result.attempt
    assert not refused.fits
    assert refused.error or refused.total_bytes > refused.capacity_bytes
    suggestion = result.suggestion
    assert suggestion.fits and suggestion.total_bytes <= suggestion.capacity_bytes
    target = suggestion.target
    assert target.per_device_batch_size < ROWS
    assert target.per_device_batch_size * target.gradient_accumulation_steps == ROWS
    assert result.tried[-1] is suggestion
    report = "\n".join(fit.format_plan(result))
    assert "smallest change that fits" in report and "does NOT fit" not in report.split("smallest")[1]
    # What the LoRAJob's CPU step says when it ends DoesNotFit, and the line status.plan is lifted from.
    refusal = fit.refusal(result)
    assert refusal.startswith(f"the train step does not fit {refused.target.short()}: ") and len(refusal) <= 300
    assert refusal.endswith(f"; fits (compiled): {target.short()}, {suggestion.total_bytes / 1e9:.2f} GB per chip")
    record = records.PlanRecord.from_line(result.record().line())
    assert record == result.record() and not record.fits and record.suggestion == target.describe()


@pytest.mark.large
def test_remat_auto_fits_the_same_lorajob_with_the_least_recompute_that_fits(two_layer_catalogue):
    doc = yaml.safe_load(LORAJOB)
    del doc["spec"]["training"]["remat"]
    result = planning.plan_lorajob(doc).plan
    attempt = result.attempt
    assert attempt.target.remat_policy == "auto" and result.tried == []
    assert attempt.fits and attempt.total_bytes <= attempt.capacity_bytes
    assert attempt.remat_policy == "full"  # the others hold too many of every row's activations
    assert [line.split(":")[0] for line in attempt.remat_rejected] == ["none", "minimal", "attention"]
    for rejected in attempt.remat_rejected[1:]:
        assert "exceeds available HBM" in rejected or " GB > " in rejected
    assert "remat auto: full (the least recompute that fits); none: " in "\n".join(fit.format_plan(result))
    record = records.PlanRecord.from_line(result.record().line())
    assert record == result.record() and record.fits and record.remat_policy == "full"


def test_a_gpu_lorajob_gets_the_analytic_estimate_saying_so(two_layer_catalogue):
    doc = yaml.safe_load(LORAJOB)
    doc["spec"]["compute"] = {"backend": "gpu", "gpu": {"accelerator": "nvidia-l4", "gpusPerNode": 2}}
    result = planning.plan_lorajob(doc).plan
    attempt = result.attempt
    assert attempt.analytic and attempt.compile_seconds is None and attempt.target.chips == 2
    # 48 rows x 4,096 tokens x 1,024 wide x 2 layers at remat "minimal"'s calibration: 30.6 GB of activations.
    assert attempt.memory["temporaries"] >= ROWS * 4096 * 1024 * 2 * fit.ACTIVATION_BYTES["minimal"]
    assert attempt.fits == (attempt.total_bytes <= int(24e9 * (1 - fit.SAFETY_MARGIN)))
    assert "analytic model" in "\n".join(fit.format_plan(result))


@pytest.mark.large
def test_a_tpu7x_plan_counts_each_tensorcore_as_a_device_with_half_the_chip(two_layer_catalogue):
    doc = yaml.safe_load(LORAJOB)
    doc["spec"]["training"] = {"steps": 10, "perDeviceBatchSize": 1, "maxTargetLength": 1024}
    doc["spec"]["compute"]["tpu"] = {"machineType": "tpu7x-standard-1t", "topology": "1x1x1"}
    result = planning.plan_lorajob(doc).plan
    attempt = result.attempt
    # One chip, two JAX devices of 96 GiB each (the compiler's own limit is 94.75 GiB), every figure per device.
    assert attempt.fits and attempt.target.chips == 1 and attempt.devices_per_chip == 2
    assert attempt.capacity_bytes == int(96 * 2**30 * (1 - fit.SAFETY_MARGIN))
    # The device's compute at half the chip's peak; the chip runs both devices' tokens.
    assert attempt.mfu * attempt.step_seconds == pytest.approx(attempt.flops_per_step / (4614e12 / 2))
    assert attempt.tokens_per_second_per_chip == pytest.approx(2 * 1024 / attempt.step_seconds)
    assert "HBM per device (2 per chip)" in "\n".join(fit.format_plan(result))
