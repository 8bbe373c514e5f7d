"""Correctness on a real TPU chip (v5e): what the CPU suite checks through Pallas' interpreter and CPU XLA, checked
again where the trainer is meant to run (issue 40, "proven on the chip", item 2). On the chip the splash kernel is
compiled by Mosaic, matrix products run on the MXU at the precision XLA's TPU backend chooses, and bf16 is the
trainer's default dtype: none of this happens on a CPU, so none of it is covered by the CPU suite.

1. The splash-attention kernel compiled for the chip (models/splash.py) against dense attention computed in float32:
   the output and its query, key and value gradients, with packed and padded rows, grouped KV heads, causal and
   Gemma 3's sliding window (tests/trainer/test_splash_attention.py's check, without the interpreter).
2. The training forward (segment ids -> attention mask -> the splash kernel on a 1-device TPU mesh, the layers
   scanned as the step runs them, LoRA on the family's projections) at Qwen3-0.6B's widths (2 layers) and at
   Gemma 4 26B's attention widths (one period: sliding layers and a global layer of head size 512), the vocabulary
   cut, on the chip against the chip machine's CPU for the same weights: logits and every adapter's gradient in
   float32 on both (tight), and bf16 logits on the chip (the trainer's dtype there) against float32 on the CPU
   (bf16's tolerance).
3. Greedy generation with the KV cache equals one full forward per token, on the chip (tests/trainer/
   test_generate.py's check, run on a trainer built there).
4. A short real training run on the chip on generated arithmetic: its loss falls as the same run's on the CPU (a
   subprocess), and the adapter it trained is exported to PEFT's format. With LORAJOB_CHIP_OUT set, that directory
   receives (flat) the exported adapter, the tiny base it was trained on, our float32 logits of a fixed prompt with
   that adapter (computed on the chip machine's CPU) and the figures measured here: tests/trainer/
   test_chip_adapter.py compares PEFT's logits with ours on a machine with torch (LORAJOB_CHIP_ADAPTER=that copy).

Run on the chip (no conftest, no xdist; one process holds the chip; add -rP to see the measured errors):

    JAX_PLATFORMS=tpu,cpu PYTHONPATH=$PYTHONPATH:trainer:tests/trainer python3 -m pytest -c /dev/null --noconftest \\
        -o addopts= -p no:cacheprovider -q tests/chip/

Skipped where JAX's default backend is not a TPU (the suite's conftest pins JAX to the CPU, so CI skips it).
LORAJOB_CHIP_TESTS_ON_CPU=1 runs it on a CPU anyway, the splash kernel in Pallas' interpreter wherever the chip
would run it (the model's training forward included), to check these tests' own logic without a chip; the
comparisons are then CPU against CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

ON_CPU = os.environ.get("LORAJOB_CHIP_TESTS_ON_CPU") == "1"
if jax.default_backend() != "tpu" and not ON_CPU:
    pytest.skip(
        f"needs a TPU chip: JAX's default backend here is {jax.default_backend()!r} (run with JAX_PLATFORMS=tpu,cpu "
        "on a TPU machine; LORAJOB_CHIP_TESTS_ON_CPU=1 runs these checks on a CPU, the kernel interpreted)",
        allow_module_level=True,
    )

TRAINER_TESTS = Path(__file__).resolve().parents[1] / "trainer"
if str(TRAINER_TESTS) not in sys.path:  # trainer_testkit and the CPU tests' helpers
    sys.path.insert(0, str(TRAINER_TESTS))

import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from test_generate import MAX_NEW_TOKENS  # noqa: E402
from test_generate import _checkpoint as generation_checkpoint  # noqa: E402
# The CPU test's whole check, called on a trainer built on the chip (renamed, so pytest does not collect it here).
from test_generate import test_generation_equals_one_full_forward_per_token as check_generation  # noqa: E402
from test_parity import jax_logits  # noqa: E402
from test_splash_attention import kernel_forwards, outputs_and_gradients  # noqa: E402
from trainer_testkit import (  # noqa: E402
    arithmetic_rows,
    base_args,
    splash_in_interpreter,
    tiny_checkpoint,
    trainer_env,
    write_jsonl,
)

from lorajob_trainer import evaluate, export, loading, lora, models  # noqa: E402
from lorajob_trainer import run as run_lib  # noqa: E402
from lorajob_trainer import mesh as mesh_lib  # noqa: E402
from lorajob_trainer import step as step_lib  # noqa: E402
from lorajob_trainer import train as train_lib  # noqa: E402
from lorajob_trainer.contract import catalog  # noqa: E402
from lorajob_trainer.contract.config import LoraConfig, MeshConfig, TrainConfig  # noqa: E402
from lorajob_trainer.models import experts, splash  # noqa: E402

CHIP = jax.devices()[0]
"""The TPU (with LORAJOB_CHIP_TESTS_ON_CPU: the first CPU device)."""
HOST = jax.devices("cpu")[0]
"""The chip machine's CPU: the reference."""
INTERPRET = CHIP.platform != "tpu"
OUT = Path(os.environ["LORAJOB_CHIP_OUT"]) if os.environ.get("LORAJOB_CHIP_OUT") else None
MEASURED: dict[str, dict] = {}


