"""The decoder forward the trainer runs: Tunix's layer modules, our loop over them.

`Decoder` goes before a Tunix causal-LM class in a subclass (families.py): its `__call__` embeds,
runs the layers, applies the final norm and, unless `hidden=True`, the LM head. The layers run

- **scanned** once `stack_layers` has replaced `model.layers` by `StackedLayers`: the variables of
  layer `r * period + j` are stacked on a leading axis in `blocks[j]`, and one `lax.scan` over the
  repeats runs the period's layers in turn. The compiled step holds one layer's gathered weights
  and one layer's attention at a time, and compiles one layer body however deep the model is;
- **rematerialised per layer** under the policy of remat.py (`remat=`), inside the scan;
- with the residual stream **sharded on the batch axes** at every layer boundary (mesh.BATCH_AXES,
  when a mesh with those axes is set), so the compiler never replicates a layer's activations.

Without `stack_layers` (conversion, export, parity tests) the same layers run unrolled, one after another; both
orders compute the same function. A step may take a stacked weight with its layers on its second axis
(`layers_second`, on tpu7x: step.BaseLayout) and move them back first (`layers_first`) before the scan. Generation (generate.py) runs them with a KV cache per layer
(`Decoder.__call__` with `cache`), stacked like the layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import NamedSharding, PartitionSpec

from lorajob_trainer.mesh import BATCH_AXES, axis_moved, data_parallel_size
from lorajob_trainer.remat import RematPolicy, saveable

LayerFn = Callable[[nnx.Module, jax.Array], jax.Array]


class StackedLayers(nnx.Module):
    """Decoder layers laid out for `lax.scan`: `blocks[j]` is layer j with each variable holding the values
    of layers j, period + j, 2 * period + j, ... stacked on axis 0 (`repeats` of them); `rest` holds the
    layers after the last whole period, as they were."""

    def __init__(self, blocks: list[nnx.Module], rest: list[nnx.Module], repeats: int):
        self.blocks = nnx.List(blocks)
        self.rest = nnx.List(rest)
        self.repeats = repeats


@dataclasses.dataclass(frozen=True)
class Stacking:
    """How `StackedLayers` paths map to the per-layer paths of the checkpoint layout (`layers.<i>....`)."""

    period: int
    repeats: int

    def layer_paths(self, path: tuple) -> list[tuple]:
        """The per-layer paths a stacked variable's rows hold (one per repeat), or `[path]` for one that is
        not stacked (a `rest` layer's variable maps to its own layer index)."""
        if len(path) < 3 or path[0] != "layers" or path[1] not in ("blocks", "rest"):
            return [path]
        position, tail = int(path[2]), path[3:]
        if path[1] == "rest":
            return [("layers", self.repeats * self.period + position, *tail)]
        return [("layers", r * self.period + position, *tail) for r in range(self.repeats)]

    def is_stacked(self, path: tuple) -> bool:
        return len(path) > 1 and path[0] == "layers" and path[1] == "blocks"


def stack_layers(model: nnx.Module, period: int) -> Stacking | None:
    """Replace `model.layers` by `StackedLayers` of `period` (in place; the unstacked layers' arrays are
    deleted as their stacked copies are made, so device memory does not double: nothing else may hold them).
    Values are concrete arrays or `jax.ShapeDtypeStruct`s with shardings (a model built for planning); stacked
    ones get the sharding of their layer with the new leading axis unsplit. None (nothing changed) when fewer than two repeats fit,
    or when layers `period` apart differ in structure."""
    layers = list(model.layers)
    repeats = len(layers) // period
    if repeats < 2:
        return None
    groups = [[layers[r * period + j] for r in range(repeats)] for j in range(period)]
    states = [[nnx.state(layer) for layer in group] for group in groups]
    if any(len({_signature(state) for state in group}) > 1 for group in states):
        return None
    for group, group_states in zip(groups, states):
        nnx.update(group[0], _stack_states(group_states))
    model.layers = StackedLayers([group[0] for group in groups], layers[repeats * period :], repeats)
    return Stacking(period, repeats)


def _signature(state: nnx.State) -> tuple:
    leaves, treedef = jax.tree.flatten(state)
    return treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves)


def _stack_states(states: list[nnx.State]) -> nnx.State:
    leaves = [jax.tree.leaves(state) for state in states]
    treedef = jax.tree.structure(states[0])
    if isinstance(leaves[0][0], jax.ShapeDtypeStruct):
        stacked = [_stacked_struct(column) for column in zip(*leaves)]
    else:
        # One variable at a time, its layers' arrays deleted as soon as it is stacked: the memory held at once is
        # the model plus one stacked variable.
        stacked = []
        for column in zip(*leaves):
            stacked.append(_stacker(_stacked_sharding(column[0].sharding))(list(column)))
            for array in column:
                array.delete()
    return jax.tree.unflatten(treedef, stacked)


