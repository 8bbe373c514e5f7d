"""MaxText checkpoints (`<dir>/0/items`) -> Tunix parameters of the Qwen3, Qwen3 MoE, Llama 3 and Gemma 3 families.

A MaxText checkpoint, as MaxText's `to_maxtext` converter and its trainer write it (0.2.5), is an
Orbax PyTree (OCDBT and zarr3 on or off) `{"params": {"params": TREE}, "step": ...}` where TREE has

    token_embedder/embedding          [vocab, embed]
    decoder/decoder_norm/scale        [embed]
    decoder/logits_dense/kernel       [embed, vocab]   (untied output layer only)
    decoder/<layer>/...               one subtree per layer, in one of three layouts:

- unscanned (`scan_layers=False`): `layers_{i}` for layer i;
- scanned: `layers`, every array stacked over all layers on MaxText's `param_scan_axis` (1 by
  default: a norm scale is [embed, layers], a query kernel [embed, layers, heads, head_dim]);
- Gemma 3 scanned: grouped by its 6-layer attention pattern, `layers/layers_{b}` stacks layers
  b, b+6, b+12, ... of the complete periods, and `layers_remainder/layers_{r}` (unstacked) is layer
  6·⌊L/6⌋ + r.

Qwen3 MoE's routed experts are `moe_block/{wi_0,wi_1,wo}` [experts, in, out] (scanned: the layer axis
second, [experts, layers, in, out]) and its router `moe_block/gate/kernel` [embed, experts].

The per-layer tensors differ from Tunix's as `MaxTextMap`s say: axis order, and value transforms
undoing what MaxText's converter applied (Gemma norms stored as 1 + w, Gemma's embedding stored
times bfloat16(√embed), Llama's query kernel times 1/√head_dim with RoPE halves interleaved), and
embedding rows MaxText padded or cut to its own vocab_size (`MaxTextMap.vocab_rows`).
A MaxText checkpoint carries no HF config: the model shape comes from a config.json supplied apart
(see loading.load_model).

Loading keeps each process to its own shards: every needed MaxText array is restored by Orbax
straight into a sharding over the mesh (derived from the sharding of the Tunix parameter it feeds),
then one jitted function slices the layers, transforms them and lays them out with the Tunix
parameters' shardings as its out_shardings. Nothing is gathered on one host.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from tunix.models.gemma3 import model as gemma3_lib

from lorajob_trainer import weights
from lorajob_trainer.mesh import named_sharding, variable_sharding

log = logging.getLogger(__name__)

TREE_PREFIX = "params.params."
"""Where MaxText keeps the model parameters in its checkpoint tree."""
PARAM_SCAN_AXIS = 1
"""MaxText's default `param_scan_axis`; another axis is accepted when the shapes leave no doubt."""
GEMMA3_SCAN_PERIOD = len(gemma3_lib.GEMMA3_ATTENTION_PATTERN)


@dataclasses.dataclass(frozen=True)
class MaxTextMap:
    """One Tunix parameter and the MaxText tensor(s) holding it.

    `ours` is the dotted NNX path with `{i}` for the layer index. `maxtext` holds dotted MaxText
    paths, relative to the layer subtree for per-layer parameters, else to the parameter tree; with
    two paths the tensors are stacked along the first axis of `ours_axes` (or interleaved on it, see
    `interleaved`). `maxtext_axes` / `ours_axes` name the axes of one layer's tensor (None: same
    order). `convert` undoes a value transform of MaxText's converter; it gets one layer's tensor in
    float32, in MaxText's axis order, and the Tunix config.
    """

    ours: str
    maxtext: tuple[str, ...]
    maxtext_axes: str | None = None
    ours_axes: str | None = None
    convert: Callable[[jax.Array, Any], jax.Array] | None = None
    vocab_rows: bool = False
    """Axis 0 counts vocabulary entries, which MaxText's converter pads with zeros or cuts to MaxText's
    vocab_size (Gemma 3: 262144 of the HF config's 262208); rows the checkpoint lacks load as zeros,
    rows beyond the config's vocab_size are dropped."""
    interleaved: bool = False
    """The paths' tensors alternate on the shared first axis instead of stacking on a new one: row k·e + j
    is row e of path j (Qwen3 MoE: Tunix's gate_up_proj [2·E, in, out] holds expert e's gate, MaxText's
    wi_0 [E, in, out], at row 2e and its up projection, wi_1, at 2e + 1)."""

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.ours

    @property
    def stacked(self) -> int:
        """1 when the Tunix parameter stacks several MaxText tensors on a new first axis, else 0."""
        return int(len(self.maxtext) > 1 and not self.interleaved)

    def combine(self, parts: list[jax.Array]) -> jax.Array:
        """The Tunix tensor from one layer's MaxText tensors (each already in Tunix's axis order)."""
        if len(parts) == 1:
            return parts[0]
        if self.interleaved:
            return jnp.stack(parts, axis=1).reshape((-1, *parts[0].shape[1:]))
        return jnp.stack(parts)