def record(check: str, **values) -> None:
    """Print what a check measured (pytest -rP or -s shows it) and, with LORAJOB_CHIP_OUT, keep it in
    chip_measurements.json there (rewritten after each check, so an interrupted run keeps what it measured)."""
    MEASURED[check] = {"device": CHIP.device_kind, "interpreted_kernel": INTERPRET, **values}
    print(f"{check}: {json.dumps(MEASURED[check])}")
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "chip_measurements.json").write_text(json.dumps(MEASURED, indent=1) + "\n")


def highest():
    """Float32 matrix products at float32 precision (the TPU's default runs them in bf16 passes: about three
    digits), the splash kernel's too (Mosaic's fp32 contraction)."""
    return jax.default_matmul_precision("highest")


@contextlib.contextmanager
def chip_kernels():
    """On a TPU, nothing changes. With LORAJOB_CHIP_TESTS_ON_CPU, the splash kernel is used wherever it would be on a
    TPU (a training forward on a mesh, lengths the kernel's blocks divide; splash.applies' rule for one device less
    its platform), in Pallas' interpreter."""
    with splash_in_interpreter() if INTERPRET else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def dense_attention():
    """The dense attention wherever the kernel would run: the chip's reference for its own kernel."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(splash, "applies", lambda *args: False)
        yield


def max_error(got: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(max |got - expected|, max |expected|)."""
    return float(np.abs(got - expected).max()), float(np.abs(expected).max())


# ---------------------------------------------------------------- 1. splash kernel against dense attention

KERNEL_TOLERANCE = {"highest": 1e-4, "default": 2e-2}
"""The kernel's largest error against float32 dense attention, relative to the largest |value| of the compared array
(output, or one gradient). `highest`: its products at float32 (Mosaic's fp32 contraction); what is left is the
order of summation and the chip's exp, which agrees with a CPU's to about five digits (seen on a v5e, 2026-12-06:
4e-7 for the output, up to 3.8e-5 for the gradients). `default`: the chip's default precision, which multiplies
float32 inputs in one bf16 pass (8 bits of mantissa, a relative rounding of 2^-9 ~ 2e-3 per operand); scores,
probabilities and the gradients' products each carry a few such roundings: a few 1e-3 of the values' scale (seen:
2.5e-3 to 5.1e-3), bounded with a margin of four."""


