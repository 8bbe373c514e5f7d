"""Side by side: our LoRA trainer against MaxText's LoRA SFT (Tunix), same everything, same machine.

    .venv/bin/python bench/maxtext/compare.py [--shapes tiny,small] [--steps 40] [--repeats 2]

Needs MaxText's own environment (`bash bench/maxtext/setup.sh`). For each shape the script makes one
random Qwen3 checkpoint in Hugging Face format with its tokenizer (lorajob_trainer.tiny), converts it
for MaxText with MaxText's own `to_maxtext` (our trainer reads the safetensors directly), writes one
JSONL of question/answer rows, then runs both trainers in turns (ours first on even repeats, MaxText
first on odd ones) with the same model shape, tokenizer, data order (no shuffling), packing, LoRA
rank/alpha/targets, AdamW settings, learning-rate schedule, batch and sequence length, float32 on CPU.

Printed per run: tokens/s counting real (non-padding) input tokens over the steady steps (all but the
first `--warmup` steps), median step time, compile time (first step minus the median), process wall
time and peak RSS; per shape the ratio ours / MaxText and how far the two loss curves are apart.
Both loss curves go into one PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shape_overrides import shape_overrides

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).resolve().parent / "launch_maxtext.py"
DEFAULT_MAXTEXT_PYTHON = Path.home() / ".cache" / "lorajob-maxtext" / "venv" / "bin" / "python"
# Our trainer as its image installs it (`.[trainer]`: no torch, no PEFT), built by setup.sh beside MaxText's.
DEFAULT_OURS_PYTHON = Path.home() / ".cache" / "lorajob-bench" / "trainer-venv" / "bin" / "python"
# The MaxText model whose decoder matches our Qwen3; its published shape is overridden per shape.
MAXTEXT_MODEL = "qwen3-0.6b"


@dataclass(frozen=True)
class Shape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    seq_len: int
    batch: int
    vocab_size: int | None = None
    """None: the tiny tokenizer's vocabulary; else the model's (token ids stay the tokenizer's)."""

    def hf_overrides(self) -> dict[str, int]:
        vocab = {"vocab_size": self.vocab_size} if self.vocab_size else {}
        return vocab | {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": max(512, self.seq_len),
        }


SHAPES = {
    shape.name: shape
    for shape in (
        Shape("tiny", 64, 128, 2, 4, 2, 16, seq_len=128, batch=4),
        Shape("small", 256, 768, 4, 8, 4, 32, seq_len=256, batch=4),
        Shape("medium", 512, 1536, 8, 8, 4, 64, seq_len=512, batch=4),
        # `small` with Qwen3's vocabulary: the LM head and the loss at a real size.
        Shape("real-vocab", 256, 768, 4, 8, 4, 32, seq_len=256, batch=4, vocab_size=151936),
        # For an accelerator: Qwen3-0.6B-sized layers with the tiny vocabulary.
        Shape("large", 1024, 3072, 28, 16, 8, 128, seq_len=1024, batch=8),
    )
}


@dataclass(frozen=True)
class Ours:
    python: Path
    settings: tuple[str, ...] = ()
    """Extra `key=value` trainer settings (e.g. remat_policy=full), after the shared ones."""


@dataclass(frozen=True)
class Hyper:
    steps: int
    rank: int = 8
    alpha: float = 16.0
    learning_rate: float = 1e-3
    warmup_fraction: float = 0.1
    final_fraction: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 1.0


@dataclass
class RunResult:
    system: str
    shape: str
    repeat: int
    returncode: int
    wall_s: float
    peak_rss_bytes: int
    losses: list[float]
    step_times: list[float]
    real_tokens: list[int]
    log_tail: str = ""

    def steady(self, warmup: int) -> slice:
        return slice(min(warmup, max(len(self.step_times) - 1, 0)), None)

    def tokens_per_second(self, warmup: int) -> float:
        window = self.steady(warmup)
        tokens, seconds = sum(self.real_tokens[window]), sum(self.step_times[window])
        return tokens / seconds if seconds > 0 else float("nan")

    def median_step_s(self, warmup: int) -> float:
        steady = self.step_times[self.steady(warmup)]
        return statistics.median(steady) if steady else float("nan")

    def compile_s(self, warmup: int) -> float:
        return self.step_times[0] - self.median_step_s(warmup) if self.step_times else float("nan")


@dataclass
class Workspace:
    root: Path
    shape: Shape
    model_dir: Path = field(init=False)
    data_file: Path = field(init=False)
    maxtext_checkpoint: Path = field(init=False)

    def __post_init__(self):
        base = self.root / self.shape.name
        self.model_dir = base / "hf-base"
        self.data_file = self.root / "train.jsonl"
        self.maxtext_checkpoint = base / "maxtext-base"


# ---------------------------------------------------------------- inputs shared by both systems


def write_dataset(path: Path, rows: int, seed: int = 0) -> None:
    """Question/answer rows with something to learn (addition), in the words the tiny tokenizer knows."""
    if path.is_file():
        return
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as stream:
        for _ in range(rows):
            a, b = rng.randrange(100), rng.randrange(100)
            stream.write(json.dumps({"question": f"what is {a} plus {b}?", "answer": f"the answer is {a + b}."}) + "\n")


def make_base_checkpoint(workspace: Workspace) -> None:
    from lorajob_trainer import tiny

    if not (workspace.model_dir / "config.json").is_file():
        tiny.make_tiny_checkpoint("qwen3", workspace.model_dir, seed=0, **workspace.shape.hf_overrides())


def maxtext_model_overrides(model_dir: Path) -> list[str]:
    """MaxText `override_model_config` keys that reproduce our checkpoint's config.json."""
    hf = json.loads((model_dir / "config.json").read_text())
    return [
        *shape_overrides(MAXTEXT_MODEL, hf),
        f"rope_max_timescale={int(hf['rope_theta'])}",
        f"normalization_layer_epsilon={hf['rms_norm_eps']}",
    ]


def maxtext_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})})
    return env