# --- value transforms ------------------------------------------------------------------------


def _gemma_norm(x: jax.Array, _: Any) -> jax.Array:
    """MaxText stores Gemma's RMSNorm scale as 1 + w; Tunix (like HF) keeps w and scales by 1 + w."""
    return x - 1.0


def _gemma_embedding(x: jax.Array, config: Any) -> jax.Array:
    """MaxText stores Gemma's embedding times √embed rounded to bfloat16 (its converter's
    normalizer); Tunix multiplies by √embed itself in the forward."""
    normalizer = float(ml_dtypes.bfloat16(np.sqrt(config.embed_dim)))
    return x / normalizer


def _deinterleave_rope(x: jax.Array) -> jax.Array:
    """MaxText's Llama keeps RoPE pairs interleaved (x0, y0, x1, y1, ...) on head_dim; HF and Tunix
    keep the halves apart (x0, x1, ..., y0, y1, ...)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


def _llama_query(x: jax.Array, config: Any) -> jax.Array:
    """MaxText's Llama folds the 1/√head_dim attention scale into the query kernel (float32)."""
    return _deinterleave_rope(x) * np.float32(np.sqrt(config.head_dim))


def _llama_key(x: jax.Array, _: Any) -> jax.Array:
    return _deinterleave_rope(x)


# --- per-family maps ---------------------------------------------------------------------------


def _decoder_maps(config: Any, *, qk_norm: bool, tied: bool, rope_interleaved: bool) -> list[MaxTextMap]:
    """Qwen3 and Llama 3: MaxText's kernels already have Tunix's axis order."""
    query, key = (_llama_query, _llama_key) if rope_interleaved else (None, None)
    maps = [
        MaxTextMap("embedder.input_embedding", ("token_embedder.embedding",), vocab_rows=True),
        MaxTextMap("final_norm.w", ("decoder.decoder_norm.scale",)),
        MaxTextMap("layers.{i}.attn.q_proj.w", ("self_attention.query.kernel",), convert=query),
        MaxTextMap("layers.{i}.attn.k_proj.w", ("self_attention.key.kernel",), convert=key),
        MaxTextMap("layers.{i}.attn.v_proj.w", ("self_attention.value.kernel",)),
        MaxTextMap("layers.{i}.attn.o_proj.w", ("self_attention.out.kernel",)),
        MaxTextMap("layers.{i}.mlp.gate_proj.kernel", ("mlp.wi_0.kernel",)),
        MaxTextMap("layers.{i}.mlp.up_proj.kernel", ("mlp.wi_1.kernel",)),
        MaxTextMap("layers.{i}.mlp.down_proj.kernel", ("mlp.wo.kernel",)),
        MaxTextMap("layers.{i}.input_layernorm.w", ("pre_self_attention_layer_norm.scale",)),
        MaxTextMap("layers.{i}.post_attention_layernorm.w", ("post_self_attention_layer_norm.scale",)),
    ]
    if qk_norm:
        maps += [
            MaxTextMap("layers.{i}.attn.q_norm.w", ("self_attention.query_norm.scale",)),
            MaxTextMap("layers.{i}.attn.k_norm.w", ("self_attention.key_norm.scale",)),
        ]
    if not tied:
        maps.append(MaxTextMap("lm_head.w", ("decoder.logits_dense.kernel",)))
    return maps


def _qwen3_moe_maps(config: Any) -> list[MaxTextMap]:
    """Qwen3's attention, norms and embeddings; MaxText's expert tensors already have Tunix's axis order."""
    dense = _decoder_maps(config, qk_norm=True, tied=config.use_tied_embedding, rope_interleaved=False)
    return [m for m in dense if ".mlp." not in m.ours] + [
        MaxTextMap("layers.{i}.mlp.router.kernel", ("moe_block.gate.kernel",)),
        MaxTextMap("layers.{i}.mlp.experts.gate_up_proj.w", ("moe_block.wi_0", "moe_block.wi_1"), interleaved=True),
        MaxTextMap("layers.{i}.mlp.experts.down_proj.w", ("moe_block.wo",)),
    ]


