"""Training metrics: LoRA FLOPs model, MFU, JSON lines, TensorBoard, experiment trackers, the progress file and
progress lines.

MFU counts model FLOPs of LoRA training, not full fine-tuning's 6N: per token, the frozen
weights cost a forward (2N) and an activation-gradient backward (2N) but no weight gradient;
causal attention costs 6 * seq_len * (sum over layers of heads * head_dim) forward + backward;
each adapter costs 6 FLOPs per parameter (forward, activation and weight gradient). N counts
matmul weights: every base parameter with 2+ dimensions, except the embedding table when the
model has a separate output projection (an embedding lookup is not a matmul). Mixture-of-experts
weights and their adapters count with the share of experts a token uses (`active`: top-k / experts),
so N is the active parameters per token. Tokens are real (non-padding) tokens, so MFU measures
useful work.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lorajob_trainer.contract.records import CheckpointRecord, EvalRecord, ProgressRecord, RunLayout

if TYPE_CHECKING:
    from lorajob_trainer.tracking import Trackers

PEAK_BF16_FLOPS = {
    # Dense bf16 peak per device, by a substring of jax.Device.device_kind.
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "TPU7x": 4614e12 / 2,  # a tpu7x chip's two TensorCores are two devices
    "TPU v6 lite": 918e12,
    "TPU v5 lite": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v4": 275e12,
}
@dataclass(frozen=True)
class LoraFlops:
    frozen_matmul_params: int
    """N: base weights used as matmuls."""
    head_params: int
    """Of N, the output projection's, which remat never recomputes."""
    attention_width: int
    """Sum over layers of query heads * head_dim."""
    adapter_params: int
    seq_len: int
    reference_forward: bool = False
    """The step also runs the reference model's forward (DPO): counted in `executed_per_token`, not in `per_token`
    (MFU counts the trained model's FLOPs)."""

    @property
    def per_token(self) -> float:
        return 4 * self.frozen_matmul_params + 6 * self.seq_len * self.attention_width + 6 * self.adapter_params

    def executed_per_token(self, remat_policy: str, attention_block: int | None = None) -> float:
        """FLOPs the train step runs per token, which MFU does not count as useful: the recompute of remat and the
        masked attention scores that dense attention computes (`attention_block` None) or the splash kernel's
        blocks of `attention_block` positions straddling the causal diagonal. See EXECUTED_MATMUL_FACTOR."""
        layers = 4 * (self.frozen_matmul_params - self.head_params) + 6 * self.adapter_params
        executed = (EXECUTED_MATMUL_FACTOR[remat_policy] * layers + 4 * self.head_params
                    + self.executed_attention_per_token(remat_policy, attention_block))
        return executed + (self.forward_per_token(attention_block) if self.reference_forward else 0.0)

    def forward_per_token(self, attention_block: int | None = None) -> float:
        """FLOPs of one undifferentiated forward per token: every weight's matmul once and the attention's forward
        (4 per score computed: every score of the dense attention, the kernel's blocks at and below the diagonal)."""
        scores = 1.0 if attention_block is None else causal_block_share(self.seq_len // attention_block)
        return 2 * (self.frozen_matmul_params + self.adapter_params) + 4 * scores * self.seq_len * self.attention_width

    def executed_attention_per_token(self, remat_policy: str, attention_block: int | None = None) -> float:
        """Of `executed_per_token`, the attention scores' and their mixing's (no weights)."""
        if attention_block is None:
            per_score = DENSE_ATTENTION_FLOPS[remat_policy]
        else:
            per_score = SPLASH_ATTENTION_FLOPS[remat_policy] * causal_block_share(self.seq_len // attention_block)
        return per_score * self.seq_len * self.attention_width


EXECUTED_MATMUL_FACTOR = {"none": 1.0, "minimal": 1.0, "attention": 1.308, "full": 1.369}
"""The decoder layers' matmul FLOPs the step runs per model FLOP, by remat policy: "full" recomputes each
layer's forward except the matmuls whose outputs only feed the residual stream (the compiler drops those);
measured with the TPU compiler's cost analysis of the step unrolled (llama3.1-8b, v6e-8, 1,024 tokens:
4.383e13 FLOPs per chip against 3.182e13 model FLOPs; `bench/tpu_plan.py --executed-flops`). "attention" recomputes
the MLP's gate and up projections only; measured the same way (2026-12-07: 4.234e13 FLOPs per chip, the splash
kernel's from SPLASH_ATTENTION_FLOPS included, so 1.308 on the layers' matmuls; estimated 1.30 before, "full"'s
recompute less the query, key and value projections' share, 117 of 143 million weights per layer)."""
DENSE_ATTENTION_FLOPS = {"none": 12, "minimal": 16, "attention": 16, "full": 16}
"""Attention FLOPs per token per (seq_len x attention width): every score of the causal mask is computed, 4 in
the forward, 8 in the backward, 4 more where remat recomputes the scores; MFU counts 6 (the causal half)."""
SPLASH_ATTENTION_FLOPS = {"none": 18, "minimal": 18, "attention": 18, "full": 22}
"""The same for the splash kernel (models/splash.py) per score of the blocks it computes: 4 in the forward; in the
backward 6 in its query-gradient kernel and 8 in its key/value-gradient kernel, each computing the scores again;
4 more where remat runs the forward again ("full": the other policies keep the kernel's output, remat.KERNEL_OUTPUT)."""


def causal_block_share(blocks: int) -> float:
    """The share of a causal square of `blocks` x `blocks` blocks the splash kernel computes: the lower triangle
    with its diagonal."""
    return (blocks + 1) / (2 * blocks)


def frozen_matmul_params(base_shapes: dict[str, tuple[int, ...]], active: dict[str, float] | None = None) -> int:
    """N from `{dotted path: shape}` of the base (non-LoRA) parameters; `active` maps path prefixes
    (routed experts' modules) to the share of them a token uses."""
    head = _output_head(base_shapes)
    total = 0.0
    for path, shape in base_shapes.items():
        if len(shape) < 2 or (_is_embedding_table(path) and path != head):
            continue
        total += math.prod(shape) * active_share(path, active)
    return round(total)


def output_head_params(base_shapes: dict[str, tuple[int, ...]]) -> int:
    """Of N, the output projection's: `lm_head`, or the input embedding where the model ties them."""
    return math.prod(base_shapes[_output_head(base_shapes)])


def _leaf(path: str) -> str:
    return path.replace("/", ".").rsplit(".", 1)[-1]


def _is_embedding_table(path: str) -> bool:
    """A table read by lookup, not by a matmul: the input embedding (Gemma 4's per-layer ones too)."""
    return _leaf(path).endswith("embedding")


def _output_head(base_shapes: dict[str, tuple[int, ...]]) -> str:
    heads = [path for path in base_shapes if "lm_head" in path and len(base_shapes[path]) >= 2]
    if not heads:  # tied: the input embedding is the output projection
        heads = [path for path in base_shapes if _leaf(path) == "input_embedding"]
    return heads[0]


def active_share(path: str, active: dict[str, float] | None) -> float:
    """The share of the parameter at `path` (dotted or `/`-joined) one token uses (1 outside routed experts)."""
    dotted = path.replace("/", ".")
    return next((share for prefix, share in (active or {}).items() if dotted.startswith(prefix)), 1.0)


def peak_flops_per_device(device_kind: str, override_tflops: float | None) -> float | None:
    if override_tflops is not None:
        return override_tflops * 1e12
    for kind, flops in PEAK_BF16_FLOPS.items():
        if kind in device_kind:
            return flops
    return None


def mfu(tokens_per_second: float, flops: LoraFlops, num_devices: int, peak_per_device: float | None) -> float | None:
    if peak_per_device is None:
        return None
    return tokens_per_second * flops.per_token / (num_devices * peak_per_device)


def peak_host_memory_bytes() -> int:
    """This process's peak resident memory.

    Linux: VmHWM of /proc/self/status. `ru_maxrss` is no substitute there: it keeps the peak of the
    process image replaced by exec, so a trainer started from a large parent (a test runner, a
    launcher) would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_memory_bytes(devices) -> int | None:
    """The largest peak of the devices' memory (`memory_stats()`): the buffers in use plus the memory reserved,
    where a device reports it. A TPU reserves the compiled programs' temporaries apart from the buffers in use:
    on a v5e chip a qwen3-0.6b step's 11.50 GB of temporaries showed only as `peak_bytes_reserved`, beside 1.35 GB
    of `peak_bytes_in_use` (weights, adapters, optimizer state); their sum, 12.85 GB, is what the step took
    against the compiler's 13.38 GB. None where no device reports memory (a CPU)."""
    peaks = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"] + stats.get("peak_bytes_reserved", 0))
    return max(peaks) if peaks else None


def device_memory_limit_bytes(devices) -> int | None:
    """The smallest memory limit the devices report (`memory_stats()["bytes_limit"]`); None where one reports none
    (a CPU)."""
    limits = []
    for device in devices:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(stats["bytes_limit"])
    return min(limits) if limits else None


class StepTimer:
    """Wall time per step and an ETA from the recent average."""

    def __init__(self, window: int = 20):
        self._durations: deque[float] = deque(maxlen=window)
        self._last = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        duration, self._last = now - self._last, now
        self._durations.append(duration)
        return duration

    def reset(self) -> None:
        self._last = time.perf_counter()

    def eta_seconds(self, remaining_steps: int) -> float:
        if not self._durations:
            return float("nan")
        return remaining_steps * sum(self._durations) / len(self._durations)


class MetricsWriter:
    """Writes metrics on the lead process: `metrics.jsonl`, TensorBoard events, the experiment trackers (`trackers`,
    which it closes) and `progress.json`."""

    def __init__(self, layout: RunLayout, total_steps: int, *, enabled: bool, tensorboard: bool,
                 progress_lines: bool, trackers: Trackers | None = None):
        self.layout = layout
        self.total_steps = total_steps
        self.enabled = enabled
        self.progress_lines = progress_lines
        self.metrics_path = Path(layout.metrics)
        self.progress_path = Path(layout.progress)
        self.trackers = trackers
        self.last_record: ProgressRecord | None = None
        """The last progress record: its state says how the run ended, once it has."""
        self._tensorboard = None
        if enabled:
            Path(layout.run_directory).mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tensorboard = SummaryWriter(layout.tensorboard)

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **values}
        with self.metrics_path.open("a") as stream:
            stream.write(json.dumps(record) + "\n")
        numbers = finite_numbers(values)
        if self._tensorboard is not None:
            for name, value in numbers.items():
                self._tensorboard.add_scalar(name, value, step)
        if self.trackers is not None:
            self.trackers.log_metrics(step, numbers, record["time"])

    def evaluation(self, record: EvalRecord) -> None:
        """The evaluation of base and adapter, to the trackers (the run directory's evaluation.json holds it)."""
        if self.enabled and self.trackers is not None:
            self.trackers.log_evaluation(record)

    def progress(
        self, step: int, *, loss: float | None, tokens_per_second: float, eta_seconds: float, state: str, message: str = "",
        eval_loss: float | None = None, eval_step: int | None = None, checkpoints: tuple[CheckpointRecord, ...] = (),
        expert_rows_dropped: int | None = None, **preference: float,
    ) -> None:
        """Atomically replace the progress file and, with `progress_lines`, print it as one line on stdout;
        `preference`: a preference method's figures (contract.records.PREFERENCE_PROGRESS)."""
        if not self.enabled:
            return
        record = ProgressRecord(step=step, total_steps=self.total_steps, loss=loss, tokens_per_second=tokens_per_second,
                                eta_seconds=eta_seconds, state=state, message=message, eval_loss=eval_loss,
                                eval_step=eval_step, checkpoints=checkpoints, expert_rows_dropped=expert_rows_dropped,
                                updated=time.time(), **preference)
        self._publish(self._with_tracking(record))

    def _with_tracking(self, record: ProgressRecord) -> ProgressRecord:
        if self.trackers is None:
            return record
        return replace(record, tracking_urls=self.trackers.urls(), tracking_problem=self.trackers.problem())

    def _publish(self, record: ProgressRecord) -> None:
        self.last_record = record
        partial = self.progress_path.with_suffix(".json.tmp")
        partial.write_text(record.to_json())
        os.replace(partial, self.progress_path)
        if not self.progress_lines:
            return
        # Flushed: a container's stdout is a pipe, and the operator polls the log while training runs.
        print(record.line(), file=sys.stdout, flush=True)

    def close(self) -> None:
        """Close TensorBoard's file and end the trackers' runs as the last progress state says; the last progress
        record again where the trackers' links or problem changed meanwhile (a short run can end before a tracker's
        run is open, and the operator learns the links from progress records only)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self.trackers is None:
            return
        last = self.last_record
        self.trackers.finish_training(last.state if last else None, self.layout)
        if last is not None and (updated := self._with_tracking(last)) != last:
            self._publish(updated)


def finite_numbers(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers among `values` (None, NaN, text dropped)."""
    return {name: float(value) for name, value in values.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}


def read_metrics(metrics_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: Path, png_path: Path) -> Path:
    """Training (and evaluation) loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evaluation = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    if not train:
        raise ValueError(f"{metrics_path} holds no training loss")
    figure, axes = pyplot.subplots(figsize=(6, 4))
    axes.plot(*zip(*train), label="train loss")
    if evaluation:
        axes.plot(*zip(*evaluation), "o-", label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats/token)")
    axes.legend()
    figure.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=100)
    pyplot.close(figure)
    return png_path


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Plot the loss curve of a run's metrics.jsonl.")
    parser.add_argument("metrics", type=Path)
    parser.add_argument("png", type=Path)
    arguments = parser.parse_args()
    print(plot_loss_curve(arguments.metrics, arguments.png))