@functools.cache
def _stacker(sharding: Any) -> Callable[[list[jax.Array]], jax.Array]:
    return jax.jit(jnp.stack, out_shardings=sharding)


def _stacked_struct(column: tuple[jax.ShapeDtypeStruct, ...]) -> jax.ShapeDtypeStruct:
    first = column[0]
    sharding = None if first.sharding is None else _stacked_sharding(first.sharding)
    return jax.ShapeDtypeStruct((len(column), *first.shape), first.dtype, sharding=sharding)


def _stacked_sharding(sharding: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return sharding


def unstacked_rows(value: jax.Array | jax.ShapeDtypeStruct) -> list[jax.Array | jax.ShapeDtypeStruct]:
    """The rows of a stacked value (axis 0), each with its layer's sharding (the stacked one less axis 0)."""
    sharding = getattr(value, "sharding", None)
    row_sharding = None
    if isinstance(sharding, NamedSharding):
        row_sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    if isinstance(value, jax.ShapeDtypeStruct):
        row = jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=row_sharding)
        return [row] * value.shape[0]
    return [value[r] if row_sharding is None else jax.device_put(value[r], row_sharding) for r in range(value.shape[0])]


STORED_LAYER_AXIS = 1
"""The axis of a stacked value stored layers-second (`layers_second`) that holds its layers."""


def layers_second(value: jax.Array | jax.ShapeDtypeStruct) -> jax.Array | jax.ShapeDtypeStruct:
    """A stacked value (its layers on axis 0) with its layers moved to `STORED_LAYER_AXIS`, its sharding permuted the
    same way: a ShapeDtypeStruct's shape and sharding only; a concrete array's copy, made where its shards are."""
    ndim = len(value.shape)
    sharding = axis_moved(getattr(value, "sharding", None), ndim, 0, STORED_LAYER_AXIS)
    if isinstance(value, jax.ShapeDtypeStruct):
        shape = list(value.shape)
        shape.insert(STORED_LAYER_AXIS, shape.pop(0))
        return jax.ShapeDtypeStruct(tuple(shape), value.dtype, sharding=sharding)
    return _layers_mover(sharding)(value)


@functools.cache
def _layers_mover(sharding: Any) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: jnp.moveaxis(x, 0, STORED_LAYER_AXIS), out_shardings=sharding)


def layers_first(value: jax.Array) -> jax.Array:
    """A value stored by `layers_second` with its layers back on axis 0, as the scan takes them (inside a step), laid
    out layers-major. Left free, the compiler made a stacked expert weight's ([experts, layers, d, f] stored) a bitcast
    of the argument and converted it to tpu7x's matrix-unit tiling once per layer loop, in two layouts; laid out so,
    it is one transpose that both loops read (docs/train-step-memory.md)."""
    return with_layout_constraint(jnp.moveaxis(value, STORED_LAYER_AXIS, 0), Layout(tuple(range(value.ndim))))


def batch_sharded(x: jax.Array) -> jax.Array:
    """`x` [batch, ...] constrained to split its batch over the mesh's data-parallel axes (when a mesh with
    them is set and divides the batch). Only while tracing: eagerly (Qwix's adapter-creating pass at set-up)
    a constraint would be a cross-process reshard of host-local inputs that the processes need not agree on."""
    mesh = jax.sharding.get_abstract_mesh()
    if not isinstance(x, jax.core.Tracer) or mesh.empty or not set(BATCH_AXES) <= set(mesh.axis_names):
        return x
    if x.shape[0] % data_parallel_size(mesh):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(BATCH_AXES)))


def call_layer(layer: nnx.Module, x: jax.Array, policy: RematPolicy, fn: Callable[[nnx.Module, jax.Array], Any]) -> Any:
    """`fn(layer, x)`, under `jax.checkpoint` with `policy` unless it is "none". The layer runs as a pure
    function of its state (nnx.remat would write the Qwix adapters back across trace levels, which NNX
    refuses); intermediates it records (experts.RouterLogits) leave it as outputs and are set on it again."""
    if policy == "none":
        return fn(layer, x)
    graphdef, state = nnx.split(layer)

    def pure(state: nnx.State, x: jax.Array):
        module = nnx.merge(graphdef, state)
        return fn(module, x), nnx.pop(module, nnx.Intermediate)

    out, recorded = jax.checkpoint(pure, policy=saveable(policy))(state, x)
    nnx.update(layer, recorded)
    return out


def run_layers(layers: Any, x: jax.Array, policy: RematPolicy, fn: LayerFn) -> jax.Array:
    """Every layer of `layers` (a StackedLayers or a sequence) on `x` in order, each through `call_layer`."""
    rest = layers
    if isinstance(layers, StackedLayers):
        graphdef, state = nnx.split(layers.blocks)

        def body(carry: jax.Array, rows: nnx.State):
            blocks = nnx.merge(graphdef, rows)
            for block in blocks:
                carry = call_layer(block, carry, policy, fn)
            return carry, nnx.pop(blocks, nnx.Intermediate)

        x, recorded = jax.lax.scan(body, x, state)
        nnx.update(layers.blocks, recorded)
        rest = layers.rest
    for layer in rest:
        x = call_layer(layer, x, policy, fn)
    return x