def _gemma3_maps(config: gemma3_lib.ModelConfig) -> list[MaxTextMap]:
    norms = [
        ("attn._query_norm.scale", "self_attention.query_norm.scale"),
        ("attn._key_norm.scale", "self_attention.key_norm.scale"),
        ("pre_attention_norm.scale", "pre_self_attention_norm.scale"),
        ("post_attention_norm.scale", "post_self_attention_norm.scale"),
        ("pre_ffw_norm.scale", "pre_ffw_norm.scale"),
        ("post_ffw_norm.scale", "post_ffw_norm.scale"),
    ]
    return [
        MaxTextMap(
            "embedder.input_embedding", ("token_embedder.embedding",), convert=_gemma_embedding, vocab_rows=True
        ),
        MaxTextMap("final_norm.scale", ("decoder.decoder_norm.scale",), convert=_gemma_norm),
        MaxTextMap("layers.{i}.attn.q_einsum.w", ("self_attention.query.kernel",), "d n h", "n d h"),
        MaxTextMap("layers.{i}.attn.kv_einsum.k_einsum.w", ("self_attention.key.kernel",), "d n h", "n d h"),
        MaxTextMap("layers.{i}.attn.kv_einsum.v_einsum.w", ("self_attention.value.kernel",), "d n h", "n d h"),
        MaxTextMap("layers.{i}.attn.attn_vec_einsum.w", ("self_attention.out.kernel",)),
        MaxTextMap("layers.{i}.mlp.gate_proj.kernel", ("mlp.wi_0.kernel",)),
        MaxTextMap("layers.{i}.mlp.up_proj.kernel", ("mlp.wi_1.kernel",)),
        MaxTextMap("layers.{i}.mlp.down_proj.kernel", ("mlp.wo.kernel",)),
        *(MaxTextMap(f"layers.{{i}}.{ours}", (theirs,), convert=_gemma_norm) for ours, theirs in norms),
    ]


@dataclasses.dataclass(frozen=True)
class FamilyLayout:
    maps: Callable[[Any], list[MaxTextMap]]
    scan_period: int = 1
    """Scanned checkpoints stack the layers in this many interleaved groups (Gemma 3: its attention pattern)."""


LAYOUTS: dict[str, FamilyLayout] = {
    "qwen3": FamilyLayout(
        lambda c: _decoder_maps(c, qk_norm=True, tied=c.use_tied_embedding, rope_interleaved=False)
    ),
    "qwen3-moe": FamilyLayout(_qwen3_moe_maps),
    "llama3": FamilyLayout(lambda c: _decoder_maps(c, qk_norm=False, tied=c.weight_tying, rope_interleaved=True)),
    "gemma3": FamilyLayout(_gemma3_maps, scan_period=GEMMA3_SCAN_PERIOD),
}


# --- where a layer lives -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """Layer i of the model: the subtree holding it, and its index in that subtree's stack (None: unstacked)."""

    prefix: str
    index: int | None = None
    stack_size: int = 1