@pytest.mark.parametrize("precision", ["highest", "default"])
@pytest.mark.parametrize("window", [None, 200], ids=["causal", "sliding-window"])
@pytest.mark.parametrize("length", [384, 2048])
def test_splash_kernel_equals_dense_attention_with_its_gradients(length, window, precision):
    """tests/trainer/test_splash_attention.py's inputs: 2 rows (row 0 packs three sequences, row 1 ends in padding),
    4 query heads on 2 KV heads of 128; the reference is dense attention in float32. 384 positions run the kernel
    in 128-position blocks, 2,048 in the 1,024-position blocks a training step of that length uses."""
    assert splash.block_size(length) == {384: splash.BLOCK, 2048: splash.LARGEST_BLOCK}[length]
    with highest():
        dense = outputs_and_gradients("dense", window, length=length)
    with highest() if precision == "highest" else contextlib.nullcontext():
        splashed = outputs_and_gradients("splash", window, length=length, interpret=INTERPRET)
    errors = {}
    for name, got, expected in zip(("output", "d_query", "d_key", "d_value"), splashed, dense, strict=True):
        error, scale = max_error(got, expected)
        errors[name] = {"max_abs_error": error, "max_abs_value": scale, "relative": error / scale}
    record(f"splash-{length}-{'causal' if window is None else 'window'}-{precision}", errors=errors)
    tolerance = KERNEL_TOLERANCE[precision]
    for name, got, expected in zip(errors, splashed, dense, strict=True):
        assert errors[name]["relative"] <= tolerance, (name, errors[name])
        np.testing.assert_allclose(got, expected, atol=tolerance * errors[name]["max_abs_value"], rtol=tolerance)


# ---------------------------------------------------------------- 2. the model's logits, chip against CPU

REAL_WIDTHS = {
    # Qwen3-0.6B's widths (bench/trainer_bench.py's "0.6b"), 2 layers, the vocabulary cut to 4,096.
    "qwen3": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0, "attention_bias": False, "max_position_embeddings": 40960,
        "torch_dtype": "bfloat16", "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": True,
    },
    # Gemma 4 26B-A4B's attention at its widths: one period (5 sliding layers of head size 256, one global layer of
    # head size 512 with k = v and partial RoPE), the vocabulary cut to 4,096 and the window to 128 positions so
    # that it bites within the rows. The routed experts are off (the 31B's dense layer): the check is the
    # attention's, and a routing choice that flips on a near-tie between the chip's rounding and the CPU's would
    # move a token's output by more than any rounding.
    "gemma4": dict(
        catalog.at_depth(catalog.released_config("gemma4-26b"), 6),
        vocab_size=4096, sliding_window=128, enable_moe_block=False,
    ),
}
ROWS, LENGTH = 2, 256
"""Two rows of two of the kernel's 128-wide blocks (so the chip's forward runs the splash kernel)."""
ACTIVATION_GAIN = 1.6
"""Every matrix's (and adapter's) random weights have standard deviation ACTIVATION_GAIN / sqrt(hidden size) (0.05
at Qwen3-0.6B's 1,024), so activations stay of order one and the logits spread over a few units; norm scales are
1 + 0.1 * N(0, 1)."""
FLOAT32_TOLERANCE_PER_LAYER = 1e-5
"""float32 on the chip at `highest` against float32 on the CPU, or the kernel against the dense attention on the
chip: max |logit difference| relative to the largest |logit|, per decoder layer. What differs is only the order of
summation and the chip's transcendental functions (about six digits per operation); the residual stream carries each
layer's difference into the next, so the bound grows with the depth. Seen on a v5e: chip against CPU, Qwen3 (2
layers) 3.8e-6, Gemma 4 (6 layers, a norm after every sublayer) 2.0e-5; the kernel against the dense attention on
the chip 6.6e-7 and 2.2e-6."""
GRADIENT_TOLERANCE_PER_LAYER = 5e-5
"""The same for each adapter's gradient of sum(logits * a fixed cotangent), relative to that gradient's largest
|value|: the backward sums over every position and head (the kernel's backward in its own blocked order), a few
times the forward's reordering. Seen on a v5e: chip against CPU 4.0e-5 (Qwen3) and 1.1e-4 (Gemma 4); the kernel
against the dense attention on the chip 3.9e-5 in both."""
BF16_TOLERANCE = 2**-9 * 16
"""bf16 on the chip against float32 on the CPU: max |log-softmax difference| relative to the largest |logit|.
bf16 keeps 8 bits of mantissa (a relative rounding of u = 2^-9 ~ 2e-3): every weight and every activation between
two operations is rounded, matrix products accumulate in float32. With tens of roundings on each path through two
layers, independent errors grow like their square root: about 5-10 u. 16 u (3 %) bounds that with a margin (seen on
a v5e: 1.9 %, a log-probability off by 0.15 at worst; the same on a CPU in bf16: 2.0 %)."""
BF16_MEAN_TOLERANCE = 2**-9 * 4
"""bf16's mean |log-softmax difference| over all compared entries, relative to the largest |logit|: the typical
error is a few times smaller than the worst (seen on a v5e: 0.27 %, 0.02 in log-probability)."""
ARGMAX_AGREEMENT = 0.9
"""bf16 on the chip picks float32's top token at this share of positions at least: the top two logits of 4,096
spread over a few units are typically ~0.3 apart, above bf16's error, but not everywhere (seen on a v5e: 95.8 %)."""


