"""The TPU/GPU catalogue: every machine type renders as GKE and Pathways expect, and the docs list it."""

from pathlib import Path

import pytest

from lorajob_operator import accelerators, jobsets
from lorajob_operator.settings import RenderSettings

from builders import lorajob, owner, parsed, spec_dict

USER_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"


def _hardware_section() -> str:
    return USER_GUIDE.read_text().split("## 7. Hardware", 1)[1]


def test_user_guide_lists_every_machine_type_and_gpu():
    section = _hardware_section()
    for name in (*accelerators.TPU_MACHINES, *accelerators.GPU_ACCELERATORS):
        assert f"`{name}`" in section, name


def _train_jobset(machine_type: str, topology: str) -> dict:
    body = lorajob(spec=spec_dict(compute={"backend": "pathways", "tpu": {"machineType": machine_type, "topology": topology}}))
    return jobsets.render_phase("train", parsed(body), owner(body), RenderSettings(), 0)


@pytest.mark.parametrize(
    "machine_type, topology, accelerator, vms, chips",
    [
        ("tpu7x-standard-4t", "4x4x4", "tpu7x", 16, "4"),
        ("tpu7x-standard-4t", "2x2x1", "tpu7x", 1, "4"),
        ("tpu7x-standard-1t", "1x1x1", "tpu7x", 1, "1"),
        ("ct6e-standard-8t", "2x4", "tpu-v6e-slice", 1, "8"),
        ("ct6e-standard-1t", "1x1", "tpu-v6e-slice", 1, "1"),
        ("ct5lp-hightpu-8t", "2x4", "tpu-v5-lite-podslice", 1, "8"),
        ("ct5p-hightpu-4t", "4x4x12", "tpu-v5p-slice", 48, "4"),
    ],
)
def test_machine_renders_its_node_labels_chips_and_pathways_instance(machine_type, topology, accelerator, vms, chips):
    train = _train_jobset(machine_type, topology)
    jobs = {rjob["name"]: rjob["template"]["spec"] for rjob in train["spec"]["replicatedJobs"]}
    worker = jobs["worker"]
    assert worker["parallelism"] == worker["completions"] == vms
    pod = worker["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    assert pod["containers"][0]["resources"]["requests"] == {"google.com/tpu": chips}
    prefix = accelerators.TPU_MACHINES[machine_type].pathways_type
    assert f"--instance_type={prefix}:{topology}" in repr(train)


@pytest.mark.parametrize(("generation", "device_kind"), [
    ("v4", "TPU v4"), ("v5e", "TPU v5 lite"), ("v5p", "TPU v5p"), ("v6e", "TPU v6 lite"), ("v7x", "TPU7x"),
])
def test_the_measured_mfu_and_the_plan_use_the_same_peak_per_device(generation, device_kind):
    from lorajob_trainer import metrics

    chip = accelerators.TPU_CHIPS[generation]
    assert metrics.peak_flops_per_device(device_kind, None) == chip.device().peak_bf16_flops
