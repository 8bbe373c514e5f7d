"""Causal attention of a training step through JAX's Pallas splash-attention kernel (TPU), the attention MaxText
trains with by default.

Dense attention (models/attention.py) materialises every score of every head, [B, K, G, T, S] in float32 and
again in bfloat16, once per layer: 134 MB per sequence per layer of llama3.1-8b at 1,024 tokens, 8.6 GB at
8,192 (it grows with the square of the length), and with it the masked half of the causal square. The kernel
works in blocks, skips the blocks the causal mask empties, and keeps only the log-sum-exp for its backward pass,
so its memory grows with the length, not its square.

It runs where the step is traced on a mesh of TPU devices, without a KV cache, for lengths the kernel's
128-wide blocks divide (`applies`), in the attention of Qwen3, Qwen3 MoE, Llama 3, Gemma 3 and Gemma 4 (their
sliding layers with the kernel's local mask); elsewhere (CPU, GPU, decoding) the dense attention runs. Pallas' interpreter
runs the same kernel on any backend (`interpret`), which is how the tests compare the two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_kernel
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer.remat import KERNEL_OUTPUT

BLOCK = 128
"""The kernel's block granularity (a TPU vector register's lanes): lengths must be a multiple of it."""
LARGEST_BLOCK = 1024
"""The largest query and key block, for heads of up to 128: on a v5e chip, 1,024-position blocks (computed in
512-wide slices) with the fused backward kernel ran a causal forward + backward at 2,048 positions in 0.74-0.75 of
the time of MaxText's default (512 everywhere, dq in a kernel of its own); 2,048-position query blocks overflow the
kernel's VMEM (bench/splash_blocks.py, bench/results/v5e-splash-blocks-2026-12-06.json)."""
WIDE_HEAD_BLOCK = 512
"""The largest block for heads wider than 128 (Gemma 3's and Gemma 4's 256, Gemma 4's global 512): the kernel's
scoped VMEM is 16 MiB on v5e, and at 1,024 positions its key/value-gradient kernel for a head of 256 needed 16.42 MB
in Gemma 4 26B's step under remat full (the compiler's own buffers share that VMEM, so the same kernel had compiled
in other steps), its forward for a head of 512 17.91 MB."""
BLOCK_AREA = WIDE_HEAD_BLOCK * 512
"""Positions x head size of the largest block: heads wider than 512 shrink their blocks further."""
COMPUTE_BLOCK = 512
"""The slice of a key block each inner step of the kernel computes."""
FORWARD_KERNEL = "splash_mha_fwd"
"""The start of the forward kernel's name in a compiled step's HLO (`ran_in`)."""
PADDING_SEGMENT = -1
"""The segment id of a position that attends to nothing (padding): never equal to a real segment's."""


def applies(batch: int, length: int, heads: int, kv_heads: int, cache: object, mask: jax.Array | None) -> bool:
    """Whether an attention forward of `batch` rows of `length` positions with `heads` query and `kv_heads`
    key/value heads runs through the kernel: a training forward (no KV `cache`, the step's `mask`) traced on a
    TPU mesh, the length a multiple of `BLOCK`, the rows and both head counts divisible over the mesh axes that
    split them."""
    mesh = jax.sharding.get_abstract_mesh()
    if cache is not None or mask is None or not mesh_lib.is_tpu(mesh):
        return False
    tp = _size(mesh, ("tp",))
    return (length % BLOCK == 0 and batch % _size(mesh, _batch_axes(mesh)) == 0
            and heads % tp == 0 and kv_heads % tp == 0)


def segment_ids(mask: jax.Array) -> jax.Array:
    """int32 [B, T] from the step's attention mask [B, T, S] (models.attention_mask: causal, within a segment,
    never to or from padding): each position's segment named by its first position (the first key it attends
    to), `PADDING_SEGMENT` where it attends to nothing. The kernel masks causally by itself."""
    return jnp.where(mask.any(axis=-1), jnp.argmax(mask, axis=-1), PADDING_SEGMENT).astype(jnp.int32)


