"""Next-token cross-entropy that never materialises the `[batch, length, vocab]` logits.

The model runs up to its final norm; the LM head and the log-softmax then run on chunks of
`chunk_length` positions per row, one chunk at a time (a `lax.scan`). Within each row the trained
positions (loss weight != 0) are moved to the front first, so a chunk holding no trained token of any
row is skipped: the LM head runs only where SFT trains. The batch axis is never reordered or
flattened, so its data-parallel sharding is kept. The head weight is frozen (LoRA never trains it),
so only the hidden states' gradient is needed, and it is computed in the forward pass, from the same
chunk of logits (`softmax - onehot` times the head): a differentiated step runs the LM head's matmul
twice per trained chunk (logits, then their gradient), as a full-logits loss does, and keeps only a
`[batch, length, hidden]` gradient for the backward pass. `losses_with_load_balancing` adds the MoE
load-balancing loss and dispatch counts of the same forward (experts.py).

On a mesh whose batch axes divide the vocabulary, the loss is vocab-parallel (`jax.shard_map`): the head is
resharded once per call to a slice of the vocabulary per device, in place of the whole head gathered to every
device (1.05 GB for llama3.1-8b); each chunk's hidden states (every row's) are gathered to every device, which
computes their logits on its slice, the log-normaliser and the target's logit are combined across the slices, and
each slice's part of the hidden states' gradient is reduce-scattered back to the devices that hold the rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from lorajob_trainer import models
from lorajob_trainer.mesh import BATCH_AXES
from lorajob_trainer.models import experts
from lorajob_trainer.models.decoder import Decoder
from lorajob_trainer.remat import RematPolicy


def token_losses(
    model: nnx.Module, micro_batch: dict[str, jax.Array], chunk_length: int, remat: RematPolicy = "none"
) -> tuple[jax.Array, jax.Array]:
    """(sum of weighted next-token NLL, sum of loss weights) of one micro-batch; the layers rematerialised
    under `remat` (remat.py)."""
    hidden = hidden_states(model, micro_batch["inputs"], micro_batch["positions"], micro_batch["segment_ids"], remat)
    return chunked_cross_entropy(
        hidden, output_head(model), micro_batch["targets"], micro_batch["weights"], chunk_length,
        model.final_logit_softcap,
    )


def losses_with_load_balancing(
    model: nnx.Module, micro_batch: dict[str, jax.Array], chunk_length: int, remat: RematPolicy = "none"
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """`token_losses`, the load-balancing loss of the same forward over the micro-batch's real tokens
    (transformers' `load_balancing_loss_func`; 0 for a model without load-balanced MoE blocks) and its
    expert-parallel blocks' dispatch counts, int32 [rows dropped, slots padded] (`RecordedRouting.dispatch_totals`)."""
    (loss_sum, weight_sum), aux, dispatch = with_load_balancing(
        model, micro_batch, lambda: token_losses(model, micro_batch, chunk_length, remat)
    )
    return loss_sum, weight_sum, aux, dispatch


def with_load_balancing(model: nnx.Module, micro_batch: dict[str, jax.Array], forward) -> tuple:
    """(what `forward()` returns, the load-balancing loss of the model's forward in it over the micro-batch's real
    tokens, its expert-parallel blocks' dispatch counts): see `losses_with_load_balancing`."""
    with experts.routing_recorded(model) as routing:
        result = forward()
    return result, routing.load_balancing_loss(micro_batch["segment_ids"] != 0), routing.dispatch_totals()


def token_nll(
    model: nnx.Module, micro_batch: dict[str, jax.Array], needed: jax.Array, chunk_length: int,
    remat: RematPolicy = "none",
) -> jax.Array:
    """The float32 NLL [B, L] of the micro-batch's targets where `needed` is true (0 elsewhere): `chunked_token_nll`
    over the model's forward."""
    hidden = hidden_states(model, micro_batch["inputs"], micro_batch["positions"], micro_batch["segment_ids"], remat)
    return chunked_token_nll(hidden, output_head(model), micro_batch["targets"], needed, chunk_length,
                             model.final_logit_softcap)


def hidden_states(
    model: Decoder, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array, remat: RematPolicy = "none"
) -> jax.Array:
    """The final-norm output [B, L, D]: the model's forward without its LM head."""
    hidden, _ = model(tokens, positions, None, models.attention_mask(segment_ids), hidden=True, remat=remat)
    return hidden


def output_head(model: nnx.Module) -> jax.Array:
    """The LM head as a [D, vocab] matrix: `lm_head.w`, or the transposed embedding of a tied model."""
    if hasattr(model, "lm_head"):
        return model.lm_head.w.get_value()
    return model.embedder.input_embedding.get_value().T


def chunked_cross_entropy(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    chunk_length: int,
    softcap: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(sum of weights * NLL(targets), sum of weights) for hidden [B, L, D], head [D, V], targets/weights [B, L];
    with `softcap`, the logits are `softcap * tanh(hidden @ head / softcap)` (Gemma 4's final logit capping).

    The matmuls run in the head's dtype (the compute dtype) and accumulate in float32. The head must not be
    differentiated."""
    nll = chunked_token_nll(hidden, head, targets, weights != 0, chunk_length, softcap)
    return jnp.sum(nll * weights), jnp.sum(weights)


def chunked_token_nll(
    hidden: jax.Array,
    head: jax.Array,
    targets: jax.Array,
    needed: jax.Array,
    chunk_length: int,
    softcap: float | None = None,
) -> jax.Array:
    """The float32 NLL of each target [B, L] where `needed` [B, L] is true, 0 elsewhere: `chunked_cross_entropy`'s
    chunks, per position (a preference loss sums each answer's log-probabilities; preference.py).

    Traced on a mesh whose batch axes (mesh.BATCH_AXES) span several devices and divide both the rows and the
    vocabulary, the loss is vocab-parallel (`_vocab_axes`): the head is resharded once, each device holding a slice
    of the vocabulary, and each chunk's hidden states are gathered to every device, instead of the head gathered
    whole to each."""
    length = hidden.shape[1]
    chunk = min(chunk_length, length)
    chunks = -(-length // chunk)
    order = jnp.argsort(~needed, axis=1, stable=True)
    pad = chunks * chunk - length

    def split(x: jax.Array) -> jax.Array:
        x = jnp.take_along_axis(x, order.reshape(order.shape + (1,) * (x.ndim - 2)), axis=1)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], chunks, chunk, *x.shape[2:]), 1, 0)

    axes = _vocab_axes(hidden, head)
    nll = _needed_chunks_nll(softcap, axes, split(hidden), head, split(targets), split(needed.astype(jnp.float32)))
    ordered = jnp.moveaxis(nll, 0, 1).reshape(nll.shape[1], chunks * chunk)[:, :length]
    return jnp.take_along_axis(ordered, jnp.argsort(order, axis=1), axis=1)


def _vocab_axes(hidden: jax.Array, head: jax.Array) -> tuple[str, ...] | None:
    """The mesh axes the vocab-parallel loss splits the head's vocabulary (and the rows) over: the current mesh's
    batch axes, while tracing on a mesh where they span more than one device and their size divides both the rows
    of `hidden` [B, L, D] and the vocabulary of `head` [D, V]; None (each device's rows against the whole head)
    otherwise: eagerly, without a mesh, on one device, or where they do not divide."""
    mesh = jax.sharding.get_abstract_mesh()
    if not isinstance(hidden, jax.core.Tracer) or mesh.empty:
        return None
    axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    size = math.prod(mesh.shape[axis] for axis in axes)
    if size == 1 or hidden.shape[0] % size or head.shape[1] % size:
        return None
    return axes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _needed_chunks_nll(
    softcap: float | None, axes: tuple[str, ...] | None, hidden: jax.Array, head: jax.Array, targets: jax.Array,
    needed: jax.Array,
) -> jax.Array:
    """NLL [C, B, chunk] of chunks [C, B, chunk, D] / [C, B, chunk] where `needed` (1.0) marks a position, 0
    elsewhere; chunks without a needed position are skipped; vocab-parallel over `axes` (None: not)."""
    chunk_nll = functools.partial(_chunk_nll, softcap, axes)
    return _over_needed_chunks(chunk_nll, lambda h, *_: (jnp.zeros(h.shape[:-1], jnp.float32),), axes, hidden, head,
                               targets, needed)[0]


def _needed_chunks_nll_forward(softcap, axes, hidden, head, targets, needed):
    if head.perturbed:
        raise ValueError("the chunked loss does not differentiate the LM head (LoRA keeps it frozen)")

    def skipped(h, *_):
        return jnp.zeros(h.shape[:-1], jnp.float32), jnp.zeros_like(h)

    nll, hidden_grads = _over_needed_chunks(
        functools.partial(_chunk_nll_and_hidden_grad, softcap, axes), skipped, axes, hidden.value, head.value,
        targets.value, needed.value,
    )
    return nll, hidden_grads


def _needed_chunks_nll_backward(softcap, axes, hidden_grads, cotangent):
    return (hidden_grads * cotangent[..., None].astype(hidden_grads.dtype), None, None, None)


_needed_chunks_nll.defvjp(_needed_chunks_nll_forward, _needed_chunks_nll_backward, symbolic_zeros=True)


def _over_needed_chunks(chunk_fn, skipped_fn, axes, hidden, head, targets, needed) -> tuple:
    """Maps the chunks: `chunk_fn(h, head, t, n)` -> (NLL [B, chunk], *per-chunk outputs [B, chunk, ...]) where a
    chunk has a needed position, else `skipped_fn` (same shapes); each output stacked over the chunks.

    With `axes`, in a `jax.shard_map` over them: `h` and the outputs are this device's rows, `head` its slice of
    the vocabulary (the head resharded once, here, before the chunks), `t` and `n` every row's (so that every
    device skips the same chunks)."""

    def scan(hidden, head, targets, needed):
        def body(_, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[None, tuple]:
            h, t, n = xs
            return None, jax.lax.cond(jnp.any(n != 0), chunk_fn, skipped_fn, h, head, t, n)

        return jax.lax.scan(body, None, (hidden, targets, needed))[1]

    if axes is None:
        return scan(hidden, head, targets, needed)
    # The head resharded once the hidden states are computed, not earlier: its slices would be live through the layers.
    hidden, head = jax.lax.optimization_barrier((hidden, head))
    rows, whole = PartitionSpec(None, axes), PartitionSpec()
    # check_vma off: the skipped branch's zeros and the computed branch's rows differ in their varying axes.
    return jax.shard_map(scan, in_specs=(rows, PartitionSpec(None, axes), whole, whole), out_specs=rows,
                         check_vma=False)(hidden, head, targets, needed)


def _chunk_nll_terms(
    softcap: float | None, axes: tuple[str, ...] | None, h: jax.Array, head: jax.Array, t: jax.Array, n: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """(the chunk's NLL per position [B, chunk], 0 where not needed; its float32 logits [B, chunk, V]; their
    log-normaliser; each target's index in `head`'s columns; whether `head` holds it). With `axes`, `h` is every
    row's chunk, `head` and the logits this device's slice of the vocabulary, the normaliser and the NLL combined
    over the slices."""
    logits = jnp.dot(h.astype(head.dtype), head, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    if axes is None:
        log_normaliser = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return (log_normaliser - picked) * n, logits, log_normaliser, t, jnp.ones(t.shape, bool)
    vocab = head.shape[1]
    local = t - jax.lax.axis_index(axes) * vocab
    held = (local >= 0) & (local < vocab)
    local = jnp.clip(local, 0, vocab - 1)
    peak = jax.lax.pmax(jnp.max(logits, axis=-1), axes)
    log_normaliser = peak + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - peak[..., None]), axis=-1), axes))
    picked = jax.lax.psum(jnp.where(held, jnp.take_along_axis(logits, local[..., None], axis=-1)[..., 0], 0.0), axes)
    return (log_normaliser - picked) * n, logits, log_normaliser, local, held


def _own_rows(x: jax.Array, rows: int, axes: tuple[str, ...] | None) -> jax.Array:
    """This device's `rows` of `x` [B, ...], every row's (the whole of `x` without `axes`)."""
    if axes is None:
        return x
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axes) * rows, rows, axis=0)


def _every_row(h: jax.Array, axes: tuple[str, ...] | None) -> jax.Array:
    """Every device's rows of `h` [B_local, ...] (`h` itself without `axes`)."""
    return h if axes is None else jax.lax.all_gather(h, axes, axis=0, tiled=True)


def _chunk_nll(
    softcap: float | None, axes: tuple[str, ...] | None, h: jax.Array, head: jax.Array, t: jax.Array, n: jax.Array
) -> tuple[jax.Array]:
    nll = _chunk_nll_terms(softcap, axes, _every_row(h, axes), head, t, n)[0]
    return (_own_rows(nll, h.shape[0], axes),)


def _chunk_nll_and_hidden_grad(
    softcap: float | None, axes: tuple[str, ...] | None, h: jax.Array, head: jax.Array, t: jax.Array, n: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The chunk's NLL per position and each needed position's gradient w.r.t. its h: (softmax - onehot(t)) *
    capping' @ head.T, where capping' = 1 - (logits / softcap)^2 is the derivative of the capping (1 without
    one); 0 where not needed. With `axes`, each device's slice of the vocabulary gives a part of every row's
    gradient, summed over the devices onto each one's own rows (`psum_scatter`)."""
    nll, logits, log_normaliser, local, held = _chunk_nll_terms(softcap, axes, _every_row(h, axes), head, t, n)
    logit_grads = jnp.exp(logits - log_normaliser[..., None]) * n[..., None]
    target_scale = n
    if softcap is not None:
        capping_slope = 1.0 - jnp.square(logits / softcap)
        logit_grads = logit_grads * capping_slope
        target_scale = n * jnp.take_along_axis(capping_slope, local[..., None], axis=-1)[..., 0]
    spread = jnp.dot(logit_grads.astype(head.dtype), head.T, preferred_element_type=jnp.float32)
    target_rows = jnp.moveaxis(jnp.take(head, local, axis=1), 0, -1).astype(jnp.float32)
    if axes is None:
        return nll, (spread - target_scale[..., None] * target_rows).astype(h.dtype)
    part = spread - jnp.where(held, target_scale, 0.0)[..., None] * target_rows
    grads = jax.lax.psum_scatter(part, axes, scatter_dimension=0, tiled=True)
    return _own_rows(nll, h.shape[0], axes), grads.astype(h.dtype)