def real_width_forward(hf_config: dict, dtype, mesh):
    """(graphdef, LoRA state, base state) of `hf_config` with LoRA rank 16 on every projection the family adapts by
    default, as the trainer builds it for a step (run.abstract_model; the layers stacked for the scan), every value
    abstract."""
    model = run_lib.abstract_model(hf_config, LoraConfig(lora_rank=16, lora_alpha=32), mesh, dtype)
    graphdef, _, lora_state, base = step_lib.split_for_step(model.model, model.layer_period)
    return graphdef, lora_state, base


SCORE_NORMS = ("_query_norm", "_key_norm")
"""Gemma 4 scales its attention scores by its query and key norms alone (no 1/sqrt(head size)): with unit norm scales
the scores of random weights have a standard deviation of sqrt(head size), 16 to 23, and each query attends to one
key, a degenerate softmax whose ties any rounding flips. These scales start at head size^-1/4 instead, so the scores
are of order one, as in a trained model."""


def random_values(states: tuple[nnx.State, ...], std: float) -> list[dict[tuple, np.ndarray]]:
    """Random float32 values for every variable of `states` (matrices N(0, std^2), scales 1 + 0.1 N(0, 1), those of
    SCORE_NORMS smaller), made by one jit on the CPU (a jit per weight would compile once per shape: minutes on a
    TPU); as host arrays by path."""
    flats = [[(path, variable.get_value()) for path, variable in nnx.to_flat_state(state)] for state in states]
    entries = [(path, value.shape) for flat in flats for path, value in flat]

    def make(key):
        keys = jax.random.split(key, len(entries))
        values = []
        for k, (path, shape) in zip(keys, entries):
            noise = jax.random.normal(k, shape, jnp.float32)
            is_scale = "scale" in str(path[-1]) or (path[-1] == "w" and any("norm" in str(part) for part in path))
            value = 1.0 + 0.1 * noise if is_scale else std * noise
            if any(part in SCORE_NORMS for part in path):
                value = value * shape[-1] ** -0.25
            values.append(value)
        return values

    with jax.default_device(HOST):
        values = [np.asarray(v) for v in jax.jit(make)(jax.random.key(0))]
    made, start = [], 0
    for flat in flats:
        made.append({path: values[start + i] for i, (path, _) in enumerate(flat)})
        start += len(flat)
    return made