def causal_attention(
    query: jax.Array, key: jax.Array, value: jax.Array, segments: jax.Array, *, window: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """softmax(query · key over the causal mask within `segments`) · value: query [B, T, N, H] (already
    scaled), key and value [B, T, K, H] with K dividing N (grouped-query), segments [B, T] -> [B, T, N, H];
    with `window`, each position sees itself and the `window` - 1 before it (a sliding-window layer).

    On a mesh (`applies`), each device runs the kernel on its own sequences and heads (`jax.shard_map`): the
    batch split as the step splits it, the heads over `tp`; the kernel is made for the shapes each device holds.
    """
    heads_first = (query.transpose(0, 2, 1, 3), key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3))
    local = functools.partial(_attend, window=window, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        batch, heads = _batch_axes(mesh), "tp" if _size(mesh, ("tp",)) > 1 else None
        split = PartitionSpec(batch, heads, None, None)
        # check_vma off: the Pallas kernel's outputs carry no varying-axes type (JAX cannot infer one).
        local = jax.shard_map(
            local, in_specs=(split, split, split, PartitionSpec(batch, None)), out_specs=split, check_vma=False
        )
    return local(*heads_first, segments).transpose(0, 2, 1, 3)


def _attend(
    query: jax.Array, key: jax.Array, value: jax.Array, segments: jax.Array, *, window: int | None, interpret: bool
) -> jax.Array:
    """The kernel over sequences held here: query [B, N, T, H], key and value [B, K, T, H] -> [B, N, T, H]."""
    heads, length, head_dim = query.shape[1:]
    kernel = _kernel(heads, length, head_dim, window if window is not None and window < length else None, interpret)
    return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash_kernel.SegmentIds(s, s)))(
        query, key, value, segments
    )


def block_size(length: int, head_dim: int = BLOCK) -> int:
    """The kernel's blocks (query and key, forward and backward) for `length` positions of `head_dim`, a multiple
    of `BLOCK`: the largest of 1,024, 512, 256 and 128 that divides it, at most `WIDE_HEAD_BLOCK` for heads wider
    than `BLOCK`, and keeps within `BLOCK_AREA`."""
    largest = LARGEST_BLOCK if head_dim <= BLOCK else WIDE_HEAD_BLOCK
    return max(size for size in (LARGEST_BLOCK, 4 * BLOCK, 2 * BLOCK, BLOCK)
               if length % size == 0 and (size == BLOCK or (size <= largest and size * head_dim <= BLOCK_AREA)))


def ran_in(compiled_text: str) -> bool:
    """Whether a compiled step (`Compiled.as_text()`) runs its attention in the kernel."""
    return FORWARD_KERNEL in compiled_text


def _kernel(
    heads: int, length: int, head_dim: int, window: int | None, interpret: bool
) -> splash_kernel.SplashAttentionKernel:
    """The kernel for `heads` heads of `length` positions of `head_dim`, causal or within a sliding `window`, made anew in each
    trace: it holds its block masks as arrays, which inside a trace are that trace's values, so a kernel kept from
    one trace fails in the next (UnexpectedTracerError). The masks' block analysis, the costly part, is cached by
    JAX's own mask processing (splash_attention_mask_info's process_mask)."""
    block = block_size(length, head_dim)
    compute = min(block, COMPUTE_BLOCK)
    if window is None:
        head_mask = splash_mask.CausalMask((length, length))
    else:
        head_mask = splash_mask.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
    mask = splash_mask.MultiHeadMask([head_mask for _ in range(heads)])
    sizes = splash_kernel.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=compute,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=compute, use_fused_bwd_kernel=True,
    )
    return splash_kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
                                         residual_checkpoint_name=KERNEL_OUTPUT)


def _batch_axes(mesh: jax.sharding.AbstractMesh) -> tuple[str, ...]:
    return tuple(axis for axis in mesh_lib.BATCH_AXES if axis in mesh.axis_names)


def _size(mesh: jax.sharding.AbstractMesh, axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[axis] for axis in axes if axis in mesh.shape]))
