"""Offline end-to-end demo: tiny model + tiny dataset -> LoRA fine-tune -> PEFT export -> loss curve.

    python -m lorajob_trainer.demo --out out/train-demo [--steps 60]

Everything is generated here (no network): a tiny random Qwen3 checkpoint with its tokenizer,
question/answer addition problems, then the real entry points run as subprocesses:
`lorajob_trainer.train`, `lorajob_trainer.export`. Writes OUT/loss.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

from lorajob_trainer import metrics
from lorajob_trainer.contract.records import RunLayout


def arithmetic_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Question/answer rows with a learnable pattern (two-digit addition)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(10, 50), rng.randrange(10, 50)
        rows.append({"question": f"what is {a} plus {b}?", "answer": f"the answer is {a + b}."})
    return rows


def preference_rows(count: int, seed: int = 0) -> list[dict[str, str]]:
    """Prompt/chosen/rejected rows of the same additions: the chosen answer right and worded as `arithmetic_rows`
    words it, the rejected one a bare sum off by 1 to 9. A tiny model learns the preference; the short rejected answer
    is the likelier one before training."""
    rng = random.Random(seed)
    rows = []
    for row in arithmetic_rows(count, seed):
        a, b = (int(word.rstrip("?")) for word in row["question"].split()[2::2])
        wrong = a + b + rng.choice([-1, 1]) * rng.randrange(1, 10)
        rows.append({"prompt": row["question"], "chosen": row["answer"], "rejected": str(wrong)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_module(module: str, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", module, *args], check=True, env=env)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    out = args.out.absolute()

    from lorajob_trainer import tiny

    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():
        tiny.make_tiny_checkpoint("qwen3", model_dir)
    train_file = write_jsonl(out / "data" / "train.jsonl", arithmetic_rows(400))
    eval_file = write_jsonl(out / "data" / "eval.jsonl", arithmetic_rows(40, seed=1))
    layout = RunLayout(str(out / "runs"), "demo")
    run_module(
        "lorajob_trainer.train",
        f"run_name={layout.run_name}",
        f"base_output_directory={layout.base_output_directory}",
        "model_name=tiny-qwen3",
        f"load_parameters_path={model_dir}",
        f"hf_train_files=['{train_file}']",
        f"hf_eval_files=['{eval_file}']",
        "train_data_columns=['question','answer']",
        f"steps={args.steps}",
        "eval_interval=10",
        "log_period=5",
        "eval_steps=2",
        "per_device_batch_size=8",
        "max_target_length=64",
        "learning_rate=1e-2",
        "lora.lora_rank=8",
        "lora.lora_alpha=16",
        f"checkpoint_period={max(args.steps // 3, 1)}",
    )
    run_module("lorajob_trainer.export", "--checkpoint", layout.checkpoints, "--out", str(out / "adapter"))
    png = metrics.plot_loss_curve(Path(layout.metrics), out / "loss.png")
    logged = [r for r in metrics.read_metrics(Path(layout.metrics)) if "loss" in r]
    first, last = logged[0], logged[-1]
    print(f"loss {first['loss']:.3f} (step {first['step']}) -> {last['loss']:.3f} (step {last['step']}); "
          f"adapter in {out / 'adapter'}; loss curve {png}")


if __name__ == "__main__":
    main()
