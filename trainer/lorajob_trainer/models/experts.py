"""Routed mixture-of-experts pieces shared by the MoE families (Qwen3 MoE; reusable for Gemma 4 26B).

- `route_top_k`: softmax over the router logits, top-k, optional renormalisation, as transformers does.
- `ExpertsLinear`: one linear map per expert, applied with `jax.lax.ragged_dot` to tokens sorted by
  expert (only the chosen experts compute), with its own per-expert LoRA: A [E, in, r],
  B [E, r, out], one independent rank-r adapter per expert. Qwix does not intercept `ragged_dot`,
  so `lora.apply_lora` adds these adapters itself (`add_lora`). The adapters' grouped matmuls run in
  `ragged_dot` too, on every platform. The Pallas grouped-matmul kernel that ships with JAX (megablox) is the
  other choice (`grouped_matmul`, `use_adapter_kernel`); on a v5e chip it was the slower by far at rank 16: its
  tiles are 128 wide and an adapter's rank is 16. Measured (bench/chip_bench.py, 2026-12-07), with the adapters in
  megablox against `ragged_dot`: qwen3-30b-a3b cut to 6 layers, 4 x 2,048 tokens, 10,996 against 14,179
  tokens/s; gemma4-26b 6 layers (64 experts), 2 x 2,048, 8,975 against 12,048. The adapters took 252 ms of the
  step in megablox against about 29 ms in `ragged_dot` (Qwen3), 162 against about 19 (Gemma 4). The TPU
  compiler's cost analysis counts `ragged_dot`'s weight gradient densely, every expert over every row, but the
  chip's time says it does not run it so.
- `mix_experts`: a block's tokens through their experts on a mesh: each device's tokens against every
  expert's gathered weights (FSDP-style), or, with an expert axis, sent to the devices that hold their experts
  and back (expert parallelism: two all-to-alls per pass, rows beyond a capacity dropped and counted).
- `RoutedBlock` / `LoadBalanced` / `routing_recorded` / `load_balancing_loss`: the blocks' recorded dispatch
  counts, and transformers' MoE load-balancing (auxiliary) loss, for the blocks whose family defines one
  (Qwen3 MoE does; Gemma 4 does not).
- `to_peft` / `from_peft`: that adapter in the layout PEFT 0.21 writes for LoRA on a 3-D expert
  parameter (`LoraConfig(target_parameters=[...])`, `lora.ParamWrapper`): lora_A [E*r, in] with
  expert-major rows, lora_B [out, r*E] with expert-minor columns (`lora_B.reshape(out, r, E)`).

A fused weight such as transformers' `gate_up_proj` ([E, 2F, D]: gate rows, then up rows) is
stored as `parts` = 2 stacked matrices per expert, `w` [E*parts, in, out] (expert-major), because
the Hub checkpoints keep gate and up as separate per-expert tensors; the adapter covers the fused
output (out * parts), as PEFT's one adapter on `gate_up_proj` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.nn import initializers
from jax.sharding import PartitionSpec
from qwix._src.core import qarray  # QLoRA's experts quantise as Qwix quantises the other projections

from lorajob_trainer import mesh as mesh_lib


GROUPED_MATMUL_ROW_TILE = 128
"""Rows per tile of the Pallas grouped matmul; a matmul whose rows it does not divide runs as `ragged_dot`."""


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, kernel: str, interpret: bool = False) -> jax.Array:
    """x [M, in] sorted by group, `group_sizes` [G] rows each, times w [G, in, out] -> [M, out]; `kernel`
    "pallas": JAX's Pallas TPU grouped matmul (megablox; `interpret` runs it on any backend), "xla":
    `jax.lax.ragged_dot`."""
    if kernel == "xla" or x.shape[0] % GROUPED_MATMUL_ROW_TILE:
        return jax.lax.ragged_dot(x, w, group_sizes)
    from jax.experimental.pallas.ops.tpu.megablox import ops

    return ops.gmm(x, w, group_sizes, x.dtype, _grouped_matmul_tiles, None, None, False, interpret)


def _grouped_matmul_tiles(rows: int, d_in: int, d_out: int) -> tuple[int, int, int]:
    """Tiles of one grouped matmul (looked up per call: the backward pass's swap the adapter's two sizes); a
    TPU block's last two sizes are multiples of (8, 128) or the array's own, as a rank of 16 is."""
    return GROUPED_MATMUL_ROW_TILE, min(d_in, 128), min(d_out, 128)


EXPERTS_NAME = "experts"
"""The attribute of a routed-experts block that holds its `ExpertsLinear`s (Qwen3 MoE, Gemma 4)."""
PACKED_DTYPE = jnp.uint32
"""A bf16 expert weight held as `packed_rows` (step.BaseLayout, on tpu7x)."""


def packed_rows(w: jax.Array | jax.ShapeDtypeStruct) -> jax.Array | jax.ShapeDtypeStruct:
    """bf16 [..., rows, cols] -> uint32 [..., rows / 2, cols], word (i, j) holding rows 2i and 2i + 1 of column j: the
    pairing of `pltpu.bitcast` (as Pallas lowers it off TPU; on a v5e chip its kernel unpacks this bit for bit). A
    ShapeDtypeStruct's shape and sharding only."""
    *lead, rows, cols = w.shape
    if isinstance(w, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((*lead, rows // 2, cols), PACKED_DTYPE, sharding=w.sharding)
    pairs = jnp.swapaxes(w.reshape(*lead, rows // 2, 2, cols), -1, -2)
    return jax.lax.bitcast_convert_type(pairs, PACKED_DTYPE)


def unpacked_rows(w: jax.Array, sharding: tuple, mesh: jax.sharding.AbstractMesh | None) -> jax.Array:
    """`packed_rows` undone for one layer's weight [E, rows / 2, cols] split as `sharding` says. On a TPU mesh, each
    device unpacks its shard in a Pallas kernel (`unpack_kernel`): the compiler cannot move the matrix unit's tiling
    (tpu7x: T(16,128)) back through a kernel's operand, so the stacked argument is never converted whole, as it is
    through XLA's own bitcast (docs/train-step-memory.md)."""
    if not mesh_lib.is_tpu(mesh):
        pairs = jax.lax.bitcast_convert_type(w, jnp.bfloat16)
        return jnp.swapaxes(pairs, -1, -2).reshape(*w.shape[:-2], 2 * w.shape[-2], w.shape[-1])
    spec = PartitionSpec(*sharding)
    return jax.shard_map(unpack_kernel, in_specs=(spec,), out_specs=spec, check_vma=False)(w)


UNPACK_BLOCK_BYTES = 2 * 2**20
"""At most this much packed weight per block of `unpack_kernel`: with its unpacked block, each double-buffered, 4× in
VMEM, inside every TPU's default scoped VMEM (v5e's 16 MiB is the smallest). One expert's weight whole is more
(Gemma 4 26B's gate_up: 7.9 MB packed)."""


def _unpack_row_tile(rows: int, cols: int) -> int:
    """Packed rows per block: the most that fit UNPACK_BLOCK_BYTES among divisors of `rows` that are multiples of 8 (a
    uint32 tile's sublanes; twice that, a bf16 tile's), else all of them."""
    fitting = [tile for tile in range(8, rows + 1, 8) if rows % tile == 0 and tile * cols * 4 <= UNPACK_BLOCK_BYTES]
    return max(fitting, default=rows)


def unpack_kernel(w: jax.Array, interpret: bool = False) -> jax.Array:
    """`packed_rows` undone in a Pallas TPU kernel, for one device's [E, rows / 2, cols] (`interpret`: Pallas'
    interpreter, on any backend)."""
    from jax.experimental import pallas as pl

    experts, rows, cols = w.shape
    tile = _unpack_row_tile(rows, cols)
    return pl.pallas_call(
        _unpack_block, grid=(experts, rows // tile),
        in_specs=[pl.BlockSpec((None, tile, cols), lambda e, r: (e, r, 0))],
        out_specs=pl.BlockSpec((None, 2 * tile, cols), lambda e, r: (e, r, 0)),
        out_shape=jax.ShapeDtypeStruct((experts, 2 * rows, cols), jnp.bfloat16),
        interpret=interpret,
    )(w)


def _unpack_block(packed_ref: Any, out_ref: Any) -> None:
    from jax.experimental.pallas import tpu as pltpu

    out_ref[...] = pltpu.bitcast(packed_ref[...], jnp.bfloat16)


EXPERT_AXIS = "expert"
"""The mesh axis whose devices each hold a share of the experts and exchange tokens (`mix_experts`)."""
EXPERT_AXES = (EXPERT_AXIS, "fsdp")
"""Mesh axes the experts' dimension of `ExpertsLinear` weights (and adapters) is split over (mesh.py)."""
IN_EXPERT_SHARDING = (EXPERT_AXES, None, "tp")
"""`ExpertsLinear.sharding` of an input-side (gate/up) projection: [experts, model dim, expert hidden]."""
OUT_EXPERT_SHARDING = (EXPERT_AXES, "tp", None)
"""`ExpertsLinear.sharding` of the output-side (down) projection: [experts, expert hidden, model dim]."""


def route_top_k(logits: jax.Array, k: int, *, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights float32 [N, k], expert ids int32 [N, k]) from router logits [N, E]."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


class RouterLogits(nnx.Intermediate):
    """The router logits [tokens, experts] of one forward of a `LoadBalanced` block, while recorded."""


class DispatchCounts(nnx.Intermediate):
    """[rows dropped, slots padded] of one forward of an expert-parallel block (`mix_experts`), while recorded."""


class RoutedBlock:
    """A routed-experts block (an nnx.Module with `num_experts`, `top_k` and `experts`, whose "gate_up_proj" and
    "down_proj" are `ExpertsLinear`) that mixes its tokens with `mix_experts` at
    `capacity_factor` (set from the run's config: `configure_dispatch`); while `routing_recorded` is active it
    keeps the dispatch counts of its forward."""

    num_experts: int
    top_k: int
    capacity_factor: float = 0.0
    recording: bool = False

    @property
    def forward_capacity_factor(self) -> float:
        """The capacity factor of this forward: `capacity_factor` while its dispatch counts are recorded (the train
        and eval steps), else 0 (dropless): a forward whose drops nobody counts (generation) drops nothing."""
        return self.capacity_factor if self.recording else 0.0

    def record_dispatch(self, counts: jax.Array | None) -> None:
        if self.recording and counts is not None:
            self.dispatch_counts = DispatchCounts(counts)


class LoadBalanced(RoutedBlock):
    """A routed-experts block whose family defines transformers' load-balancing loss: it calls `record` with its
    router logits, which keeps them while `routing_recorded` is active."""

    def record(self, logits: jax.Array) -> None:
        if self.recording:
            self.router_logits = RouterLogits(logits)


def configure_dispatch(model: nnx.Module, expert_axis: int, capacity_factor: float) -> None:
    """Sets `capacity_factor` on the model's routed-experts blocks; MeshError when `expert_axis` (mesh.expert) does
    not divide a block's experts: each device of the expert axis holds an equal share of them."""
    for _, block in nnx.iter_graph(model):
        if not isinstance(block, RoutedBlock):
            continue
        if block.num_experts % expert_axis:
            raise mesh_lib.MeshError(
                f"mesh.expert={expert_axis} does not divide the model's {block.num_experts} routed experts per "
                "layer: each device of the expert axis holds an equal share of them"
            )
        block.capacity_factor = capacity_factor


def use_adapter_kernel(model: nnx.Module, kernel: str) -> None:
    """Runs the adapters of the model's routed experts in `kernel` ("pallas" or "xla", see `grouped_matmul`) instead
    of `ragged_dot` ("xla"): the chip bench measures both on TPU."""
    if kernel not in ("pallas", "xla"):
        raise ValueError(f"grouped matmul kernel {kernel!r}: pallas or xla")
    for _, module in nnx.iter_graph(model):
        if isinstance(module, ExpertsLinear) and module.lora_scale is not None:
            module.adapter_kernel = kernel


def expert_axis_for(model: nnx.Module, devices: int, tokens_per_device: int, capacity_factor: float) -> int:
    """mesh.expert "auto": the largest number of `devices` that divides the experts of `model`'s routed-experts
    blocks, where per pass its all-to-alls send fewer bytes per device (two exchanges per block of
    `tokens_per_device` tokens' rows at `capacity_factor`, bf16) than gathering every expert's weights to every
    device sends (FSDP-style, bf16); 1 otherwise, and for a model without routed experts. Both grow with the
    passes alike, so the remat policy does not change the choice."""
    blocks = [module for _, module in nnx.iter_graph(model) if isinstance(module, RoutedBlock)]
    linears = [module for _, module in nnx.iter_graph(model) if isinstance(module, ExpertsLinear)]
    if not blocks or devices == 1:
        return 1
    group = max(d for d in range(1, devices + 1) if devices % d == 0 and blocks[0].num_experts % d == 0)
    if group == 1:
        return 1
    bf16 = 2
    gathered = sum(math.prod(linear.w.get_value().shape) * bf16 for linear in linears) * (1 - 1 / devices)
    width = blocks[0].experts["gate_up_proj"].w.get_value().shape[1]  # the model dimension: what a token sends
    slots = group * expert_capacity(tokens_per_device * blocks[0].top_k, group, capacity_factor)
    exchanged = len(blocks) * 2 * slots * width * bf16 * (1 - 1 / group)
    return group if exchanged < gathered else 1


@dataclasses.dataclass
class RecordedRouting:
    """What `routing_recorded` collected: one router-logits array [tokens, experts] per load-balanced block, the
    dispatch counts of each expert-parallel block."""

    logits: list[jax.Array] = dataclasses.field(default_factory=list)
    top_k: int = 0
    dispatch: list[jax.Array] = dataclasses.field(default_factory=list)

    def load_balancing_loss(self, token_mask: jax.Array) -> jax.Array:
        """`load_balancing_loss` of the recorded logits; 0 when nothing was recorded."""
        if not self.logits:
            return jnp.zeros((), jnp.float32)
        return load_balancing_loss(self.logits, self.top_k, token_mask)

    def dispatch_totals(self) -> jax.Array:
        """int32 [rows dropped, slots padded] summed over the blocks' forwards; zeros when none dispatched."""
        return sum((jnp.sum(c.reshape(-1, 2), axis=0) for c in self.dispatch), jnp.zeros(2, jnp.int32))


@contextlib.contextmanager
def routing_recorded(model: nnx.Module) -> Iterator[RecordedRouting]:
    """While active, the model's routed-experts blocks keep their router logits (`LoadBalanced` ones) and dispatch
    counts; on exit they are in the yielded record (nothing for a model without such blocks)."""
    blocks = [module for _, module in nnx.iter_graph(model) if isinstance(module, RoutedBlock)]
    balanced = [block for block in blocks if isinstance(block, LoadBalanced)]
    if len({block.top_k for block in balanced}) > 1:
        raise ValueError("MoE blocks with different top-k: one load-balancing loss does not cover them")
    recorded = RecordedRouting(top_k=balanced[0].top_k if balanced else 0)
    for block in blocks:
        block.recording = True
    try:
        yield recorded
    finally:
        for block in blocks:
            block.recording = False
            if isinstance(getattr(block, "router_logits", None), RouterLogits):
                logits = block.router_logits.get_value()
                # A scanned block (models/decoder.py) recorded one [tokens, experts] array per repeat.
                recorded.logits.extend(logits.reshape(-1, *logits.shape[-2:]))
                del block.router_logits
            if isinstance(getattr(block, "dispatch_counts", None), DispatchCounts):
                recorded.dispatch.append(block.dispatch_counts.get_value())
                del block.dispatch_counts


def aux_loss_coef(hf_config: dict) -> float:
    """The load-balancing loss's weight in transformers' training loss, from a config.json with its MoE
    convention (Mixtral, Qwen2/3 MoE): `router_aux_loss_coef` (default 0.001) when `output_router_logits`
    is true (default false, as in the Hub's Qwen3 MoE configs), else 0."""
    return float(hf_config.get("router_aux_loss_coef", 0.001)) if hf_config.get("output_router_logits") else 0.0


def load_balancing_loss(router_logits: list[jax.Array], top_k: int, token_mask: jax.Array) -> jax.Array:
    """transformers' `load_balancing_loss_func` (Switch Transformer eqs. 4-6) over every layer's router logits
    [N, E] at once: E * sum_e f_e * P_e, where f_e is the share of (layer, real token) pairs whose top-k
    holds expert e and P_e their mean softmax probability of e; `token_mask` [N] (or [B, L]) is 1 for real
    tokens (transformers' 2-D attention mask); 0 when there are none."""
    logits = jnp.stack(router_logits).astype(jnp.float32)  # [layers, N, E]
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, selected = jax.lax.top_k(probs, top_k)
    chosen = jnp.sum(jax.nn.one_hot(selected, num_experts, dtype=jnp.float32), axis=-2)  # [layers, N, E]
    mask = token_mask.reshape(1, -1, 1).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(mask) * logits.shape[0], 1.0)
    tokens_per_expert = jnp.sum(chosen * mask, axis=(0, 1)) / count
    prob_per_expert = jnp.sum(probs * mask, axis=(0, 1)) / count
    return num_experts * jnp.sum(tokens_per_expert * prob_per_expert)


def sort_by_expert(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order [N*k], group sizes [E]): `order` lists the (token, slot) pairs of `ids` [N, k] flattened,
    grouped by expert in expert order, as `ragged_dot` wants its rows."""
    flat = ids.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def mix_experts(
    tokens: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    gate_up: ExpertsLinear,
    down: ExpertsLinear,
    activation: Callable[[jax.Array], jax.Array],
    capacity_factor: float = 0.0,
) -> tuple[jax.Array, jax.Array | None]:
    """(each token's sum over its chosen experts `ids` [N, k] of weight · down(activation(gate) · up), as
    transformers' MoE blocks compute it: tokens [N, D] -> [N, D], only the chosen experts computing; the dispatch
    counts of `_mix_dispatched`, None where no tokens were dispatched).

    Under a traced step on a mesh whose devices divide the tokens, each device mixes its own tokens
    (`jax.shard_map`). Without an expert axis (mesh.expert = 1), with every expert's weights gathered to it, one
    layer at a time, as FSDP gathers a dense layer's: no device ever holds another device's tokens. Left to the
    partitioner, `ragged_dot` over tokens split across devices gathers every device's rows (tokens x experts per
    token) to each of them, and its temporaries grow with the global batch (qwen3-30b-a3b on v6e-16: 6.7 of its
    7.5 GB). With an expert axis, the tokens travel to the devices of that axis that hold their experts and back
    (`_mix_dispatched`, at `capacity_factor`): the experts' weights are gathered over the other axes only."""
    local = functools.partial(_mix_local, gate_up=gate_up, down=down, activation=activation)
    axes = _token_axes(tokens)
    if axes is None:
        return local(tokens, weights, ids, (gate_up.arrays(), down.arrays())), None
    mesh = jax.sharding.get_abstract_mesh()
    arrays = (gate_up.arrays(mesh), down.arrays(mesh))
    split = PartitionSpec(axes)
    group = mesh.shape.get(EXPERT_AXIS, 1)
    # check_vma off: the Pallas grouped matmul's outputs carry no varying-axes type (JAX cannot infer one).
    if group == 1:
        whole = PartitionSpec()
        mixed = jax.shard_map(
            local, in_specs=(split, split, split, jax.tree.map(lambda _: whole, arrays)), out_specs=split,
            check_vma=False,
        )
        return mixed(tokens, weights, ids, arrays), None
    capacity = expert_capacity(ids.size // mesh.size, group, capacity_factor)
    dispatched = functools.partial(
        _mix_dispatched, gate_up=gate_up, down=down, activation=activation, capacity=capacity, group=group, axes=axes
    )
    by_expert = PartitionSpec(EXPERT_AXIS)
    mixed = jax.shard_map(
        dispatched, in_specs=(split, split, split, jax.tree.map(lambda _: by_expert, arrays)),
        out_specs=(split, PartitionSpec()), check_vma=False,
    )
    return mixed(tokens, weights, ids, arrays)


def expert_capacity(rows: int, group: int, capacity_factor: float) -> int:
    """Rows one device sends each of the `group` devices of its expert axis at most, of its `rows` (token, expert)
    pairs: `capacity_factor` times an even share, rounded up so that the rows a device receives fill whole tiles
    of the Pallas grouped matmul; all of them (nothing dropped, whatever the routing) for 0 or where that is less."""
    if capacity_factor == 0:
        return rows
    tile = max(1, GROUPED_MATMUL_ROW_TILE // group)
    return min(rows, -(-math.ceil(capacity_factor * rows / group) // tile) * tile)


def _token_axes(tokens: jax.Array) -> tuple[str, ...] | None:
    """The mesh axes `mix_experts` splits `tokens` [N, D] over: every axis of the current mesh, while tracing
    on a mesh of more than one device whose size divides N; None (the unsplit computation) otherwise, e.g.
    eagerly, without a mesh, or for a decoding step's few rows."""
    mesh = jax.sharding.get_abstract_mesh()
    if not isinstance(tokens, jax.core.Tracer) or mesh.empty or mesh.size == 1 or tokens.shape[0] % mesh.size:
        return None
    return tuple(mesh.axis_names)


def _expert_rows(
    arrays: tuple[dict[str, jax.Array], dict[str, jax.Array]],
    rows: jax.Array,
    group_sizes: jax.Array,
    gate_up: ExpertsLinear,
    down: ExpertsLinear,
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """down(activation(gate) · up) of `rows` [M, D] sorted by expert (`group_sizes` rows each of `arrays`' experts)."""
    gate, up = jnp.split(gate_up.apply(arrays[0], rows, group_sizes), 2, axis=-1)
    return down.apply(arrays[1], activation(gate) * up, group_sizes)


def _mix_local(
    tokens: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    arrays: tuple[dict[str, jax.Array], dict[str, jax.Array]],
    *,
    gate_up: ExpertsLinear,
    down: ExpertsLinear,
    activation: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """`mix_experts` on tokens and expert weights all held here."""
    order, group_sizes = sort_by_expert(ids, gate_up.num_experts)
    token_of_row = order // ids.shape[-1]
    rows = _expert_rows(arrays, tokens[token_of_row], group_sizes, gate_up, down, activation)
    rows = rows * weights.reshape(-1)[order, None].astype(rows.dtype)
    return jnp.zeros_like(tokens, dtype=rows.dtype).at[token_of_row].add(rows)


def _mix_dispatched(
    tokens: jax.Array,
    weights: jax.Array,
    ids: jax.Array,
    arrays: tuple[dict[str, jax.Array], dict[str, jax.Array]],
    *,
    gate_up: ExpertsLinear,
    down: ExpertsLinear,
    activation: Callable[[jax.Array], jax.Array],
    capacity: int,
    group: int,
    axes: tuple[str, ...],
) -> tuple[jax.Array, jax.Array]:
    """`mix_experts` on this device's tokens with `arrays` holding its share of the experts (E / `group`, the
    expert axis' size; device d of the axis holds experts d·E/group onwards). Each (token, expert) row goes to the
    device of its expert in a block of `capacity` rows per device (an all-to-all over the expert axis); that device
    runs its experts' grouped matmuls on what it received, and a second all-to-all returns the results. Rows past a
    block's capacity are dropped (they add nothing to their token), in expert order. Returns the mixed tokens and
    int32 [rows dropped, slots padded] summed over every device (`axes`)."""
    local_experts = arrays[0]["w"].shape[0]
    num_rows, k = ids.size, ids.shape[-1]
    order = jnp.argsort(ids.reshape(-1), stable=True)
    expert = ids.reshape(-1)[order]
    device = expert // local_experts
    per_device = jnp.bincount(device, length=group)
    rank = jnp.arange(num_rows) - (jnp.cumsum(per_device) - per_device)[device]
    kept = rank < capacity
    slots = group * capacity
    slot = jnp.where(kept, device * capacity + rank, slots)  # past the end: dropped by the scatters
    token_of_row = order // k
    sent = jnp.zeros((slots, tokens.shape[-1]), tokens.dtype).at[slot].set(tokens[token_of_row], mode="drop")
    # Empty slots name expert `local_experts`, past the last: `sort_by_expert` puts them after every group.
    sent_expert = jnp.full((slots,), local_experts, jnp.int32).at[slot].set(expert % local_experts, mode="drop")
    received, received_expert = (_exchange(x, group) for x in (sent, sent_expert))
    local_order, group_sizes = sort_by_expert(received_expert[:, None], local_experts)
    computed = _expert_rows(arrays, received[local_order], group_sizes, gate_up, down, activation)
    returned = _exchange(jnp.zeros_like(computed).at[local_order].set(computed), group)
    row_weights = weights.reshape(-1)[order, None].astype(returned.dtype)
    # `where`, not a product: an empty slot's result is never read (the Pallas kernel leaves rows past its groups).
    rows = jnp.where(kept[:, None], returned[jnp.minimum(slot, slots - 1)] * row_weights, 0)
    mixed = jnp.zeros(tokens.shape, rows.dtype).at[token_of_row].add(rows)
    sent_rows = jnp.sum(kept, dtype=jnp.int32)
    return mixed, jax.lax.psum(jnp.stack([num_rows - sent_rows, slots - sent_rows]), axes)


def _exchange(x: jax.Array, group: int) -> jax.Array:
    """x [group * capacity, ...] whose block d goes to device d of the expert axis -> the blocks received, block s
    from device s."""
    blocks = x.reshape(group, x.shape[0] // group, *x.shape[1:])
    return jax.lax.all_to_all(blocks, EXPERT_AXIS, 0, 0).reshape(x.shape)


class ExpertsLinear(nnx.Module):
    """Per-expert linear maps `w` [E*parts, in, out]; the output of expert e is the concatenation over
    its `parts` matrices (see module docstring)."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        experts_per_token: int,
        parts: int = 1,
        sharding: tuple[str | tuple[str, ...] | None, str | None, str | None],
        dtype: jnp.dtype,
        param_dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        self.num_experts, self.parts, self.dtype = num_experts, parts, dtype
        self.experts_per_token = experts_per_token
        shape = (num_experts * parts, in_features, out_features)
        self.w = nnx.Param(initializers.normal()(rngs.params(), shape, param_dtype), sharding=sharding)
        self.sharding = sharding
        self.lora_scale: float | None = None
        self.adapter_kernel = "xla"
        """`grouped_matmul`'s kernel for the adapters (`use_adapter_kernel`)."""
        self.quantized_type: Any = None
        """QLoRA: `w` holds the quantised values of this type and `w_scale` one scale per matrix and output."""

    def quantize(self, qtype: Any, mesh: jax.sharding.Mesh) -> None:
        """Hold `w` quantised per matrix and output channel (QLoRA; `qtype` as Qwix names it), made by a jitted
        function in the shardings of `w` and its scales; each call dequantises it for its matmul."""
        weight = self.w.get_value()
        how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=(0, 2), tiled_axes={}, calibration_method="absmax")
        scale_axes = (self.sharding[0], None, self.sharding[2])
        scale_shape = (weight.shape[0], 1, weight.shape[2])
        shardings = (mesh_lib.named_sharding(mesh, self.sharding, weight.shape),
                     mesh_lib.named_sharding(mesh, scale_axes, scale_shape))

        def quantized(w: jax.Array) -> tuple[jax.Array, jax.Array]:
            q = qarray.quantize(w, how)
            return q.qvalue, q.scale

        qvalue, scale = jax.jit(quantized, out_shardings=shardings)(weight)
        self.w = nnx.Param(qvalue, sharding=self.sharding)
        self.w_scale = nnx.Param(scale, sharding=scale_axes)
        self.quantized_type = qtype

    def arrays(self, mesh: jax.sharding.AbstractMesh | None = None) -> dict[str, jax.Array]:
        """The values `apply` computes with: the weights as [E, in, parts * out] (still quantised, with their
        scales, when held so), the adapters. On `mesh` the reordering stays split over its devices as the
        weights are (left free, the partitioner reorders after gathering, in several full-size copies)."""
        weight = self.w.get_value()
        if weight.dtype == PACKED_DTYPE:
            weight = unpacked_rows(weight, self.sharding, mesh)
        arrays = {"w": self._by_expert(weight, mesh)}
        if self.quantized_type is not None:
            arrays["w_scale"] = self._by_expert(self.w_scale.get_value(), mesh)
        if self.lora_scale is not None:
            arrays.update(w_lora_a=self.w_lora_a.get_value(), w_lora_b=self.w_lora_b.get_value())
        return arrays

    def apply(self, arrays: dict[str, jax.Array], x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """x [M, in] sorted by expert (`group_sizes` [E] rows each) -> [M, parts * out], with `arrays` as
        `self.arrays()` gives them (or their gathered copies)."""
        w = arrays["w"]
        if self.quantized_type is not None:
            w = qarray.dequantize(qarray.QArray(w, arrays["w_scale"], None, self.quantized_type))
        x = x.astype(self.dtype)
        y = jax.lax.ragged_dot(x, w.astype(self.dtype), group_sizes)
        if self.lora_scale is not None:
            a, b = arrays["w_lora_a"].astype(self.dtype), arrays["w_lora_b"].astype(self.dtype)
            down = grouped_matmul(x, a, group_sizes, self.adapter_kernel)
            y = y + grouped_matmul(down, b, group_sizes, self.adapter_kernel) * self.lora_scale
        return y

    def _by_expert(self, held: jax.Array, mesh: jax.sharding.AbstractMesh | None) -> jax.Array:
        """[E*parts, rows, out] -> [E, rows, parts * out] (the weights, or their per-channel scales)."""
        _, rows, out = held.shape
        held = held.reshape(self.num_experts, self.parts, rows, out).transpose(0, 2, 1, 3)
        held = held.reshape(self.num_experts, rows, self.parts * out)
        if mesh is None:
            return held
        sharding = mesh_lib.named_sharding(mesh, (self.sharding[0], None, None), held.shape)
        return jax.lax.with_sharding_constraint(held, sharding)

    def add_lora(self, rank: int, alpha: float, rngs: nnx.Rngs) -> None:
        """One rank-`rank` adapter per expert: A random (He uniform, as Qwix), B zero, in `ragged_dot` (see
        `use_adapter_kernel`)."""
        _, d_in, d_out = self.w.get_value().shape
        expert_axis, in_axis, out_axis = self.sharding
        dtype = self.w.get_value().dtype
        if self.quantized_type is not None:
            raise ValueError("add the adapters before quantising the experts: they take the weights' dtype")
        a = initializers.he_uniform()(rngs.params(), (self.num_experts, d_in, rank), dtype)
        self.w_lora_a = nnx.LoRAParam(a, sharding=(expert_axis, in_axis, None))
        self.w_lora_b = nnx.LoRAParam(
            jnp.zeros((self.num_experts, rank, self.parts * d_out), dtype), sharding=(expert_axis, None, out_axis)
        )
        self.lora_scale = alpha / rank

    def lora_delta(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """A·B per expert in the layout of `w` [E*parts, in, out] (unscaled)."""
        delta = np.einsum("eir,ero->eio", a, b)
        experts, d_in, fused = delta.shape
        delta = delta.reshape(experts, d_in, self.parts, fused // self.parts).transpose(0, 2, 1, 3)
        return delta.reshape(experts * self.parts, d_in, fused // self.parts)


def active_shares(model: nnx.Module) -> dict[str, float]:
    """{dotted module path + ".": share of its experts one token uses} for the FLOPs model (metrics.py)."""
    return {
        ".".join(map(str, path)) + ".": module.experts_per_token / module.num_experts
        for path, module in nnx.iter_graph(model)
        if isinstance(module, ExpertsLinear)
    }


def to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our expert adapter (A [E, in, r], B [E, r, out]) -> PEFT's (lora_A [E*r, in], lora_B [out, r*E])."""
    experts, d_in, rank = a.shape
    lora_a = a.transpose(0, 2, 1).reshape(experts * rank, d_in)
    lora_b = b.transpose(2, 1, 0).reshape(b.shape[-1], rank * experts)
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def from_peft(lora_a: np.ndarray, lora_b: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `to_peft`."""
    rank = lora_a.shape[0] // num_experts
    a = lora_a.reshape(num_experts, rank, lora_a.shape[1]).transpose(0, 2, 1)
    b = lora_b.reshape(lora_b.shape[0], rank, num_experts).transpose(2, 1, 0)
    return np.ascontiguousarray(a), np.ascontiguousarray(b)
