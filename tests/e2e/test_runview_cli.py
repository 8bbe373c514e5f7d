"""`lorajob status | logs | plot` and `kubectl lorajob ...` against the real API server and operator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lorajobs import STEPS, every_image, progress_line, sample

from lorajob_devcluster import HANG_IMAGE
from lorajob_devcluster.kwok_stages import cri_log

pytestmark = pytest.mark.cluster
BIN = Path(sys.executable).parent


def cli(sim_cluster, *args: str, kubectl_plugin: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "KUBECONFIG": str(sim_cluster.kubeconfig), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    command = [sim_cluster.plane.binary("kubectl"), "lorajob", *args] if kubectl_plugin else [str(BIN / "lorajob"), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def training(lorajobs, operator, trainer_log):
    """A LoRAJob in its train step whose trainer has logged steps 1..7 (a checkpoint and an eval loss at step 5)."""
    lines = ["loading the base checkpoint"]
    lines += [progress_line(step) for step in range(1, 8)]
    trainer_log.write_text(cri_log(lines))
    lorajobs.apply(sample("watched", train_only=True, images=every_image(HANG_IMAGE)))
    lorajobs.wait("watched", lambda obj: (obj.get("status", {}).get("progress") or {}).get("step") == 7, "progress 7", timeout=60)
    return "watched"


def test_status_shows_the_run_through_the_api_server_and_as_a_kubectl_plugin(sim_cluster, lorajobs, training):
    for plugin in (False, True):
        result = cli(sim_cluster, "status", training, "-n", lorajobs.namespace, kubectl_plugin=plugin)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0] == f"LoRAJob {lorajobs.namespace}/{training}: Training"
        assert any(line.startswith("steps     ✓ check   ▶ train") for line in lines), result.stdout
        assert any(line.startswith("progress  [") and f"7/{STEPS}  70%" in line for line in lines), result.stdout
        loss = next(line for line in lines if line.startswith("loss "))
        assert loss.endswith(f"step 1..7: 3.0000 -> {3.0 / 7:.4f} (min {3.0 / 7:.4f})")
        assert "eval loss ▁  last 0.8000 at step 5" in lines
        assert any(line.startswith("checkpoint step 5: ") and line.endswith("/watched/checkpoints/5 (loss 0.6000, eval 0.8000)")
                   for line in lines), result.stdout
        assert any(line.split()[3:4] == ["Training"] for line in lines[lines.index("events"):]), result.stdout


def test_logs_prints_and_follows_the_lead_trainer_log(sim_cluster, lorajobs, training, trainer_log):
    result = cli(sim_cluster, "logs", training, "-n", lorajobs.namespace)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == "loading the base checkpoint" and progress_line(7) in result.stdout

    env = {**os.environ, "KUBECONFIG": str(sim_cluster.kubeconfig)}
    follower = subprocess.Popen(
        [str(BIN / "lorajob"), "logs", "-f", training, "-n", lorajobs.namespace], env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert follower.stdout.readline().rstrip("\n") == "loading the base checkpoint"
        with trainer_log.open("a") as log:
            log.write(cri_log(["step 8 written after the follower started"]))
        seen = [follower.stdout.readline().rstrip("\n") for _ in range(8)]
        assert seen[-1] == "step 8 written after the follower started", seen
    finally:
        follower.kill()
        follower.wait()


def test_plot_draws_the_loss_curve(sim_cluster, lorajobs, training, tmp_path):
    result = cli(sim_cluster, "plot", training, "-n", lorajobs.namespace, "-o", str(tmp_path / "loss.png"))
    assert result.returncode == 0, result.stderr
    from matplotlib import image

    pixels = image.imread(tmp_path / "loss.png")
    assert pixels.shape[0] >= 200 and pixels.shape[1] >= 300, pixels.shape
    colours = {tuple(pixel) for pixel in pixels.reshape(-1, pixels.shape[-1])[::97]}
    assert len(colours) > 3, "an empty canvas: no curve, axes or labels drawn"


def test_a_missing_lorajob_is_named(sim_cluster, lorajobs):
    result = cli(sim_cluster, "status", "nobody", "-n", lorajobs.namespace)
    assert result.returncode == 1
    assert result.stderr.strip() == f"lorajob status: no LoRAJob 'nobody' in namespace {lorajobs.namespace!r}"
