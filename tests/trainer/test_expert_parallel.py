"""Expert parallelism (models/experts.py, mesh.expert > 1) on 4 CPU devices against one device: the forward, the
loss and every adapter's gradient of Qwen3 MoE and Gemma 4 MoE, also when every token goes to one device's
experts; the dropped rows and padded slots the step reports; the compiled step's all-to-alls and the absence of
any all-gather of the experts' weights; what the collectives module reads from HLO."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lorajob_trainer import collectives, tiny
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.mesh import MeshError
from lorajob_trainer.models import experts
from trainer_testkit import GEMMA4_SHAPES, gemma4_checkpoint, tiny_checkpoint, trainer_env

PROBE = Path(__file__).with_name("expert_parallel_probe.py")
ROWS_PER_DEVICE = 128 * 2
"""(token, expert) rows leaving each device per MoE layer in the probe: 128 positions, top-2."""
RTOL = 1e-5
"""float32 on CPU: the expert-parallel sums run in another order than one device's."""


def probe(checkpoint: Path, model_name: str, *flags: str) -> dict:
    completed = subprocess.run([sys.executable, str(PROBE), str(checkpoint), model_name, *flags],
                               env=trainer_env(devices=4), capture_output=True, text=True, timeout=1200)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.split("REPORT ", 1)[1])


def check_cases(report: dict, moe_layers: int) -> None:
    """Exact cases equal one device within RTOL; the capacity case drops what its capacity leaves out and says so."""
    cases = report["cases"]
    assert len(cases) == 4
    for name, case in cases.items():
        dropped, padded = case["dispatch"]
        if "capacity factor 1.0" in name:
            # Every row to device 0 of the expert axis: each device sends it 128 of its 256 rows.
            assert (dropped, padded) == (4 * 128 * moe_layers, 4 * 128 * moe_layers), name
            assert abs(case["loss"][0] - case["loss"][1]) > 1e-4 * abs(case["loss"][1]), name
            continue
        assert dropped == 0, name
        assert padded > 0, name  # the dropless capacity leaves room for the worst case
        ours, reference = case["loss"]
        assert ours == pytest.approx(reference, rel=RTOL), name
        assert case["hidden"] < RTOL, name
        assert case["grads"] and all(value < RTOL for value in case["grads"].values()), (name, case["grads"])
        assert all(value > 0 for value in case["grad_magnitudes"].values()), name
        assert any(".experts." in adapter for adapter in case["grads"]), name


@pytest.mark.slow
def test_qwen3_moe_expert_parallel_equals_one_device_and_sends_tokens_not_weights(tmp_path):
    checkpoint = tiny_checkpoint(tmp_path / "model", family="qwen3-moe")
    report = probe(checkpoint, "tiny-qwen3-moe", "--hlo")
    check_cases(report, tiny.tiny_config("qwen3-moe")["num_hidden_layers"])
    hlo = report["hlo"]
    assert hlo["fsdp=4"]["dispatch_all_to_all"] == 0, hlo
    assert hlo["fsdp=4"]["expert_weight_gathers"], "the FSDP-style step gathers every expert: the check must see it"
    for mesh in ("expert=4", "expert=2 x fsdp=2"):
        assert hlo[mesh]["dispatch_all_to_all"] > 0, (mesh, hlo)
        assert hlo[mesh]["expert_weight_gathers"] == [], (mesh, hlo)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.large
def test_gemma4_moe_expert_parallel_equals_one_device(tmp_path):
    checkpoint = gemma4_checkpoint(tmp_path / "model", "gemma4-26b", seed=3)
    check_cases(probe(checkpoint, "tiny-gemma4"), GEMMA4_SHAPES["gemma4-26b"]["num_hidden_layers"])


def test_expert_axis_must_divide_the_experts(tmp_path):
    """4 experts: mesh.expert=3 is refused with the reason, before any device is needed."""
    import jax.numpy as jnp
    from lorajob_trainer import models, run

    hf = tiny.tiny_config("qwen3-moe")
    family = models.FAMILIES["qwen3-moe"]
    model = models.abstract_model(family, family.config_from_hf(hf, jnp.float32), hf)
    with pytest.raises(MeshError, match="mesh.expert=3 does not divide the model's 4 routed experts"):
        experts.configure_dispatch(model, 3, 2.0)
    experts.configure_dispatch(model, 2, 1.5)
    assert {block.capacity_factor for block in (layer.mlp for layer in model.layers)} == {1.5}
    with pytest.raises(MeshError, match="mesh.expert=3"):
        run.lora_model_of(model, family, None, hf, None, abstract=True, expert_axis=3, expert_capacity_factor=2.0)


