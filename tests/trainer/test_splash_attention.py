"""The splash-attention kernel a training step runs on TPU (models/splash.py), run here in Pallas' interpreter:
the same outputs and gradients as the dense attention for packed and padded rows with grouped-query heads, on one
device and split over a mesh; and the share of blocks it computes, which the plan's FLOPs count."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core
from lorajob_trainer import metrics, models, remat
from lorajob_trainer.contract.records import REMAT_POLICIES
from lorajob_trainer.models import splash
from lorajob_trainer.models.attention import dense_attention
from trainer_testkit import trainer_env

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 384, 4, 2, 128
"""Three blocks of 128 positions per side: the kernel skips the three above the diagonal."""


def inputs(length: int = LENGTH) -> tuple[jax.Array, ...]:
    """query, key, value, segment ids (row 0 packs three sequences, row 1 ends in padding) and a cotangent that
    is zero at padding (where the loss never looks); the sequences' bounds fall inside blocks at any length."""
    keys = jax.random.split(jax.random.key(0), 4)
    query = jax.random.normal(keys[0], (BATCH, length, HEADS, HEAD_DIM))
    key = jax.random.normal(keys[1], (BATCH, length, KV_HEADS, HEAD_DIM))
    value = jax.random.normal(keys[2], (BATCH, length, KV_HEADS, HEAD_DIM))
    segments = np.ones((BATCH, length), np.int32)
    segments[0, length * 100 // 384 : length * 200 // 384], segments[0, length * 200 // 384 :] = 2, 3
    segments[1, length * 250 // 384 :] = 0
    cotangent = jax.random.normal(keys[3], query.shape) * (segments != 0)[:, :, None, None]
    return query, key, value, jnp.asarray(segments), cotangent


def outputs_and_gradients(
    kernel: str, window: int | None = None, *, length: int = LENGTH, interpret: bool = True
) -> list[np.ndarray]:
    """The attention's output and the gradients of sum(output · cotangent) by query, key and value; with
    `window`, a sliding-window layer's (Gemma 3's: each position sees itself and the `window` - 1 before it).
    `interpret`: the splash kernel in Pallas' interpreter (any backend); False runs the compiled kernel, on a
    TPU only (tests/chip/test_on_chip.py)."""
    query, key, value, segments, cotangent = inputs(length)
    mask, scale = models.attention_mask(segments), HEAD_DIM**-0.5

    def attend(query, key, value):
        if kernel == "splash":
            return splash.causal_attention(
                query * scale, key, value, splash.segment_ids(mask), window=window, interpret=interpret
            )
        positions = jnp.arange(length)
        near = positions[:, None] - positions[None, :] < (window or length)
        return dense_attention(query, key, value, mask & near, scale)

    def loss(query, key, value):
        return jnp.sum(attend(query, key, value) * cotangent)

    output = attend(query, key, value) * (segments != 0)[:, :, None, None]
    return [np.asarray(x) for x in (output, *jax.grad(loss, argnums=(0, 1, 2))(query, key, value))]


@pytest.mark.parametrize("window", [None, 200], ids=["causal", "sliding-window"])
def test_the_kernel_equals_dense_attention_with_its_gradients(window):
    for splashed, dense in zip(outputs_and_gradients("splash", window), outputs_and_gradients("dense", window),
                               strict=True):
        np.testing.assert_allclose(splashed, dense, atol=2e-5, rtol=1e-5)


def test_a_second_trace_at_the_same_shape_attends_as_the_first():
    """A kernel made while one step is traced (remat auto's compile, say) must not hand that trace's values to the
    next step traced at the same shape (found on a TPU chip: UnexpectedTracerError)."""
    query, key, value, segments, _ = inputs()

    def attention(query, key, value, segments):
        return splash.causal_attention(query, key, value, segments, window=128, interpret=True)

    first = jax.jit(attention)(query, key, value, segments)
    second = jax.jit(lambda *arguments: attention(*arguments) + 0.0)(query, key, value, segments)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


SHARDED_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    sys.path.insert(0, sys.argv[1])
    from lorajob_trainer import mesh as mesh_lib
    from lorajob_trainer.contract.config import MeshConfig
    from test_splash_attention import outputs_and_gradients
    mesh = mesh_lib.build_mesh(MeshConfig(fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        json.dump([x.tolist() for x in outputs_and_gradients("splash")], sys.stdout)
    """
)


def test_on_a_mesh_each_device_attends_its_sequences_and_heads():
    """Four devices, the batch split over fsdp and the heads (query and key/value) over tp: each runs the kernel
    on what it holds, and the result is the one device's."""
    env = trainer_env(devices=4)
    result = subprocess.run(
        [sys.executable, "-c", SHARDED_SCRIPT, str(Path(__file__).parent)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for sharded, single in zip(json.loads(result.stdout), outputs_and_gradients("splash"), strict=True):
        np.testing.assert_allclose(np.array(sharded), single, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [512, 1024, 4096])
def test_the_flops_model_counts_the_blocks_the_kernel_computes(length):
    """metrics.causal_block_share against the kernel's own schedule: the blocks its forward and its fused backward
    pass (the query and key/value gradients together: no dq pass of its own) visit (the mask info's non-empty
    blocks)."""
    kernel = splash._kernel(1, length, HEAD_DIM, None, False)
    blocks = length // splash.block_size(length)
    assert kernel.dq_mask_info is None
    for info in (kernel.fwd_mask_info, kernel.dkv_mask_info):
        visited = np.count_nonzero(np.asarray(info.block_mask))
        assert visited / blocks**2 == pytest.approx(metrics.causal_block_share(blocks))


def kernel_forwards(jaxpr: core.Jaxpr) -> int:
    """The splash kernel's forward passes in `jaxpr` and the jaxprs inside it (remat's recompute among them) whose
    outputs something uses: remat leaves a kernel call whose outputs it keeps in its recompute without outputs, for
    the compiler to drop."""
    count = 0
    for equation in jaxpr.eqns:
        if all(isinstance(output, core.DropVar) for output in equation.outvars):
            continue
        if equation.primitive.name == "pallas_call" and str(equation.params.get("name")).startswith(splash.FORWARD_KERNEL):
            count += 1
        for param in equation.params.values():
            for inner in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(inner, (core.Jaxpr, core.ClosedJaxpr)):
                    count += kernel_forwards(getattr(inner, "jaxpr", inner))
    return count


@pytest.mark.parametrize("policy", REMAT_POLICIES)
def test_the_flops_model_counts_the_forwards_each_remat_policy_runs(policy):
    """metrics.SPLASH_ATTENTION_FLOPS: 4 per kernel forward in the gradient's program (one, and one more where
    remat recomputes the layer: "full" only, the others keep what the kernel's backward needs), plus the
    backward's 14."""
    query, key, value, segments, _ = inputs()

    def attend(query, key, value):
        return jnp.sum(splash.causal_attention(query, key, value, segments, interpret=True))

    layer = attend if policy == "none" else jax.checkpoint(attend, policy=remat.saveable(policy))
    program = jax.make_jaxpr(jax.grad(layer, argnums=(0, 1, 2)))(query, key, value)
    assert metrics.SPLASH_ATTENTION_FLOPS[policy] == 4 * kernel_forwards(program.jaxpr) + 14


def test_segment_ids_name_each_sequence_and_keep_padding_apart():
    segments = jnp.array([[1, 1, 2, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3]])
    np.testing.assert_array_equal(
        splash.segment_ids(models.attention_mask(segments)),
        [[0, 0, 2, 2, 2, splash.PADDING_SEGMENT, splash.PADDING_SEGMENT], [0] * 7],
    )


@pytest.mark.parametrize(("length", "head_dim", "block"), [
    (2048, 128, 1024), (2048, 256, 512), (2048, 512, 512), (8192, 512, 512), (384, 512, 128), (256, 1024, 256),
    (4096, 2048, 128),
])
def test_blocks_shrink_for_wide_heads_to_stay_in_the_kernels_scoped_vmem(length, head_dim, block):
    """The largest block that divides the length, at most 512 positions for heads wider than 128 (Gemma 4's 256-wide
    heads overflowed the v5e kernel's 16 MiB at 1,024 positions in one step, its 512-wide ones in every step) and
    within BLOCK_AREA beyond, never under one 128-block."""
    assert splash.block_size(length, head_dim) == block