def placed(state: nnx.State, values: dict[tuple, np.ndarray], mesh, dtype) -> nnx.State:
    """`state` with `values` (cast to `dtype` on the host) replicated over `mesh`."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return nnx.from_flat_state([
        (path, variable.replace(jax.device_put(values[path].astype(dtype), sharding)))
        for path, variable in nnx.to_flat_state(state)
    ])


def packed_batch(vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """tokens, positions and segment ids [ROWS, LENGTH]: row 0 packs three sequences (positions restart in each),
    row 1 is one sequence followed by padding."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab_size, (ROWS, LENGTH)).astype(np.int32)
    segments = np.ones((ROWS, LENGTH), np.int32)
    segments[0, 90:170], segments[0, 170:] = 2, 3
    segments[1, 200:] = 0
    positions = np.zeros((ROWS, LENGTH), np.int32)
    for row in range(ROWS):
        for segment in set(segments[row].tolist()) - {0}:
            where = np.flatnonzero(segments[row] == segment)
            positions[row, where] = np.arange(len(where))
    return tokens, positions, segments


def forward_on(mesh, graphdef, lora_state, base, batch, cotangent) -> tuple[np.ndarray, dict, int]:
    """(float32 logits, the adapters' gradients of sum(logits * cotangent) by path, splash kernel forwards in the
    traced program) of the model's training forward (models.forward: the attention mask from the segment ids) on
    `mesh`, jitted as the step is."""
    sharding = NamedSharding(mesh, PartitionSpec())
    arguments = (lora_state, base, *(jax.device_put(x, sharding) for x in (*batch, cotangent)))

    def objective(lora_state, base, tokens, positions, segments, cotangent):
        logits = models.forward(nnx.merge(graphdef, lora_state, base), tokens, positions, segments)
        return jnp.sum(logits.astype(jnp.float32) * cotangent), logits

    with jax.set_mesh(mesh):
        traced = jax.jit(jax.value_and_grad(objective, has_aux=True)).trace(*arguments)
        (_, logits), gradients = traced.lower().compile()(*arguments)
    gradients = {path: np.asarray(value.get_value(), np.float32) for path, value in nnx.to_flat_state(gradients)}
    return np.asarray(logits, np.float32), gradients, kernel_forwards(traced.jaxpr.jaxpr)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("family", sorted(REAL_WIDTHS))
