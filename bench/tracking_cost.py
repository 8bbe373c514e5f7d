"""What experiment tracking costs the trainer's thread, per logging step.

    python bench/tracking_cost.py [--steps 200] [--step-seconds 0.02]

Drives the lead process's MetricsWriter as the train loop does (a step's metrics, `write`, then its progress record;
an evaluation every 20 steps) for `--steps` logging steps with no tracker, with MLflow (a real local tracking
server, started here) and with W&B offline, and prints the time the trainer's thread spends in those calls per
step. Between steps the thread sleeps `--step-seconds` (the device computing the next step: the GIL is free), when
the trackers' threads do their sending. Measuring starts once the trackers' runs are open, as in training, where they
open while the first step compiles (importing mlflow or wandb on their threads takes the GIL from the trainer's for
a while). Also printed: how long the end of the run waits for the queues to drain (the loss plot included).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "trainer"), str(REPO_ROOT / "devcluster")]

from lorajob_devcluster.controlplane import wait_for  # noqa: E402
from lorajob_devcluster.mlflow_server import MlflowServer  # noqa: E402
from lorajob_trainer import tracking  # noqa: E402
from lorajob_trainer.contract.config import TrainConfig  # noqa: E402
from lorajob_trainer.metrics import MetricsWriter  # noqa: E402

EVAL_EVERY = 20
OPEN_TIMEOUT_S = 120


def step_metrics(step: int) -> dict[str, float | None]:
    """A logged step's figures as the train loop writes them (train.Trainer._report)."""
    return {
        "loss": 2.0 / step ** 0.5, "grad_norm": 0.8, "real_tokens": 8192.0, "trained_tokens": 3100.0,
        "learning_rate": 1e-4, "step_time_s": 0.85, "tokens_per_second": 9638.0, "mfu": 0.41,
        "peak_host_memory_bytes": 7.1e9, "peak_device_memory_bytes": 1.29e10, "expert_rows_dropped": None,
    }


def config(directory: Path, *tracking_args: str) -> TrainConfig:
    return TrainConfig.from_args([
        "run_name=bench", f"base_output_directory={directory}", "model_name=qwen3-0.6b",
        f"load_parameters_path={directory}", f"hf_train_files=['{directory}/train.jsonl']", "steps=1000",
        "train_data_columns=['question','answer']", *tracking_args,
    ])


def measure(train_config: TrainConfig, steps: int, step_seconds: float) -> tuple[list[float], float]:
    """(seconds of the trainer's thread per logging step, seconds the end of the run waits)."""
    lineage = {"dataset.name": "bench", "dataset.fingerprint": "0" * 16}
    params = tracking.run_params(train_config, {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}, "minimal", lineage)
    trackers = tracking.Trackers.for_training(train_config, params, lineage)
    writer = MetricsWriter(train_config.layout, steps, enabled=True, tensorboard=False, progress_lines=False,
                           trackers=trackers)
    if trackers is not None:
        wait_for(lambda: all(trackers.urls().values()), OPEN_TIMEOUT_S, "the trackers' runs open")
    costs = []
    for step in range(1, steps + 1):
        time.sleep(step_seconds)
        started = time.perf_counter()
        values = step_metrics(step)
        writer.write(step, values)
        if step % EVAL_EVERY == 0:
            writer.write(step, {"eval_loss": values["loss"] * 1.1})
        writer.progress(step, loss=values["loss"], tokens_per_second=9638.0, eta_seconds=60.0, state="running")
        costs.append(time.perf_counter() - started)
    writer.progress(steps, loss=None, tokens_per_second=0.0, eta_seconds=0.0, state="succeeded")
    started = time.perf_counter()
    writer.close()
    return costs, time.perf_counter() - started


def describe(name: str, costs: list[float], closing: float) -> str:
    milliseconds = sorted(1000 * cost for cost in costs)
    p99 = milliseconds[int(0.99 * (len(milliseconds) - 1))]
    return (f"{name:<14} {statistics.mean(milliseconds):7.3f} {statistics.median(milliseconds):7.3f} {p99:7.3f}"
            f" {milliseconds[-1]:7.3f}   {closing:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tracking-cost-") as scratch, MlflowServer(Path(scratch) / "mlflow") as server:
        root = Path(scratch)
        cases = {
            "no tracker": config(root / "none"),
            "mlflow": config(root / "mlflow", f"tracking.mlflow_tracking_uri={server.url}"),
            "wandb offline": config(root / "wandb", "tracking.wandb_project=bench", "tracking.wandb_mode=offline"),
        }
        measure(config(root / "warm-up"), args.steps, args.step_seconds)  # a first pass of any kind is slower
        print(f"{args.steps} logging steps, {args.step_seconds * 1000:.0f} ms of device work between them; "
              "ms on the trainer's thread per logging step")
        print(f"{'':<14} {'mean':>7} {'median':>7} {'p99':>7} {'max':>7}   end wait (s)")
        for name, train_config in cases.items():
            print(describe(name, *measure(train_config, args.steps, args.step_seconds)), flush=True)


if __name__ == "__main__":
    main()