@pytest.mark.parametrize(("rows", "group", "factor", "expected"), [
    (256, 2, 0.0, 256),  # dropless: room for every row on any one device
    (256, 2, 1.0, 128),
    (256, 4, 1.0, 64),  # 64 = the even share, already whole tiles (4 x 64 rows received)
    (256, 4, 1.25, 96),  # 80 rounded up to 3 tiles of 32
    (16384, 16, 1.25, 1280),
    (64, 2, 4.0, 64),  # never more than all rows
])
def test_expert_capacity(rows, group, factor, expected):
    assert experts.expert_capacity(rows, group, factor) == expected


HLO = """HloModule m

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]{1,0}) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %a2a = f32[8,4]{1,0} all-to-all(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %small = f32[2,4]{1,0} slice(%x), slice={[0:2], [0:4]}
  %ag = f32[8,4]{1,0} all-gather(%small), channel_id=2, replica_groups=[1,4]<=[4], dimensions={0}
  ROOT %t = (s32[], f32[8,4]) tuple(%p, %ag)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[]{:T(128)}, f32[8,4]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %n = s32[]{:T(128)} constant(48)
  ROOT %lt = pred[]{:T(512)} compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[8,4]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %ar = f32[8,4]{1,0} all-reduce(%a), channel_id=3, replica_groups=mesh['x'=2,'y'=2] {'x'}, to_apply=%cond
  %w = (s32[], f32[8,4]) while(%a), condition=%cond, body=%body{trip_count}
  ROOT %r = f32[8,4]{1,0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize("trip_count", [
    ', backend_config={"known_trip_count":{"n":"48"}}',  # the CPU compiler's
    "",  # the TPU compiler's: the bound in the condition
])
def test_collective_bytes_count_each_loop_trip_and_group(trip_count):
    """An all-to-all of 128 bytes over 4 devices sends 3/4 of it; an all-gather of a 32-byte shard to 4 devices
    sends it 3 times; both 48 times in the loop; an all-reduce over 2 devices sends its 128 bytes once (2 x 1/2)."""
    sent = collectives.collective_bytes(HLO.replace("{trip_count}", trip_count))
    assert sent["all-to-all"] == 48 * 128 * 3 / 4
    assert sent["all-gather"] == 48 * 32 * 3
    assert sent["all-reduce"] == 128
    assert sent["reduce-scatter"] == sent["collective-permute"] == 0


class FakeDevice:
    slice_index = 0


def never_read() -> dict:
    raise AssertionError("config.json read where there is no choice")


@pytest.mark.parametrize(("model", "devices", "tokens", "expected"), [
    # qwen3-30b-a3b: 128 experts of 3 x 2,048 x 768 in 48 layers, 58 GB in bf16, top-8 of 2,048 wide.
    ("qwen3-30b-a3b", 16, 2048, 16),  # 12 GB of tokens per pass against 54 GB of weights
    ("qwen3-30b-a3b", 16, 16384, 1),  # 97 GB of tokens: gathering the weights sends less
    ("qwen3-30b-a3b", 12, 2048, 4),  # the largest divisor of both 12 and 128
    ("gemma4-26b", 16, 2048, 16),
    ("llama3.1-8b", 16, 2048, 1),  # no routed experts
])
def test_auto_expert_axis_where_the_tokens_send_fewer_bytes_than_the_weights(model, devices, tokens, expected):
    from lorajob_trainer import run
    from lorajob_trainer.contract import catalog

    config = TrainConfig.from_args(["run_name=r", "base_output_directory=/tmp/o", f"model_name={model}",
                                    "load_parameters_path=/tmp/m", "hf_train_files=['x']", "steps=1",
                                    f"max_target_length={tokens}", "per_device_batch_size=1"])
    assert config.mesh.expert == "auto"
    resolved = run.resolve_expert_axis(config, lambda: catalog.released_config(model), [FakeDevice()] * devices)
    assert resolved.mesh.expert == expected
    assert run.resolve_expert_axis(config, never_read, [FakeDevice()]).mesh.expert == 1
    fixed = config.model_copy(update={"mesh": config.mesh.model_copy(update={"fsdp": devices})})
    assert run.resolve_expert_axis(fixed, never_read, [FakeDevice()] * devices).mesh.expert == 1