def layer_slots(keys: set[str], num_layers: int, scan_period: int) -> list[LayerSlot]:
    """Where each layer of a checkpoint with parameter `keys` (relative to TREE_PREFIX) lives."""
    if any(key.startswith("decoder.layers_0.") for key in keys):
        return [LayerSlot(f"decoder.layers_{i}") for i in range(num_layers)]
    if not any(key.startswith(("decoder.layers.", "decoder.layers_remainder.")) for key in keys):
        raise weights.WeightsError("the MaxText checkpoint has no decoder layers (decoder/layers or decoder/layers_0)")
    if scan_period == 1:
        return [LayerSlot("decoder.layers", i, num_layers) for i in range(num_layers)]
    scanned = num_layers - num_layers % scan_period
    return [
        LayerSlot(f"decoder.layers.layers_{i % scan_period}", i // scan_period, scanned // scan_period)
        if i < scanned
        else LayerSlot(f"decoder.layers_remainder.layers_{i - scanned}")
        for i in range(num_layers)
    ]


# --- reading -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """One MaxText array feeding a Tunix parameter: its key, and the layer's index in its stack."""

    key: str
    index: int | None
    stack_size: int


@dataclasses.dataclass(frozen=True)
class Read:
    ours: str
    tmap: MaxTextMap
    sources: tuple[Source, ...]


def plan(maps: list[MaxTextMap], slots: list[LayerSlot]) -> list[Read]:
    reads = []
    for tmap in maps:
        if not tmap.per_layer:
            reads.append(Read(tmap.ours, tmap, tuple(Source(TREE_PREFIX + key, None, 1) for key in tmap.maxtext)))
            continue
        for i, slot in enumerate(slots):
            sources = tuple(
                Source(f"{TREE_PREFIX}{slot.prefix}.{key}", slot.index, slot.stack_size) for key in tmap.maxtext
            )
            reads.append(Read(tmap.ours.format(i=i), tmap, sources))
    return reads


def _layer_order(tmap: MaxTextMap) -> tuple[list[str] | None, list[str] | None]:
    """(MaxText axis names of one layer's tensor, Tunix's names without the stacking axis)."""
    if tmap.maxtext_axes is None:
        return None, None
    ours = tmap.ours_axes.split()
    return tmap.maxtext_axes.split(), ours[tmap.stacked :]


def layer_shape(tmap: MaxTextMap, ours_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one layer's MaxText tensor for a Tunix parameter of `ours_shape`."""
    theirs, ours = _layer_order(tmap)
    shape = list(ours_shape[tmap.stacked :])
    if tmap.interleaved:
        shape[0] //= len(tmap.maxtext)
    if theirs is None:
        return tuple(shape)
    sizes = dict(zip(ours, shape))
    return tuple(sizes[name] for name in theirs)


def layer_spec(tmap: MaxTextMap, ours_spec: PartitionSpec, ndim: int) -> list[Any]:
    """The PartitionSpec entries of one layer's MaxText tensor that match the Tunix parameter's sharding."""
    entries = list(ours_spec) + [None] * (ndim - len(ours_spec))
    entries = entries[tmap.stacked :]
    theirs, ours = _layer_order(tmap)
    if theirs is None:
        return entries
    by_name = dict(zip(ours, entries))
    return [by_name[name] for name in theirs]


def scan_axis(key: str, found: tuple[int, ...], per_layer: tuple[int, ...], stack_size: int) -> int:
    """The axis of `found` that stacks layers (MaxText's param_scan_axis); WeightsError if none fits."""
    candidates = [
        axis
        for axis in range(len(found))
        if found[axis] == stack_size and found[:axis] + found[axis + 1 :] == per_layer
    ]
    if not candidates:
        expected = per_layer[:PARAM_SCAN_AXIS] + (stack_size,) + per_layer[PARAM_SCAN_AXIS:]
        raise weights.WeightsError(shape_error(key, expected, found))
    return PARAM_SCAN_AXIS if PARAM_SCAN_AXIS in candidates else candidates[0]


def shape_error(key: str, expected: tuple[int, ...], found: tuple[int, ...]) -> str:
    return (
        f"MaxText parameter {key.removeprefix(TREE_PREFIX)} has shape {found}, the model config implies {expected} "
        "(does the config.json belong to this checkpoint?)"
    )


def read_metadata(location: str | epath.PathLike) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes and dtypes of every array of the Orbax PyTree at `location`, by dotted key."""
    path = epath.Path(location)
    if not (path / "_METADATA").exists():
        raise weights.WeightsError(f"{location} is not an Orbax checkpoint (no _METADATA)")
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        metadata = checkpointer.metadata(path)
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)
    return {
        ".".join(str(getattr(part, "key", part)) for part in path_parts): jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
        for path_parts, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if getattr(leaf, "shape", None) is not None
    }


def load_state(
    abstract_state: nnx.State, family: str, tunix_config: Any, location: str, *, mesh: Mesh, dtype: Any
) -> nnx.State:
    """Fill an abstract NNX state of `family` from the MaxText checkpoint at `location` (`.../0/items`)."""
    if family not in LAYOUTS:
        raise weights.WeightsError(
            f"{location}: MaxText checkpoints of {family} models are not supported (supported: {', '.join(LAYOUTS)}); "
            "start from the Hugging Face checkpoint instead (spec.model.huggingFace)"
        )
    layout = LAYOUTS[family]
    metadata = read_metadata(location)
    keys = {key.removeprefix(TREE_PREFIX) for key in metadata if key.startswith(TREE_PREFIX)}
    reads = plan(layout.maps(tunix_config), layer_slots(keys, tunix_config.num_layers, layout.scan_period))
    flat = nnx.to_flat_state(abstract_state)
    variables = {weights.path_key(path): variable for path, variable in flat}
    if set(variables) != {read.ours for read in reads}:
        raise weights.WeightsError(
            f"internal: MaxText maps do not cover the model: {sorted(set(variables) ^ {r.ours for r in reads})[:5]}"
        )
    used = {source.key for read in reads for source in read.sources}
    missing = sorted(used - set(metadata))
    if missing:
        raise weights.WeightsError(
            f"{location} lacks {len(missing)} parameters a {family} model of this config has, e.g. "
            f"{[key.removeprefix(TREE_PREFIX) for key in missing[:3]]} (is it a {family} MaxText checkpoint?)"
        )
    _check_all_used(metadata, used, location, family)
    targets, axes = _restore_targets(reads, variables, metadata, mesh)
    arrays = weights.restore_orbax_params(location, targets, partial=True)
    out_shardings = {read.ours: variable_sharding(mesh, variables[read.ours]) for read in reads}
    shapes = {read.ours: tuple(variables[read.ours].get_value().shape) for read in reads}
    values = jax.jit(
        lambda a: _to_tunix(a, reads, axes, shapes, tunix_config, dtype), out_shardings=out_shardings
    )(arrays)
    for read in reads:
        variables[read.ours].set_value(values[read.ours])
    return abstract_state


def _restore_targets(
    reads: list[Read], variables: dict[str, nnx.Variable], metadata: Mapping[str, jax.ShapeDtypeStruct], mesh: Mesh
) -> tuple[dict[str, jax.ShapeDtypeStruct], dict[str, int]]:
    """The MaxText arrays to restore, each sharded like the Tunix parameter it feeds (the layer axis
    unsharded), and the layer axis of each stacked one; WeightsError naming any misshapen array."""
    targets, axes = {}, {}
    for read in reads:
        variable = variables[read.ours]
        shape = tuple(variable.get_value().shape)
        per_layer = layer_shape(read.tmap, shape)
        spec = layer_spec(read.tmap, variable_sharding(mesh, variable).spec, len(shape))
        for source in read.sources:
            found = tuple(metadata[source.key].shape)
            if source.index is None:
                if found != per_layer and not (read.tmap.vocab_rows and found[1:] == per_layer[1:]):
                    raise weights.WeightsError(shape_error(source.key, per_layer, found))
                source_spec = spec
            else:
                axes[source.key] = scan_axis(source.key, found, per_layer, source.stack_size)
                source_spec = spec[: axes[source.key]] + [None] + spec[axes[source.key] :]
            if read.tmap.vocab_rows and found[0] != per_layer[0]:
                log.warning("%s has %d vocabulary rows, the config %d", source.key, found[0], per_layer[0])
            sharding = named_sharding(mesh, tuple(source_spec), found)
            targets[source.key] = jax.ShapeDtypeStruct(found, metadata[source.key].dtype, sharding=sharding)
    return targets, axes


def _check_all_used(metadata: Mapping[str, Any], used: set[str], location: str, family: str) -> None:
    """Unused decoder arrays mean another architecture (say Qwen3's q/k norms under a Llama config);
    other unused arrays (a multimodal checkpoint's vision encoder) are only logged."""
    unused = sorted(key for key in metadata if key.startswith(TREE_PREFIX) and key not in used)
    decoder = [key.removeprefix(TREE_PREFIX) for key in unused if key.startswith(TREE_PREFIX + "decoder.")]
    if decoder:
        raise weights.WeightsError(
            f"{location} holds {len(decoder)} decoder parameters a {family} model of this config does not have, "
            f"e.g. {decoder[:3]} (does the config.json belong to this checkpoint?)"
        )
    if unused:
        log.warning("ignoring %d parameters of %s not used by the model, e.g. %s", len(unused), location, unused[:3])


def _to_tunix(
    arrays: dict[str, jax.Array],
    reads: list[Read],
    axes: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    tunix_config: Any,
    dtype: Any,
) -> dict[str, jax.Array]:
    values = {}
    for read in reads:
        parts = [_layer_tensor(arrays, source, axes, read.tmap, tunix_config) for source in read.sources]
        value = read.tmap.combine(parts)
        if read.tmap.vocab_rows:
            value = _resize_rows(value, shapes[read.ours][0])
        values[read.ours] = value.astype(dtype)
    return values


def _resize_rows(value: jax.Array, rows: int) -> jax.Array:
    if value.shape[0] >= rows:
        return value[:rows]
    return jnp.pad(value, [(0, rows - value.shape[0])] + [(0, 0)] * (value.ndim - 1))


def _layer_tensor(
    arrays: dict[str, jax.Array], source: Source, axes: dict[str, int], tmap: MaxTextMap, tunix_config: Any
) -> jax.Array:
    tensor = arrays[source.key].astype(jnp.float32)
    if source.index is not None:
        tensor = jax.lax.index_in_dim(tensor, source.index, axis=axes[source.key], keepdims=False)
    if tmap.convert is not None:
        tensor = tmap.convert(tensor, tunix_config)
    theirs, ours = _layer_order(tmap)
    return tensor if theirs is None else tensor.transpose([theirs.index(name) for name in ours])
