"""Peak host memory of trainer processes: 1 process x 4 CPU devices vs each of 2 processes x 2 devices.

    python bench/load_memory.py [--hidden 2048] [--intermediate 16384] [--layers 8] [--heads 8]
                                [--kv-heads 4] [--head-dim 128] [--shards 4] [--steps 2] [--workdir DIR]

Builds a random Qwen3 safetensors checkpoint of the given shape (default: 3.2 GiB in float32, where
the JAX/XLA runtime's ~0.35 GiB is about a tenth, so half the model stands out), then runs the real entry point
`lorajob_trainer.train` for `--steps` LoRA steps, once as one process with four virtual CPU
devices and once as two processes (jax.distributed on loopback) with two devices each. Every
trainer process runs as in the trainer image (torch unimportable) and reports, at the end of setup
(base weights, LoRA, optimizer, data) and at the end of the run, its peak
RSS (VmHWM) and the peaks of its RssFile (mapped file pages) and RssAnon (heap, device
buffers), sampled from /proc/self/status every 5 ms. Ideal per process of two: half the model
plus the runtime; the steps add XLA's working set (on CPU devices, host memory: each device
all-gathers one layer's weights at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
WIDE_QWEN3 = {"hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 128}

sys.path.insert(0, str(REPO_ROOT / "tests" / "trainer"))
# The tests' trainer-image environment (torch hidden) and run arguments.
from test_multiprocess import HIDE_TORCH  # noqa: E402
from trainer_testkit import arithmetic_rows, base_args, write_jsonl  # noqa: E402

# Samples RssFile/RssAnon, snapshots the peaks when setup is done (Trainer.train starts), runs the
# entry point, and reports both snapshots as JSON on the last line of stderr.
LAUNCHER = HIDE_TORCH + """
import json, threading, time
from lorajob_trainer import metrics, train
peaks = {'RssFile': 0, 'RssAnon': 0}
def sample():
    while True:
        with open('/proc/self/status') as status:
            for line in status:
                key, _, value = line.partition(':')
                if key in peaks:
                    peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
        time.sleep(0.005)
def snapshot():
    return {**peaks, 'peak_rss': metrics.peak_host_memory_bytes()}
figures = {}
train_to_end = train.Trainer.train
def train_after_setup(self):
    figures['setup'] = snapshot()
    return train_to_end(self)
train.Trainer.train = train_after_setup
threading.Thread(target=sample, daemon=True).start()
status = train.main()
figures['run'] = snapshot()
print('MEMORY', json.dumps(figures), file=sys.stderr)
sys.exit(status)
"""


def make_model(directory: Path, overrides: dict, shards: int) -> Path:
    if not (directory / "config.json").is_file():
        code = (f"from lorajob_trainer import tiny; "
                f"tiny.make_tiny_checkpoint('qwen3', {str(directory)!r}, shards={shards}, **{overrides!r})")
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=True)
    return directory


def launch(args: list[str], *, devices: int, process_id: int = 0, num_processes: int = 1, port: int = 0):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(process_id),
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def memory(process) -> dict[str, dict[str, int]]:
    _, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"trainer process failed:\n{stderr[-4000:]}")
    return json.loads(stderr.strip().splitlines()[-1].removeprefix("MEMORY "))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def describe(label: str, figures: dict[str, int], model_bytes: int) -> str:
    peak = figures["peak_rss"]
    return (f"  {label:<26} peak RSS {peak / GiB:5.2f} GiB ({peak / model_bytes:4.2f} x model)"
            f"   max RssFile {figures['RssFile'] / GiB:5.2f} GiB   max RssAnon {figures['RssAnon'] / GiB:5.2f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=WIDE_QWEN3["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=WIDE_QWEN3["intermediate_size"])
    parser.add_argument("--layers", type=int, default=WIDE_QWEN3["num_hidden_layers"])
    parser.add_argument("--heads", type=int, default=WIDE_QWEN3["num_attention_heads"])
    parser.add_argument("--kv-heads", type=int, default=WIDE_QWEN3["num_key_value_heads"])
    parser.add_argument("--head-dim", type=int, default=WIDE_QWEN3["head_dim"])
    parser.add_argument("--shards", type=int, default=4, help="safetensors files")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workdir", type=Path, help="keeps the model between runs (default: a temporary folder)")
    args = parser.parse_args()
    overrides = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_hidden_layers": args.layers,
                 "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim}

    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        model_dir = make_model(workdir / "model", overrides, args.shards)
        model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        train_file = write_jsonl(Path(scratch) / "train.jsonl", arithmetic_rows(40))

        def run_args(name: str) -> list[str]:
            return base_args(model_dir, Path(scratch) / name, train_file, f"steps={args.steps}",
                             "per_device_batch_size=1", "max_target_length=16", "enable_checkpointing=False",
                             "enable_tensorboard=False", "lora.lora_rank=2")

        single = memory(launch(run_args("single"), devices=4))
        port = free_port()
        processes = [launch(run_args("multi"), devices=2, process_id=i, num_processes=2, port=port) for i in range(2)]
        multi = [memory(process) for process in processes]

    print(f"model: {model_bytes / GiB:.2f} GiB of float32 safetensors ({args.shards} files), {args.layers} layers")
    for phase, title in (("setup", "after setup (before step 1)"), ("run", f"whole run ({args.steps} steps)")):
        print(title)
        print(describe("1 process x 4 devices", single[phase], model_bytes))
        for index, figures in enumerate(multi):
            print(describe(f"process {index} of 2 x 2 devices", figures[phase], model_bytes))


if __name__ == "__main__":
    main()