def convert_for_maxtext(workspace: Workspace, maxtext_python: Path) -> None:
    """MaxText's own HF -> MaxText conversion of the same safetensors our trainer reads."""
    items = workspace.maxtext_checkpoint / "0" / "items"
    if items.is_dir():
        return
    command = [
        str(maxtext_python), str(LAUNCHER), "to_maxtext", str(workspace.model_dir / "config.json"),
        *maxtext_model_overrides(workspace.model_dir),
        f"base_output_directory={workspace.maxtext_checkpoint}",
        f"hf_model_path={workspace.model_dir}",
        "scan_layers=True", "hardware=cpu", "skip_jax_distributed_system=True",
        "save_dtype=float32", "simulated_cpu_devices_count=1",
        "lazy_load_tensors=False",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, env=maxtext_env())
    if completed.returncode != 0 or not items.is_dir():
        raise SystemExit(f"MaxText conversion failed ({completed.returncode}):\n{completed.stdout[-4000:]}\n"
                         f"{completed.stderr[-4000:]}")


# ---------------------------------------------------------------- the two command lines


def ours_command(workspace: Workspace, hyper: Hyper, out: Path, ours: Ours) -> tuple[list[str], dict[str, str]]:
    shape = workspace.shape
    command = [
        str(ours.python), "-m", "lorajob_trainer.train",
        "run_name=ours", f"base_output_directory={out}",
        "model_name=tiny-qwen3", f"load_parameters_path={workspace.model_dir}",
        f"hf_train_files=['{workspace.data_file}']", "train_data_columns=['question','answer']",
        f"steps={hyper.steps}", f"per_device_batch_size={shape.batch}", f"max_target_length={shape.seq_len}",
        "packing=True", "shuffle=False", "dtype=float32",
        f"learning_rate={hyper.learning_rate}", "lr_schedule=cosine",
        f"warmup_steps_fraction={hyper.warmup_fraction}", f"learning_rate_final_fraction={hyper.final_fraction}",
        f"adam_b1={hyper.adam_b1}", f"adam_b2={hyper.adam_b2}", f"adam_eps={hyper.adam_eps}",
        f"adam_weight_decay={hyper.weight_decay}", f"gradient_clipping_threshold={hyper.clip}",
        f"lora.lora_rank={hyper.rank}", f"lora.lora_alpha={hyper.alpha}",
        "enable_checkpointing=False", "enable_tensorboard=False",
        *ours.settings,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "trainer"), "JAX_PLATFORMS": "cpu"}
    return command, env


