"""The trainer's step on one TPU chip, measured beside the plan's prediction for the same configuration (benchmark).

    .venv/bin/python bench/chip_bench.py plan [--rows NAME...] [--out bench/chip_plan.json]   # here, no TPU needed
    python3 bench/chip_bench.py run --plan bench/chip_plan.json [--rows NAME...] [--steps 10] [--json OUT]
                                    [--profile ROW... --profile-dir DIR]                         # on a v5e chip
    python3 bench/chip_bench.py table RESULTS.json...                                             # the table again

The rows (`ROWS`) are LoRAJobs a user would write for one v5e chip (`ct5lp-hightpu-1t`, topology 1x1): a
catalogue model with random weights, LoRA rank 16 on the family's default targets, bf16, AdamW, remat `auto`.

`plan` runs the fit check the LoRAJob's CPU step runs (`fit.compile_attempt`: the TPU compiler without a TPU):
the remat policy auto takes, HBM per chip and the roofline's step time, saved as JSON. `run`, on the chip, gives
each row a child process of its own (a clean peak-memory figure; one row running out of memory ends only that
row): the same step built by the same code (`run.abstract_run`) with the policy the plan chose (as the train
step does), random weights (trainer_bench.random_like: small ones drawn on the host, each large one by a jit),
compiled (its own memory analysis beside the plan's), two warm-up steps, then `--steps` timed steps on a fixed
batch; rows marked `feed` take their batches from the trainer's data loader instead (packed rows of a generated
dataset, prefetched as in training) and report the host's time per step spent waiting for a batch. It prints one
table: tokens/s, MFU (the 4N LoRA FLOPs model at the chip's 197 TFLOP/s), peak HBM (`memory_stats`: the buffers in
use plus what the TPU reserves for the program's temporaries), compile seconds, and the plan's HBM and step time
with the ratios measured / predicted. `--profile ROW...` also records a trace of three steps of those rows
(`jax.profiler`, with a Perfetto JSON) and prints where the chip's time went, by op and by category; `--peer
SCRIPT` runs Tunix's PeftTrainer (../shared/tools/tunix_peft_bench.py, carried to the chip) after each qwen3 row on
the same shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "bench"), str(REPO_ROOT / "trainer")]  # trainer_bench's helpers; this checkout's trainer

from trainer_bench import child_env, random_like  # noqa: E402

from lorajob_trainer.contract.records import COLUMN_LAYOUTS, PREFERENCE_COLUMN_LAYOUTS, PREFERENCE_METHODS  # noqa: E402
MACHINE_TYPE, TOPOLOGY = "ct5lp-hightpu-1t", "1x1"
"""One v5e chip on a one-chip VM, the machine the device tool lends."""
WARMUP_STEPS = 2
PROFILED_STEPS = 3
CHILD_TIMEOUT_S = 420
"""Rows took 80-135 s on the chip machine (a compile of 45-75 s on its 13 cores), 200-300 s while random weights
were still made one threefry kernel per weight."""
ATTENTION_KERNEL = "splash 1024 blocks (512 for heads over 128), fused backward"
"""How the step's splash kernel is configured (models/splash.py), recorded with each result: results measured
before its change say "splash 512 blocks, dq kernel apart"."""
COMPILATION_CACHE = "/tmp/chip-bench-compilation-cache"
"""JAX's persistent compilation cache, shared by the rows' processes: a row whose step another row compiled (the
data-loader row and its fixed-batch twin) loads it instead of compiling again."""


def stage(row: str, what: str, since: float) -> None:
    """A progress line on stderr (what a row timed out in shows in the parent's error)."""
    print(f"[{row}] {what} after {time.perf_counter() - since:.1f} s", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class Row:
    model: str
    rows: int
    length: int
    base_quantization: str = "none"
    feed: bool = False
    """Batches from the trainer's data loader, not a fixed one."""
    layers: int | None = None
    """The model's first `layers` decoder layers at its real widths (catalog.at_depth): a MoE that fits one chip."""
    experts: int | None = None
    """The routed experts cut to this many, their widths and the experts per token kept: Gemma 4 26B's shortest
    period (6 layers) holds 9.1 GB of experts, too many for one v5e chip beside its 1.5 GB embedding."""
    expert_adapter_kernel: str | None = None
    """The routed experts' adapters in this grouped-matmul kernel (experts.use_adapter_kernel), not `ragged_dot`."""
    plan_of: str | None = None
    """The row whose plan this one runs with: the plan compiles the trainer's kernel."""
    method: str = "sft"
    """The training method (contract.records.TRAINING_METHODS); a preference method's `rows` are pairs, each two rows
    of the batch, every position an answer's."""

    @property
    def hf_config(self) -> dict:
        """The model's config.json: the catalogue's released facts, or a tiny test model's (lorajob_trainer.tiny),
        cut to `layers` and `experts`."""
        from lorajob_trainer import tiny
        from lorajob_trainer.contract import catalog

        if self.model.startswith("tiny-"):
            config = tiny.tiny_config(self.model.removeprefix("tiny-"))
        else:
            config = catalog.released_config(self.model)
        if self.layers is not None:
            config = catalog.at_depth(config, self.layers)
        return config if self.experts is None else dict(config, num_experts=self.experts)

    def config_values(self, remat: str) -> dict:
        return {
            "run_name": "chip-bench", "base_output_directory": "/tmp/chip-bench", "model_name": self.model,
            "load_parameters_path": "random", "hf_train_files": ["generated"], "steps": 1000,
            "max_target_length": self.length, "per_device_batch_size": self.rows, "remat_policy": remat,
            "lora": {"lora_rank": 16, "lora_alpha": 32, "base_quantization": self.base_quantization},
            "method": self.method,
            "train_data_columns": list(PREFERENCE_COLUMN_LAYOUTS[0] if self.method in PREFERENCE_METHODS
                                       else COLUMN_LAYOUTS[0]),
        }


ROWS = {
    "qwen3-0.6b/4x2048": Row("qwen3-0.6b", 4, 2048),
    "qwen3-0.6b/1x8192": Row("qwen3-0.6b", 1, 8192),
    "qwen3-0.6b/4x2048/feed": Row("qwen3-0.6b", 4, 2048, feed=True),
    "qwen3-4b/2x2048": Row("qwen3-4b", 2, 2048),
    "qwen3-4b/1x8192": Row("qwen3-4b", 1, 8192),
    "qwen3-4b/1x2048/dpo": Row("qwen3-4b", 1, 2048, method="dpo", plan_of="qwen3-4b/2x2048"),
    "llama3.1-8b-int8/1x2048": Row("llama3.1-8b", 1, 2048, "int8"),
    "llama3.1-8b-int8/1x8192": Row("llama3.1-8b", 1, 8192, "int8"),
    "llama3.1-8b-int4/1x2048": Row("llama3.1-8b", 1, 2048, "int4"),
    "llama3.1-8b-int4/1x8192": Row("llama3.1-8b", 1, 8192, "int4"),
    "qwen3-30b-a3b-6layers/4x2048": Row("qwen3-30b-a3b", 4, 2048, layers=6),
    "qwen3-30b-a3b-6layers/4x2048/megablox": Row("qwen3-30b-a3b", 4, 2048, layers=6, expert_adapter_kernel="pallas",
                                                 plan_of="qwen3-30b-a3b-6layers/4x2048"),
    "gemma4-26b-6layers-64experts/2x2048": Row("gemma4-26b", 2, 2048, layers=6, experts=64),
    "gemma4-26b-6layers-64experts/2x2048/megablox": Row(
        "gemma4-26b", 2, 2048, layers=6, experts=64, expert_adapter_kernel="pallas",
        plan_of="gemma4-26b-6layers-64experts/2x2048"),
}
PLANNED_ROWS = [name for name, row in ROWS.items() if row.plan_of is None]


def train_config(row: Row, remat: str):
    from lorajob_trainer.contract.config import TrainConfig

    return TrainConfig.from_dict(row.config_values(remat))


# ---------------------------------------------------------------- plan (no TPU: the fit check's compile)


def v5e():
    from lorajob_operator.accelerators import TPU_CHIPS, TPU_MACHINES

    machine = TPU_MACHINES[MACHINE_TYPE]
    return TPU_CHIPS[machine.generation], machine.chips_per_vm


def target(row: Row, remat: str):
    from lorajob_trainer.contract.fit import Target

    return Target(MACHINE_TYPE, TOPOLOGY, 1, 1, row.rows, 1, remat)


def plan_record(attempt, source: str) -> dict:
    return {"fits": attempt.fits, "remat": attempt.remat_policy, "remat_rejected": list(attempt.remat_rejected),
            "hbm_bytes": attempt.total_bytes, "capacity_bytes": attempt.capacity_bytes, "memory": attempt.memory,
            "step_seconds": attempt.step_seconds, "mfu_ceiling": attempt.mfu, "bound": attempt.bound,
            "compile_seconds": attempt.compile_seconds, "error": attempt.error, "source": source}


def plan_row(name: str) -> dict:
    """The fit check of the row's LoRAJob: compiled for a v5e 1x1 topology without a TPU."""
    from lorajob_trainer import fit
    from lorajob_trainer.contract.fit import format_attempt

    row = ROWS[name]
    chip, chips_per_host = v5e()
    attempt = fit.compile_attempt(train_config(row, "auto"), row.hf_config, chip, chips_per_host,
                                  target(row, "auto"))
    for line in format_attempt(attempt):
        print(f"{name}: {line.strip()}", flush=True)
    return plan_record(attempt, "fit check (deviceless)")


def plan_in_parallel(names: list[str], out: str, jobs: int) -> None:
    """`plan` of each row in a process of its own, `jobs` at a time, merged into `out`."""
    env = child_env(JAX_PLATFORMS="cpu")
    pending, running = list(names), []
    parts = Path(out).with_suffix(".parts")
    parts.mkdir(exist_ok=True)
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            part = parts / (name.replace("/", "_") + ".json")
            running.append(subprocess.Popen([sys.executable, __file__, "plan", "--rows", name, "--out", str(part)],
                                            env=env))
        running[0].wait()
        running = [process for process in running if process.poll() is None]
    merged = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    for part in sorted(parts.glob("*.json")):
        merged.update(json.loads(part.read_text()))
    Path(out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {out} ({len(merged)} rows)")


# ---------------------------------------------------------------- run (on the chip, one child per row)


CHIP_COMPILE = "remat auto compiled on the chip (no fit check record)"


def plan_on_chip(row: Row, hf_config: dict) -> tuple[dict, object]:
    """What the train step does under remat auto without the fit check's record (train.remat_for_run): the policy
    with the least recompute whose step, compiled for this chip, fits the chip's capacity; its figures as the plan
    gives them, and the compiled step."""
    import jax

    from lorajob_trainer import fit
    from lorajob_trainer import plan as plan_lib

    chip, _ = v5e()
    choice = plan_lib.choose_remat(train_config(row, "auto"), hf_config, jax.devices(), chip.device().capacity_bytes)
    if choice.step is None:
        raise RuntimeError(f"no remat policy compiles: {choice.error}; " + "; ".join(choice.rejected))
    attempt = fit.attempt_of_step(target(row, "auto"), choice.step, chip, choice.policy, choice.rejected)
    return plan_record(attempt, CHIP_COMPILE), choice.step.executable


def fixed_batch(abstract: dict, vocab_size: int) -> dict:
    import jax
    import jax.numpy as jnp

    accumulation, rows, length = abstract["inputs"].shape
    sharding = abstract["inputs"].sharding

    def make(key):
        tokens = jax.random.randint(key, (accumulation, rows, length + 1), 0, vocab_size, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (accumulation, rows, length))
        return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "weights": jnp.ones(positions.shape, jnp.float32),
                "segment_ids": jnp.ones(positions.shape, jnp.int32), "positions": positions}

    return jax.jit(make, out_shardings={name: sharding for name in abstract})(jax.random.key(1))


def generated_feed(config, mesh, tokenizer_dir: Path, data_file: Path):
    """The trainer's data feed (feed.data_feed: packed, shuffled, prefetched) over a generated dataset of
    question/answer rows, tokenised by the project's tiny tokenizer."""
    import random

    from lorajob_trainer import data as data_lib
    from lorajob_trainer import feed as feed_lib
    from lorajob_trainer import tiny
    from lorajob_trainer.demo import write_jsonl

    tiny.write_tiny_tokenizer(tokenizer_dir)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "seven", "eleven", "plus", "minus", "times", "equals"]
    length = config.max_target_length  # examples of a few to a dozen per row, as SFT data packs
    write_jsonl(data_file, [
        {"question": " ".join(rng.choices(words, k=rng.randint(length // 40, length // 10))),
         "answer": " ".join(rng.choices(words, k=rng.randint(length // 40, length // 8)))}
        for _ in range(5_000)
    ])
    config = config.model_copy(update={"hf_train_files": [str(data_file)], "train_data_columns": ["question", "answer"],
                                       "tokenizer_path": str(tokenizer_dir)})
    tokenizer = data_lib.load_tokenizer(str(tokenizer_dir))
    loaded = feed_lib.load_split(config, data_lib.train_source(config), tokenizer)
    return feed_lib.data_feed(config, mesh, loaded, config.gradient_accumulation_steps, config.epoch_policy)


def measure(name: str, plan: dict, steps: int, profile_dir: str | None, work: Path) -> dict:
    import jax

    from lorajob_trainer import metrics
    from lorajob_trainer import plan as plan_lib
    from lorajob_trainer import run as run_lib

    row = ROWS[name]
    hf_config = row.hf_config
    began = time.perf_counter()
    stage(name, f"imported, on {jax.devices()[0].device_kind}", began)
    executable, compile_s = None, 0.0
    if plan is None and row.plan_of:
        raise RuntimeError(f"no plan for {row.plan_of}, whose plan this row runs with")
    if plan is None:  # as the train step without the fit check's record: remat auto compiled on this chip
        compile_started = time.perf_counter()
        plan, executable = plan_on_chip(row, hf_config)
        compile_s = time.perf_counter() - compile_started
    config = train_config(row, plan["remat"])
    started = time.perf_counter()
    run = run_lib.abstract_run(config, hf_config, jax.devices(), expert_adapter_kernel=row.expert_adapter_kernel)
    base = random_like(run.base, 0)
    adapters = random_like(run.adapters(), 1)
    opt_state = jax.jit(run.optimizer.init, out_shardings=run.shardings["optimizer"])(adapters)
    batch = fixed_batch(run.batch, hf_config["vocab_size"])
    reference = (random_like(run.adapters(), 2),) if run.steps.takes_reference else ()
    jax.block_until_ready((base, adapters, opt_state, batch, reference))
    made_s = time.perf_counter() - started
    stage(name, f"random weights made ({made_s:.1f} s)", began)
    if executable is None:
        compile_started = time.perf_counter()
        with jax.set_mesh(run.mesh):
            executable = run.steps.train.lower(*run.arguments()).compile()
        compile_s = time.perf_counter() - compile_started
    stage(name, f"compiled ({compile_s:.1f} s)", began)
    compiled_hbm = plan_lib.describe_compiled(executable, run, (adapters, opt_state, base, batch, *reference),
                                              0.0).memory.total
    compiled = executable
    feed = generated_feed(config, run.mesh, work / "tokenizer", work / "data.jsonl") if row.feed else None

    def next_batch(index: int) -> tuple[dict, float]:
        if feed is None:
            return batch, 0.0
        waited = time.perf_counter()
        return feed.next_batch(index), time.perf_counter() - waited

    with jax.set_mesh(run.mesh):
        for index in range(WARMUP_STEPS):
            adapters, opt_state, out = compiled(adapters, opt_state, base, next_batch(index)[0], *reference)
        float(out["loss"])
        host_s = 0.0
        tokens = 0.0
        start = time.perf_counter()
        for index in range(steps):
            current, waited = next_batch(WARMUP_STEPS + index)
            host_s += waited
            adapters, opt_state, out = compiled(adapters, opt_state, base, current, *reference)
            tokens += out["real_tokens"]
        loss, tokens = float(out["loss"]), float(tokens)
        elapsed = time.perf_counter() - start
        stage(name, f"{steps} steps timed ({elapsed:.1f} s)", began)
        profile = profiled_ops(compiled, (adapters, opt_state, base, batch, *reference), profile_dir) if profile_dir else None
    if feed is not None:
        feed.close()
    tokens_per_s = tokens / elapsed
    peak = metrics.peak_flops_per_device(jax.devices()[0].device_kind, None)
    return {
        "row": name, "device": jax.devices()[0].device_kind, "remat": plan["remat"], "steps": steps,
        "tokens_per_s": tokens_per_s, "step_s": elapsed / steps, "host_wait_s_per_step": host_s / steps,
        "mfu": metrics.mfu(tokens_per_s, run.flops, jax.device_count(), peak),
        "gflops_per_token": run.flops.per_token / 1e9,
        "peak_hbm_bytes": metrics.peak_device_memory_bytes(jax.local_devices()),
        "attention_kernel": ATTENTION_KERNEL,
        "memory_stats": jax.local_devices()[0].memory_stats(),
        "hbm_limit_bytes": metrics.device_memory_limit_bytes(jax.local_devices()),
        "chip_compiled_hbm_bytes": compiled_hbm, "compile_s": compile_s, "weights_made_s": made_s,
        "final_loss": loss, "real_tokens_per_step": tokens / steps, "profile": profile,
        "plan": plan,
    }


def profiled_ops(compiled, arguments, profile_dir: str) -> dict:
    """Three steps traced (jax.profiler, with a Perfetto JSON); the chip's time by XLA op, largest first."""
    import jax

    adapters, opt_state, base, batch, *reference = arguments
    jax.profiler.start_trace(profile_dir, create_perfetto_trace=True)
    for _ in range(PROFILED_STEPS):
        adapters, opt_state, out = compiled(adapters, opt_state, base, batch, *reference)
    float(out["loss"])
    jax.profiler.stop_trace()
    return op_breakdown(Path(profile_dir))


GROUPED_MATMUL_MARKS = {"ragged_dot (XLA)": ("ragged-dot", "ragged_dot"), "gmm (Pallas megablox)": ("gmm",)}
"""How an op of the trace shows it is a grouped matmul of the routed experts, per kernel: in its name, its HLO text
or the JAX operation it came from (megablox' kernels are named gmm and tgmm)."""
GROUPED_MATMUL_FIELDS = ("long_name", "tf_op", "source")
SELF_TIME = "self time"
"""How a profile's ops are counted (`self_times`); profiles recorded before 2026-12-07 lack the mark."""


def self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """Each complete event of one track with its own time: its duration less that of the events nested in it (a
    while loop's or a conditional's event spans the ops of its body, which have events of their own)."""
    ordered = sorted(events, key=lambda event: (float(event["ts"]), -float(event.get("dur", 0.0))))
    durations = [float(event.get("dur", 0.0)) for event in ordered]
    ends = [float(event["ts"]) + duration for event, duration in zip(ordered, durations)]
    own = list(durations)
    enclosing: list[int] = []
    for index, event in enumerate(ordered):
        while enclosing and ends[enclosing[-1]] <= float(event["ts"]):
            enclosing.pop()
        if enclosing:
            own[enclosing[-1]] -= durations[index]
        enclosing.append(index)
    return list(zip(ordered, own))


def op_breakdown(profile_dir: Path, top: int = 25) -> dict:
    """Device time by op name from the newest Perfetto JSON trace under `profile_dir`: the events of the TPU's
    tracks ("/device:TPU:0" processes), each counted for its own time (`self_times`: a loop is not counted again
    beside the ops of its body), summed by name, and the share of each."""
    traces = sorted(profile_dir.rglob("*trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        return {"error": f"no Perfetto trace under {profile_dir}"}
    trace = json.loads(gzip.open(traces[-1]).read())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device_pids = {event["pid"] for event in events if event.get("ph") == "M" and event.get("name") == "process_name"
                   and "TPU" in str(event.get("args", {}).get("name", ""))}
    threads = {(event["pid"], event["tid"]): event["args"]["name"] for event in events
               if event.get("ph") == "M" and event.get("name") == "thread_name"}
    on_track: dict[str, list[dict]] = {}
    for event in events:
        if event.get("ph") == "X" and event.get("pid") in device_pids:
            on_track.setdefault(threads.get((event["pid"], event.get("tid")), str(event.get("tid"))), []).append(event)
    by_track: dict[str, Counter] = {}
    categories: dict[str, Counter] = {}
    grouped: dict[str, Counter] = {}
    details: dict[str, dict] = {}
    for track, track_events in on_track.items():
        for event, duration in self_times(track_events):
            by_track.setdefault(track, Counter())[event["name"]] += duration
            args = event.get("args") or {}
            category = args.get("hlo_category") or args.get("category") or "-"
            categories.setdefault(track, Counter())[str(category)] += duration
            described = " ".join([event["name"], *(str(args.get(key, "")) for key in GROUPED_MATMUL_FIELDS)]).lower()
            for kernel, marks in GROUPED_MATMUL_MARKS.items():
                if any(mark in described for mark in marks):
                    grouped.setdefault(track, Counter())[kernel] += duration
            details.setdefault(event["name"], {key: str(value)[:200] for key, value in args.items()})
    ops_track = next((track for track in by_track if "XLA Ops" in track), None)
    if ops_track is None:
        return {"error": "no 'XLA Ops' track in the trace", "tracks": sorted(by_track)}
    ops = by_track[ops_track]
    total = sum(ops.values())
    return {"track": ops_track, "device_us_per_step": total / PROFILED_STEPS, "counted": SELF_TIME,
            "top": [(name, us / PROFILED_STEPS, us / total) for name, us in ops.most_common(top)],
            "categories": [(name, us / PROFILED_STEPS, us / total) for name, us in categories[ops_track].most_common()],
            "grouped_matmul": [(kernel, us / PROFILED_STEPS, us / total)
                               for kernel, us in grouped.get(ops_track, Counter()).most_common()],
            "details": {name: details[name] for name, _ in ops.most_common(top)},
            "trace": str(traces[-1])}


def last_error(stderr: str, returncode: int) -> str:
    """The line of a failed child's stderr that says what failed: its last exception line, else its last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or "RESOURCE_EXHAUSTED" in line]
    return (errors[-1] if errors else lines[-1] if lines else f"exit {returncode}")[:400]


def run_row(name: str, args) -> dict:
    """`measure` of one row in a child process; its error when it fails."""
    argv = [sys.executable, __file__, "child", "--row", name, "--plan", args.plan, "--steps", str(args.steps)]
    if name in (args.profile or []):
        argv += ["--profile-dir", str(Path(args.profile_dir) / name.replace("/", "_"))]
    env = child_env(JAX_COMPILATION_CACHE_DIR=os.environ.get("JAX_COMPILATION_CACHE_DIR", COMPILATION_CACHE))
    started = time.perf_counter()
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.child_timeout)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
        stages = [line for line in stderr.splitlines() if line.startswith(f"[{name}]")]
        return {"row": name, "error": f"timed out after {args.child_timeout} s; last: {stages[-1] if stages else 'no stage'}",
                "log": stderr[-3000:]}
    for line in completed.stderr.splitlines():
        if line.startswith(f"[{name}]"):
            print(line, file=sys.stderr, flush=True)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if completed.returncode != 0 or not lines:
        return {"row": name, "error": last_error(completed.stderr, completed.returncode),
                "log": completed.stderr[-3000:], "wall_s": time.perf_counter() - started}
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "wall_s": time.perf_counter() - started}


TUNIX_REMAT = {"none": "none", "minimal": "block", "attention": "decoder", "full": "decoder"}
"""Tunix Qwen3's RematConfig nearest to each of ours: BLOCK recomputes the attention block, DECODER the whole layer."""
TUNIX_PRESETS = {"qwen3-0.6b": "qwen3_0p6b", "qwen3-4b": "qwen3_4b"}


def run_peer(result: dict, args) -> dict | None:
    """The peer on the row just measured (same shapes, the remat nearest ours, our FLOPs model for its MFU): the
    Tunix PeftTrainer script named by --peer, in a child of its own; None for rows Tunix has no model for."""
    row = ROWS[result["row"]]
    if row.feed or row.base_quantization != "none" or row.model not in TUNIX_PRESETS or "error" in result:
        return None
    name = f"tunix-peft/{result['row']}"
    remat = TUNIX_REMAT[result["remat"]]
    argv = [sys.executable, args.peer, "--preset", TUNIX_PRESETS[row.model], "--batch", str(row.rows),
            "--seq", str(row.length), "--steps", str(args.steps), "--remat", remat,
            "--gflops-per-token", str(result["gflops_per_token"])]
    try:
        completed = subprocess.run(argv, capture_output=True, text=True, env=child_env(), timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        return {"row": name, "error": f"did not finish (remat {remat}) within {args.peer_timeout} s", "plan": {}}
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"row": name, "error": last_error(completed.stderr, completed.returncode), "plan": {},
                "log": completed.stderr[-3000:]}
    peer = json.loads(lines[-1].removeprefix("RESULT "))
    return {"row": name, "remat": f"tunix {remat}", "tokens_per_s": peer["tokens_per_s"], "mfu": peer.get("mfu_v5e_197"),
            "peak_hbm_bytes": peer["peak_hbm_gib"] * 2**30, "step_s": peer["step_s"],
            "compile_s": peer["compile_s"], "host_wait_s_per_step": 0.0, "plan": {}, "peer": peer}


# ---------------------------------------------------------------- table


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _percent(share) -> str:
    return "-" if share is None else f"{100 * share:.1f} %"


def _ratio(measured, predicted) -> str:
    return "-" if not measured or not predicted else f"{measured / predicted:.2f}"


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(results: list[dict]) -> list[str]:
    lines = ["| row | remat (auto) | tokens/s | MFU | peak HBM GB | plan HBM GB | measured/plan HBM | step s | "
             "plan step s | measured/plan step | compile s | host wait s/step | attention |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        plan = result.get("plan") or {}
        if "error" in result:
            lines.append(f"| {result['row']} | {plan.get('remat', '-')} | {result['error'][:160]} | | | "
                         f"{_gb(plan.get('hbm_bytes'))} | | | {_seconds(plan.get('step_seconds'))} | | | | |")
            continue
        lines.append(
            f"| {result['row']} | {result['remat']} | {result['tokens_per_s']:,.0f} | {_percent(result['mfu'])} | "
            f"{_gb(result['peak_hbm_bytes'])} | {_gb(plan.get('hbm_bytes'))} | "
            f"{_ratio(result['peak_hbm_bytes'], plan.get('hbm_bytes'))} | {result['step_s']:.3f} | "
            f"{_seconds(plan.get('step_seconds'))} | {_ratio(result['step_s'], plan.get('step_seconds'))} | "
            f"{result['compile_s']:.0f} | {result['host_wait_s_per_step']:.4f} | {result.get('attention_kernel', '-')} |"
        )
    return lines


def print_profiles(results: list[dict]) -> None:
    for result in results:
        profile = result.get("profile")
        if not profile:
            continue
        if "error" in profile:
            print(f"profile of {result['row']}: {profile['error']}")
            continue
        print(f"profile of {result['row']}: {profile['device_us_per_step'] / 1e3:.1f} ms of chip time per step "
              f"({profile['track']}), largest ops:")
        if profile.get("counted") != SELF_TIME:
            print("  (recorded before 2026-12-07: a loop counted whole beside the ops of its body, so the total and "
                  "the shares are of a sum that counts the scanned layers twice)")
        for name, us, share in profile["top"]:
            print(f"  {us / 1e3:9.2f} ms  {100 * share:5.1f} %  {name[:40]}  {profile['details'].get(name, {})}"[:300])
        print("  by category:")
        for name, us, share in profile["categories"]:
            print(f"  {us / 1e3:9.2f} ms  {100 * share:5.1f} %  {name}")
        print("  the routed experts' grouped matmuls:")
        for kernel, us, share in profile.get("grouped_matmul") or [("none found", 0.0, 0.0)]:
            print(f"  {us / 1e3:9.2f} ms  {100 * share:5.1f} %  {kernel}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    plan_parser = sub.add_parser("plan", help="the fit check's prediction for each row (TPU compiler, no TPU)")
    plan_parser.add_argument("--rows", nargs="+", choices=PLANNED_ROWS, default=PLANNED_ROWS)
    plan_parser.add_argument("--out", default=str(REPO_ROOT / "bench" / "chip_plan.json"))
    plan_parser.add_argument("--jobs", type=int, default=1, help="rows compiled at once, each in a process of its own")
    run_parser = sub.add_parser("run", help="measure each row on the chip, one child process per row")
    run_parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=list(ROWS))
    run_parser.add_argument("--plan", default=str(REPO_ROOT / "bench" / "chip_plan.json"))
    run_parser.add_argument("--steps", type=int, default=10)
    run_parser.add_argument("--json", help="write the results here too")
    run_parser.add_argument("--profile", nargs="+", choices=sorted(ROWS), help="trace three steps of these rows")
    run_parser.add_argument("--profile-dir", default="/tmp/chip-bench-profile")
    run_parser.add_argument("--child-timeout", type=int, default=CHILD_TIMEOUT_S)
    run_parser.add_argument("--peer", help="Tunix's PeftTrainer script (../shared/tools/tunix_peft_bench.py): run it "
                                           "after each qwen3 row on the same shapes")
    run_parser.add_argument("--peer-timeout", type=int, default=240)
    table_parser = sub.add_parser("table", help="print the table of earlier results")
    table_parser.add_argument("results", nargs="+")
    table_parser.add_argument("--plan", help="also list the rows no result has, with this plan's figures")
    child = sub.add_parser("child")
    child.add_argument("--row", required=True)
    child.add_argument("--plan", required=True)
    child.add_argument("--steps", type=int, required=True)
    child.add_argument("--profile-dir")
    args = parser.parse_args(argv)

    if args.command == "plan" and args.jobs > 1:
        plan_in_parallel(args.rows, args.out, args.jobs)
    elif args.command == "plan":
        existing = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        for name in args.rows:
            existing[name] = plan_row(name)
            Path(args.out).write_text(json.dumps(existing, indent=1) + "\n")
        print(f"wrote {args.out}")
    elif args.command == "child":
        plans = json.loads(Path(args.plan).read_text()) if Path(args.plan).exists() else {}
        plan = plans.get(ROWS[args.row].plan_of or args.row)
        work = Path(os.environ.get("TMPDIR", "/tmp")) / f"chip-bench-{os.getpid()}"
        work.mkdir(parents=True, exist_ok=True)
        print("RESULT " + json.dumps(measure(args.row, plan, args.steps, args.profile_dir, work)), flush=True)
    elif args.command == "run":
        plans = json.loads(Path(args.plan).read_text()) if Path(args.plan).exists() else {}
        results = []
        for name in args.rows:
            result = run_row(name, args)
            result.setdefault("plan", plans.get(ROWS[name].plan_of or name))
            results.append(result)
            print("\n".join(table([result])[2:]), flush=True)
            peer = run_peer(result, args) if args.peer else None
            if peer:
                results.append(peer)
                print("\n".join(table([peer])[2:]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print("\n".join(table(results)))
        print_profiles(results)
    else:
        results = [result for path in args.results for result in json.loads(Path(path).read_text())]
        measured = {result["row"] for result in results if "error" not in result}
        results = [result for result in results if "error" not in result or result["row"] not in measured]
        if args.plan:
            plans, listed = json.loads(Path(args.plan).read_text()), {result["row"] for result in results}
            results += [{"row": name, "error": "not measured", "plan": plans.get(row.plan_of or name)}
                        for name, row in ROWS.items()
                        if name not in listed]
        print("\n".join(table(results)))
        print_profiles(results)


if __name__ == "__main__":
    main()