LayerCache = dict[str, jax.Array]
"""One attention layer's KV cache as Tunix's attention blocks take it: `k`, `v` [B, S, kv heads, head dim] and
`end_index` [B] (the next write position, the same for every row)."""


def run_layers_cached(layers: Any, x: jax.Array, caches: dict, fn: Callable) -> tuple[jax.Array, dict]:
    """Every layer of `layers` on `x` with its KV cache: `fn(layer, x, cache) -> (x, cache)`; `caches` is laid out
    as `Decoder.init_caches` makes it ({"blocks": per block, stacked like the layers; "rest": per layer})."""
    blocks_out: list = []
    if isinstance(layers, StackedLayers):
        graphdef, state = nnx.split(layers.blocks)

        def body(carry: jax.Array, xs):
            rows, block_caches = xs
            updated = []
            for block, cache in zip(nnx.merge(graphdef, rows), block_caches):
                carry, cache = fn(block, carry, cache)
                updated.append(cache)
            return carry, updated

        x, blocks_out = jax.lax.scan(body, x, (state, caches["blocks"]))
        layers = layers.rest
    rest_out = []
    for layer, cache in zip(layers, caches["rest"]):
        x, cache = fn(layer, x, cache)
        rest_out.append(cache)
    return x, {"blocks": blocks_out, "rest": rest_out}


class Decoder:
    """Mixin for a Tunix causal LM whose forward is embed -> layers -> final norm -> LM head (Qwen3, Llama 3,
    Gemma 3, Gemma 4): the forward of the module docstring, with or without KV caches."""

    final_logit_softcap: float | None = None
    """Logits are `cap * tanh(logits / cap)` (Gemma 4); None: no capping."""

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: Any = None,
        attention_mask: jax.Array | None = None,
        *,
        hidden: bool = False,
        remat: RematPolicy = "none",
    ) -> tuple[jax.Array, Any]:
        """(logits [B, L, vocab], or with `hidden` the final norm's output [B, L, D]; None). With `cache` (as
        `init_caches` makes it): (logits [B, vocab] at the last of `tokens`, the caches with `tokens`' keys and values
        written at their `end_index`), `attention_mask` [B, L, cache size] saying which cache positions each token
        attends to. Both run through `__call__`, where Qwix intercepts the einsums that its LoRA adapts."""
        if cache is not None:
            return self._cached_last_logits(tokens, positions, cache, attention_mask)
        x = batch_sharded(self.embedder.encode(tokens))
        x = self.final_norm(self.run_decoder_layers(x, tokens, positions, attention_mask, remat))
        if hidden:
            return x, None
        return self.logits(x), None

    def run_decoder_layers(
        self, x: jax.Array, tokens: jax.Array, positions: jax.Array, mask: jax.Array | None, remat: RematPolicy
    ) -> jax.Array:
        def layer_fn(layer: nnx.Module, x: jax.Array) -> jax.Array:
            return batch_sharded(layer(x, positions, None, mask)[1])

        return run_layers(self.layers, x, remat, layer_fn)

    def init_caches(self, batch: int, size: int, dtype: jnp.dtype) -> dict:
        """Empty KV caches of `size` positions for every layer, laid out for `run_layers_cached`."""
        config = self.config

        def empty(*leading: int) -> LayerCache:
            shape = (*leading, batch, size, config.num_kv_heads, config.head_dim)
            return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                    "end_index": jnp.zeros((*leading, batch), jnp.int32)}

        if isinstance(self.layers, StackedLayers):
            return {"blocks": [empty(self.layers.repeats) for _ in self.layers.blocks],
                    "rest": [empty() for _ in self.layers.rest]}
        return {"blocks": [], "rest": [empty() for _ in self.layers]}

    def _cached_last_logits(self, tokens: jax.Array, positions: jax.Array, caches: dict, mask: jax.Array
                            ) -> tuple[jax.Array, dict]:
        def layer_fn(layer: nnx.Module, x: jax.Array, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
            cache, x = layer(x, positions, cache, mask)[:2]  # Gemma 4's layers also return their keys and values
            return batch_sharded(x), cache

        x, caches = run_layers_cached(self.layers, batch_sharded(self.embedder.encode(tokens)), caches, layer_fn)
        return self.logits(self.final_norm(x[:, -1:]))[:, 0], caches

    def logits(self, x: jax.Array) -> jax.Array:
        logits = self.lm_head(x) if hasattr(self, "lm_head") else self.embedder.decode(x)
        if self.final_logit_softcap is None:
            return logits
        cap = self.final_logit_softcap
        return jnp.tanh(logits.astype(jnp.float32) / cap) * cap