def maxtext_command(workspace: Workspace, hyper: Hyper, out: Path, maxtext_python: Path
                    ) -> tuple[list[str], dict[str, str]]:
    shape = workspace.shape
    command = [
        str(maxtext_python), str(LAUNCHER), "sft",
        "run_name=maxtext", f"base_output_directory={out}",
        *maxtext_model_overrides(workspace.model_dir),
        f"load_parameters_path={workspace.maxtext_checkpoint / '0' / 'items'}",
        "tokenizer_type=huggingface", f"tokenizer_path={workspace.model_dir}",
        "dataset_type=hf", "hf_path=json", f"hf_train_files={workspace.data_file}", "train_split=train",
        "train_data_columns=['question','answer']", "hf_eval_split=", "eval_interval=-1",
        f"steps={hyper.steps}", f"per_device_batch_size={shape.batch}", f"max_target_length={shape.seq_len}",
        "packing=True", "enable_data_shuffling=False", "dtype=float32", "weight_dtype=float32",
        f"learning_rate={hyper.learning_rate}",
        f"warmup_steps_fraction={hyper.warmup_fraction}", f"learning_rate_final_fraction={hyper.final_fraction}",
        f"adam_b1={hyper.adam_b1}", f"adam_b2={hyper.adam_b2}", f"adam_eps={hyper.adam_eps}",
        f"adam_weight_decay={hyper.weight_decay}", f"gradient_clipping_threshold={hyper.clip}",
        "lora.enable_lora=True", f"lora.lora_rank={hyper.rank}", f"lora.lora_alpha={hyper.alpha}",
        "hardware=cpu", "skip_jax_distributed_system=True", "attention=dot_product",
        "enable_checkpointing=False", "enable_tensorboard=False", "enable_goodput_recording=False",
        f"metrics_file={out / 'maxtext' / 'metrics.jsonl'}", "log_period=1",
    ]
    env = maxtext_env({"LORAJOB_REAL_TOKENS_FILE": str(out / "maxtext" / "real_tokens.jsonl")})
    return command, env


# ---------------------------------------------------------------- running and reading results