def test_the_training_forward_on_the_chip_gives_the_cpus_logits_and_gradients(family):
    """The logits, and every adapter's gradient, of the training forward on the chip (the splash kernel) against the
    chip's dense attention (the kernel alone) and the chip machine's CPU (dense attention) for the same weights and
    packed rows. Gemma 4: its sliding layers in their window, its global layer at head size 512 with k = v."""
    hf_config = REAL_WIDTHS[family]
    chip_mesh = mesh_lib.build_mesh(MeshConfig(), [CHIP])
    host_mesh = mesh_lib.build_mesh(MeshConfig(), [HOST])
    graphdef, lora_state, base = real_width_forward(hf_config, jnp.float32, chip_mesh)
    lora_values, base_values = random_values((lora_state, base), ACTIVATION_GAIN / hf_config["hidden_size"] ** 0.5)
    batch = packed_batch(hf_config["vocab_size"])
    real = batch[2] != 0
    cotangent = np.random.default_rng(2).normal(size=(ROWS, LENGTH, hf_config["vocab_size"])).astype(np.float32)
    cotangent[~real] = 0.0

    def forward(mesh, dtype, graph_and_states):
        graphdef, lora_state, base = graph_and_states
        return forward_on(mesh, graphdef, placed(lora_state, lora_values, mesh, dtype),
                          placed(base, base_values, mesh, dtype), batch, cotangent)

    float32_states = (graphdef, lora_state, base)
    reference, reference_gradients, host_kernels = forward(host_mesh, np.float32, float32_states)
    with highest(), chip_kernels():
        float32, float32_gradients, chip_kernels_run = forward(chip_mesh, np.float32, float32_states)
    with highest(), dense_attention():
        dense, dense_gradients, dense_kernels = forward(chip_mesh, np.float32, float32_states)
    with chip_kernels():
        bfloat16, _, _ = forward(chip_mesh, ml_dtypes.bfloat16, real_width_forward(hf_config, jnp.bfloat16, chip_mesh))
    assert host_kernels == dense_kernels == 0 and chip_kernels_run > 0, "dense attention on the CPU, the kernel on the chip"

    reference, float32, dense, bfloat16 = reference[real], float32[real], dense[real], bfloat16[real]
    scale = float(np.abs(reference).max())
    float32_error = float(np.abs(float32 - reference).max())
    kernel_error = float(np.abs(float32 - dense).max())

    def worst(gradients, expected_gradients) -> tuple[float, dict[str, tuple[float, float]]]:
        errors = {"/".join(map(str, path)): max_error(gradients[path], expected)
                  for path, expected in expected_gradients.items()}
        return max(error / value for error, value in errors.values()), errors

    worst_gradient, gradient_errors = worst(float32_gradients, reference_gradients)
    worst_kernel_gradient, kernel_gradient_errors = worst(float32_gradients, dense_gradients)
    bf16_errors = np.abs(log_softmax(bfloat16) - log_softmax(reference))
    agreement = float(np.mean(bfloat16.argmax(-1) == reference.argmax(-1)))
    record(f"logits-{family}", max_abs_logit=scale, logit_std=float(reference.std()),
           float32_max_abs_error=float32_error, float32_relative=float32_error / scale,
           float32_gradient_worst_relative=worst_gradient, adapter_gradients=len(gradient_errors),
           kernel_vs_dense_on_chip_relative=kernel_error / scale,
           kernel_vs_dense_on_chip_gradient_worst_relative=worst_kernel_gradient,
           bf16_log_softmax_max_abs_error=float(bf16_errors.max()),
           bf16_log_softmax_mean_abs_error=float(bf16_errors.mean()),
           bf16_relative=float(bf16_errors.max()) / scale, bf16_argmax_agreement=agreement)
    assert float(reference.std()) > 0.5, "logits spread enough for the comparison to mean something"
    layers = hf_config["num_hidden_layers"]
    assert kernel_error <= FLOAT32_TOLERANCE_PER_LAYER * layers * scale
    assert float32_error <= FLOAT32_TOLERANCE_PER_LAYER * layers * scale
    for errors in (kernel_gradient_errors, gradient_errors):
        for path, (error, value) in errors.items():
            assert value > 0 and error <= GRADIENT_TOLERANCE_PER_LAYER * layers * value, (path, error, value)
    assert float(bf16_errors.max()) <= BF16_TOLERANCE * scale
    assert float(bf16_errors.mean()) <= BF16_MEAN_TOLERANCE * scale
    assert agreement >= ARGMAX_AGREEMENT


# ---------------------------------------------------------------- 3. cached generation on the chip

NO_TENSORBOARD = "enable_tensorboard=false"
"""The chip machine's wheels (scripts/tpu_wheels.py) leave tensorboardX out; nothing here reads its events."""


GENERATION_FAMILIES = ["qwen3"]
"""Gemma 3 (its sliding-window cache) passed too on a v5e (2026-12-06), but its trainer and compiles add ~30 s."""


@pytest.mark.parametrize("family", GENERATION_FAMILIES)
def test_cached_generation_equals_one_full_forward_per_token(family, tmp_path):
    """In float32 at `highest` precision: the check compares greedy choices of two computations (a cached decode
    step, a full forward) whose logits differ only by rounding; at bf16 a near-tie would flip one now and then."""
    model_dir = generation_checkpoint(tmp_path / "model", family)
    data = write_jsonl(tmp_path / "data.jsonl", arithmetic_rows(8))
    config = TrainConfig.from_args(base_args(
        model_dir, tmp_path / "out", data, f"model_name=tiny-{family}", f"hf_eval_files=['{data}']", "steps=1",
        "generation_eval.enabled=true", f"generation_eval.max_new_tokens={MAX_NEW_TOKENS}", "dtype=float32",
        NO_TENSORBOARD,
    ))
    trainer = train_lib.build_trainer(config)
    try:
        assert {device.platform for device in trainer.mesh.devices.flat} == {CHIP.platform}
        with highest():
            check_generation(trainer)
    finally:
        trainer.close()


