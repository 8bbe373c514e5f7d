"""QLoRA on CPU: loss after N steps and host peak RSS for the base held as loaded vs quantised (benchmark).

    .venv/bin/python bench/qlora_loss.py [--family qwen3] [--steps 60] [--quantizations none int8 fp8 int4 nf4]

Each quantisation trains the same LoRA (rank 8, q/k/v/o and MLP) on the same arithmetic question/answer rows
from the same seed, on a small generated Qwen3 (random weights, float32 on CPU), in a fresh process, and the
table gives the mean loss of the first and last 10 steps and the process's peak RSS. Random weights are the
hardest case for per-channel quantisation (no outlier structure to exploit), so the gaps are an upper end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "trainer"))

from trainer_testkit import arithmetic_rows, base_args, tiny_checkpoint, write_jsonl  # noqa: E402

CHILD = """
import json, resource, sys
from lorajob_trainer import train
code = train.main(json.loads(sys.argv[1]))
print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
sys.exit(code)
"""


def run(model: Path, family: str, data: Path, out: Path, steps: int, quantization: str) -> dict:
    args = base_args(model, out, data, f"model_name=tiny-{family}", f"steps={steps}", "checkpoint_period=100000", "enable_tensorboard=False",
                     "lora.lora_rank=8", "lora.lora_alpha=16", f"lora.base_quantization={quantization}")
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", **dict(__import__("os").environ)})
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1][:200]}
    losses = [r["loss"] for r in map(json.loads, (out / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    rss = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KIB"))
    return {"first": sum(losses[:10]) / 10, "last": sum(losses[-10:]) / 10, "peak_rss_mib": rss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen3", help="a tiny family: qwen3, llama3, gemma3, qwen3-moe, ...")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quantizations", nargs="+", default=["none", "int8", "fp8", "int4", "nf4"])
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="lorajob-qlora-"))
    model = tiny_checkpoint(root / "model", args.family)
    data = write_jsonl(root / "train.jsonl", arithmetic_rows(400))
    print(f"{'base':<6} {'loss first 10':>14} {'loss last 10':>13} {'vs none':>8} {'peak RSS MiB':>13}", flush=True)
    reference = None
    for quantization in args.quantizations:
        row = run(model, args.family, data, root / quantization, args.steps, quantization)
        if "error" in row:
            print(f"{quantization:<6} {row['error']}", flush=True)
            continue
        reference = reference or row["last"]
        print(f"{quantization:<6} {row['first']:>14.4f} {row['last']:>13.4f} {row['last'] / reference:>8.3f} "
              f"{row['peak_rss_mib']:>13.0f}", flush=True)


if __name__ == "__main__":
    main()