def run_measured(command: list[str], env: dict[str, str], log_path: Path) -> tuple[int, float, int]:
    """(exit status, wall seconds, peak RSS bytes of the process)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=log_path.parent)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, time.perf_counter() - started, usage.ru_maxrss * 1024


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours_series(out: Path) -> tuple[list[float], list[float], list[int]]:
    records = [r for r in read_jsonl(out / "ours" / "metrics.jsonl") if "loss" in r]
    return ([r["loss"] for r in records], [r["step_time_s"] for r in records], [int(r["real_tokens"]) for r in records])


def maxtext_series(out: Path) -> tuple[list[float], list[float], list[int]]:
    records = [r for r in read_jsonl(out / "maxtext" / "metrics.jsonl") if "learning/loss" in r]
    tokens = [r["real_tokens"] for r in read_jsonl(out / "maxtext" / "real_tokens.jsonl")]
    return ([r["learning/loss"] for r in records], [r["perf/step_time_seconds"] for r in records],
            tokens[: len(records)])


def run_one(system: str, workspace: Workspace, hyper: Hyper, repeat: int, maxtext_python: Path, ours: Ours
            ) -> RunResult:
    out = workspace.root / workspace.shape.name / f"run-{repeat}-{system}"
    # Fresh every time: both trainers resume from checkpoints left in their run directory.
    shutil.rmtree(out, ignore_errors=True)
    if system == "ours":
        command, env = ours_command(workspace, hyper, out, ours)
    else:
        command, env = maxtext_command(workspace, hyper, out, maxtext_python)
    log_path = out / f"{system}.log"
    returncode, wall, rss = run_measured(command, env, log_path)
    losses, step_times, tokens = (ours_series if system == "ours" else maxtext_series)(out)
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    result = RunResult(system, workspace.shape.name, repeat, returncode, wall, rss, losses, step_times, tokens, tail)
    if returncode != 0 or len(losses) != hyper.steps:
        print(f"!! {system} {workspace.shape.name} repeat {repeat}: exit {returncode}, {len(losses)}/{hyper.steps} "
              f"steps logged (log {log_path})\n{tail}", file=sys.stderr)
    return result


def curve_distance(a: list[float], b: list[float], window: int = 5) -> dict[str, float]:
    """How far two loss curves are apart: step-1 difference, and mean/max gap of their moving averages."""
    steps = min(len(a), len(b))
    if steps == 0:
        return {"first": math.nan, "mean_abs": math.nan, "max_abs": math.nan, "mean_rel": math.nan}

    def smooth(values):
        return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(steps)]

    sa, sb = smooth(a), smooth(b)
    gaps = [abs(x - y) for x, y in zip(sa, sb)]
    return {
        "first": abs(a[0] - b[0]),
        "mean_abs": statistics.fmean(gaps),
        "max_abs": max(gaps),
        "mean_rel": statistics.fmean(g / max(abs(y), 1e-9) for g, y in zip(gaps, sb)),
    }


def plot(results: list[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r.shape for r in results}, key=list(SHAPES).index)
    figure, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    colours = {"ours": "tab:blue", "maxtext": "tab:orange"}
    for axis, shape in zip(axes[0], shapes):
        for result in (r for r in results if r.shape == shape and r.losses):
            label = f"{'lorajob' if result.system == 'ours' else 'MaxText'} (run {result.repeat})"
            axis.plot(range(1, len(result.losses) + 1), result.losses, color=colours[result.system],
                      alpha=0.9 if result.repeat == 0 else 0.45, label=label)
        axis.set_title(f"LoRA SFT loss, shape {shape}")
        axis.set_xlabel("step")
        axis.set_ylabel("training loss (per trained token)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def summarise(results: list[RunResult], warmup: int) -> None:
    print("\nsystem   shape   run  exit  steps  tokens/s(real)  median step s  compile s  wall s  peak RSS MiB")
    for r in results:
        print(f"{r.system:8s} {r.shape:7s} {r.repeat:3d}  {r.returncode:4d}  {len(r.losses):5d}  "
              f"{r.tokens_per_second(warmup):14.1f}  {r.median_step_s(warmup):13.4f}  {r.compile_s(warmup):9.2f}  "
              f"{r.wall_s:6.1f}  {r.peak_rss_bytes / 2**20:12.0f}")
    for shape in sorted({r.shape for r in results}, key=list(SHAPES).index):
        ours = [r for r in results if r.shape == shape and r.system == "ours" and r.returncode == 0]
        theirs = [r for r in results if r.shape == shape and r.system == "maxtext" and r.returncode == 0]
        if not ours or not theirs:
            print(f"{shape}: no ratio (a system failed)")
            continue
        ours_tps = statistics.median(r.tokens_per_second(warmup) for r in ours)
        theirs_tps = statistics.median(r.tokens_per_second(warmup) for r in theirs)
        distance = curve_distance(ours[0].losses, theirs[0].losses)
        print(f"{shape}: tokens/s ours {ours_tps:.1f} / MaxText {theirs_tps:.1f} = {ours_tps / theirs_tps:.2f}x; "
              f"loss curves: step-1 gap {distance['first']:.4f}, smoothed gap mean {distance['mean_abs']:.4f} "
              f"(max {distance['max_abs']:.4f}, {100 * distance['mean_rel']:.1f}% of MaxText's loss); final loss "
              f"ours {ours[0].losses[-1]:.4f} MaxText {theirs[0].losses[-1]:.4f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tiny,small", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of tokens/s (compilation)")
    parser.add_argument("--rows", type=int, default=20000, help="dataset rows (more than the runs consume)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/lorajob-maxtext-compare"))
    parser.add_argument("--maxtext-python", type=Path, default=DEFAULT_MAXTEXT_PYTHON)
    parser.add_argument("--ours-python", type=Path, default=DEFAULT_OURS_PYTHON,
                        help="the Python of our trainer's environment (default: the image's packages, from setup.sh)")
    parser.add_argument("--ours-setting", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra setting for our trainer (repeatable), e.g. remat_policy=full")
    parser.add_argument("--systems", default="ours,maxtext", help="run only some systems (debugging)")
    args = parser.parse_args(argv)
    for system, python in (("maxtext", args.maxtext_python), ("ours", args.ours_python)):
        if system in args.systems and not python.is_file():
            raise SystemExit(f"{python} not found: run bash bench/maxtext/setup.sh first")
    ours = Ours(args.ours_python.absolute(), tuple(args.ours_setting))
    sys.path.insert(0, str(REPO_ROOT / "trainer"))
    hyper = Hyper(steps=args.steps)
    systems = args.systems.split(",")
    write_dataset(args.workdir / "train.jsonl", args.rows)
    results: list[RunResult] = []
    for name in args.shapes.split(","):
        workspace = Workspace(args.workdir, SHAPES[name])
        make_base_checkpoint(workspace)
        if "maxtext" in systems:
            convert_for_maxtext(workspace, args.maxtext_python)
        for repeat in range(args.repeats):
            order = systems if repeat % 2 == 0 else systems[::-1]
            for system in order:
                print(f"== {name} repeat {repeat}: {system}", flush=True)
                results.append(run_one(system, workspace, hyper, repeat, args.maxtext_python, ours))
    summarise(results, args.warmup)
    png = args.workdir / "loss_curves.png"
    plot(results, png)
    print(f"loss curves: {png}")
    return 0 if all(r.returncode == 0 and len(r.losses) == hyper.steps for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