# ---------------------------------------------------------------- 4. a real training run on the chip

STEPS = 40
TRAINING_ARGS = (f"steps={STEPS}", "max_target_length=128", NO_TENSORBOARD)
"""base_args' run (tiny Qwen3, rank 4, learning rate 1e-2, 4 rows) on rows of 128 tokens, one splash block."""
FALLS_TO = 0.5
"""The last 5 steps' mean loss is at most this share of the first 5 steps' (each curve; seen on a v5e: 0.13, from
6.15 to 0.78, and 0.13 on the CPU)."""
CURVES_AGREE = 0.1
"""The two runs' last-5 mean losses differ by at most this share of the first step's loss: bf16 on the chip,
float32 on the CPU, so the curves are not the same, only alike (seen: 0.006 apart, 0.1 % of 6.93)."""
FIRST_STEP_AGREES = 0.02
"""The first step's loss (same weights, same batch, adapters still the base's) on the chip within this share of the
CPU's: bf16's rounding of the logits, averaged over the batch's trained tokens (seen: 0.02 %)."""
PROMPT = "what is 23 plus 19?"


def losses(run_directory: Path) -> list[float]:
    records = [json.loads(line) for line in (run_directory / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def adapted_logits(model_dir: Path, checkpoint_directory: Path, ids: np.ndarray) -> np.ndarray:
    """float32 logits of the tiny base with the checkpoint's adapters, on the CPU (test_parity.jax_logits)."""
    host_mesh = mesh_lib.build_mesh(MeshConfig(), [HOST])
    params, metadata = lora.load_adapter_checkpoint(checkpoint_directory)
    with jax.default_device(HOST):
        model, _ = loading.load_model(f"tiny-{metadata.family}", model_dir, mesh=host_mesh, dtype=jnp.float32)
        model = lora.apply_lora(
            model, rank=metadata.lora_rank, alpha=metadata.lora_alpha, mesh=host_mesh, rngs=nnx.Rngs(0),
            target_regex=lora.module_path_regex(metadata.family, metadata.target_modules),
        )
        lora.set_lora_params(model, params)
        return jax_logits(model, ids)


EXPERT_WIDTHS = {"qwen3-30b-a3b": (2048, 768), "gemma4-26b": (2816, 704)}
"""(hidden_size, moe_intermediate_size) as released; one device of a tpu7x-8 slice holds 16 of their 128 experts."""
LOCAL_EXPERTS = 16


@pytest.mark.parametrize("model", sorted(EXPERT_WIDTHS))
def test_packed_expert_weights_unpack_bit_for_bit_in_the_kernel_on_the_chip(model):
    """tpu7x's step holds the routed experts' bf16 stacks packed (experts.packed_rows) and unpacks one layer's local
    experts per pass in a Pallas kernel (experts.unpacked_rows on a TPU mesh). On the chip, at one device's share of
    the released widths: every bit comes back, through the kernel and through the step's shard_map around it; and
    what one layer's unpacking costs (both weights; the CPU test checks the same in Pallas' interpreter)."""
    hidden, intermediate = EXPERT_WIDTHS[model]
    chip_mesh = jax.sharding.Mesh(np.array([CHIP]), ("expert",))
    sharding = ("expert", None, None)
    seconds = 0.0
    moved_bytes = 0
    with jax.set_mesh(chip_mesh):
        in_step = jax.jit(lambda w: experts.unpacked_rows(w, sharding, chip_mesh.abstract_mesh))
        kernel = jax.jit(lambda w: experts.unpack_kernel(w, interpret=INTERPRET))
        for index, shape in enumerate(((LOCAL_EXPERTS, hidden, 2 * intermediate), (LOCAL_EXPERTS, intermediate, hidden))):
            weight = jax.random.normal(jax.random.key(index), shape, jnp.float32).astype(jnp.bfloat16)
            weight = jax.device_put(weight, NamedSharding(chip_mesh, PartitionSpec(*sharding)))
            packed = jax.jit(experts.packed_rows)(weight)
            bits = np.asarray(jax.lax.bitcast_convert_type(weight, jnp.uint16))
            for unpack in (kernel, in_step):
                unpacked = unpack(packed)
                np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(unpacked, jnp.uint16)), bits)
            start = time.perf_counter()  # the kernel compiled and ran above
            for _ in range(10):
                unpacked = kernel(packed)
            unpacked.block_until_ready()
            seconds += (time.perf_counter() - start) / 10
            moved_bytes += 2 * weight.nbytes
    record(f"unpack-{model}", local_experts=LOCAL_EXPERTS, layer_ms=round(1e3 * seconds, 3),
           read_and_written_mb=round(moved_bytes / 1e6, 1), gb_per_s=round(moved_bytes / seconds / 1e9, 1))


def test_a_training_run_on_the_chip_learns_as_on_the_cpu_and_exports(tmp_path):
    model_dir = tiny_checkpoint(tmp_path / "model")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(400))
    chip_config = TrainConfig.from_args(base_args(model_dir, tmp_path / "chip", train_file, *TRAINING_ARGS))
    cpu_args = base_args(model_dir, tmp_path / "cpu", train_file, *TRAINING_ARGS)
    cpu_config = TrainConfig.from_args(cpu_args)
    # The CPU's run (float32, dense attention) in a process of its own, beside the chip's.
    cpu_run = subprocess.Popen(
        [sys.executable, "-m", "lorajob_trainer.train", *cpu_args], env=trainer_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        started = time.perf_counter()
        with chip_kernels():
            trainer = train_lib.build_trainer(chip_config)
            try:
                assert {device.platform for device in trainer.mesh.devices.flat} == {CHIP.platform}
                trainer.train()
                prompt = evaluate.prompt_tokens(trainer.tokenizer, [{"role": "user", "content": PROMPT}], 64)
            finally:
                trainer.close()
        chip_seconds = time.perf_counter() - started
        output, _ = cpu_run.communicate(timeout=600)
    finally:
        cpu_run.kill()
    assert cpu_run.returncode == 0, output[-3000:]

    chip, cpu = losses(chip_config.run_directory), losses(cpu_config.run_directory)
    record("training", chip_losses=chip, cpu_losses=cpu, chip_seconds=chip_seconds, dtype=jnp.dtype(trainer.run.dtype).name)
    assert len(chip) == len(cpu) == STEPS
    for curve in (chip, cpu):
        assert np.mean(curve[-5:]) <= FALLS_TO * np.mean(curve[:5]), curve
    assert abs(chip[0] - cpu[0]) <= FIRST_STEP_AGREES * cpu[0], (chip[0], cpu[0])
    assert abs(np.mean(chip[-5:]) - np.mean(cpu[-5:])) <= CURVES_AGREE * cpu[0], (chip[-5:], cpu[-5:])

    adapter = export.export_adapter(chip_config.checkpoint_directory, tmp_path / "adapter")
    assert {p.name for p in adapter.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    ids = np.asarray([prompt])
    logits = adapted_logits(model_dir, chip_config.checkpoint_directory, ids)
    assert np.isfinite(logits).all()
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        for source in (adapter / "adapter_config.json", adapter / "adapter_model.safetensors",
                       model_dir / "config.json", model_dir / "model.safetensors"):
            shutil.copyfile(source, OUT / source.name)
        (OUT / "chip_logits.json").write_text(json.dumps({
            "prompt": PROMPT, "prompt_ids": ids.tolist(), "logits": logits.tolist(),
            "computed_on": f"the CPU of the machine with {CHIP.device_kind}, float32, our model + the adapter",
            "adapter_trained_on": CHIP.device_kind, "dtype_trained": jnp.dtype(trainer.run.dtype).name, "steps": STEPS,
        }) + "\n")
