"""Setting up a run, before its first step: the model with its LoRA adapters loaded and sharded, the FLOPs
model, the data feeds on the mesh and the checkpointer. train.Trainer runs the loop over what this builds."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from lorajob_trainer import checkpoint as ckpt
from lorajob_trainer import data as data_lib
from lorajob_trainer import distributed
from lorajob_trainer import lora as lora_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import metrics as metrics_lib
from lorajob_trainer import loading
from lorajob_trainer.contract.config import TrainConfig, resolve_target_modules
from lorajob_trainer.models import experts
from lorajob_trainer.step import Batch, LoraLayout

log = logging.getLogger("lorajob_trainer.train")


PREFETCH_BATCHES = 2
"""Training batches prepared ahead of the device step (evaluation reads synchronously)."""


@dataclass
class LoraModel:
    """A base model with LoRA adapters applied, its arrays placed on the mesh."""

    model: nnx.Module
    target_modules: list[str] | None
    attention_width: int
    """Sum over layers of query heads * head_dim (for the FLOPs model)."""
    active: dict[str, float] = field(default_factory=dict)
    """Routed experts' module paths (with a trailing ".") -> share a token uses (for the FLOPs model)."""
    aux_loss_coef: float | None = None
    """Weight of the MoE load-balancing loss in the training loss; None: the model has none."""
    layer_period: int | None = None
    """The family's layer period (Family.layer_period): the step scans over its repeats; None: unrolled."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's config.json (remat auto compiles the step from it: plan.choose_remat)."""


def compute_dtype(config: TrainConfig, platform: str | None = None) -> jnp.dtype:
    """The dtype of the base weights and activations; "auto": float32 on CPU, else bfloat16. `platform`: the
    devices the step is for (default: JAX's default backend)."""
    if config.dtype == "auto":
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    return jnp.dtype(config.dtype)


def load_lora_model(config: TrainConfig, mesh: Mesh, dtype: jnp.dtype) -> LoraModel:
    """Load the base weights (sharded over `mesh`) and apply the configured LoRA adapters.

    A MaxText base takes its config.json from the tokenizer directory (see loading.load_model)."""
    model, spec = loading.load_model(
        config.model_name, config.load_parameters_path, mesh=mesh, dtype=dtype, config_dir=config.tokenizer_directory
    )
    family = spec.family.name
    targets = resolve_target_modules(config, lora_lib.default_targets(family))
    regex = lora_lib.target_regex(family, targets, config.lora.lora_module_path)
    if targets is None:
        targets = lora_lib.names_for_regex(family, regex, spec.tunix_config.num_layers) or None
    model = lora_lib.apply_lora(
        model, rank=config.lora.lora_rank, alpha=config.lora.lora_alpha, target_regex=regex, mesh=mesh,
        rngs=nnx.Rngs(config.seed), rslora=config.lora.use_rslora, dora=config.lora.use_dora,
        base_quantization=config.lora.base_quantization,
    )
    return LoraModel(
        model, targets, attention_width(spec.tunix_config), experts.active_shares(model),
        aux_loss_coef(config.router_aux_loss_coef, spec.hf_config, model),
        spec.family.layer_period(spec.tunix_config), spec.hf_config,
    )


def aux_loss_coef(override: float | None, hf_config: dict[str, Any], model: nnx.Module) -> float | None:
    """`override` (config key router_aux_loss_coef), else the checkpoint's (experts.aux_loss_coef); None for a
    model without load-balanced MoE blocks."""
    if not any(isinstance(module, experts.LoadBalanced) for _, module in nnx.iter_graph(model)):
        return None
    return experts.aux_loss_coef(hf_config) if override is None else override


def attention_width(tunix_config: Any) -> int:
    """Sum over layers of query heads * head_dim, from a Tunix ModelConfig."""
    return tunix_config.num_layers * tunix_config.num_heads * tunix_config.head_dim


def model_flops(
    model: nnx.Module, attention_width_sum: int, seq_len: int, active: dict[str, float] | None = None
) -> metrics_lib.LoraFlops:
    """`lora_flops` of a model whose layers are not stacked yet (its paths are the ones `active` names)."""
    _, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    return lora_flops(base, LoraLayout(lora).flat(lora), attention_width_sum, seq_len, active)


def lora_flops(
    base: nnx.State,
    lora: dict[str, jax.Array],
    attention_width_sum: int,
    seq_len: int,
    active: dict[str, float] | None = None,
) -> metrics_lib.LoraFlops:
    """The FLOPs model's counts; `active` as `LoraModel.active` (None: no routed experts)."""
    shapes = _shapes(base)
    return metrics_lib.LoraFlops(
        frozen_matmul_params=metrics_lib.frozen_matmul_params(shapes, active),
        head_params=metrics_lib.output_head_params(shapes),
        attention_width=attention_width_sum,
        adapter_params=round(sum(x.size * metrics_lib.active_share(name, active) for name, x in lora.items())),
        seq_len=seq_len,
    )


def _shapes(state: nnx.State) -> dict[str, tuple[int, ...]]:
    return {
        "/".join(str(part) for part in path): tuple(value.shape)
        for path, value in state.flat_state()
    }


@dataclass
class DataFeed:
    """This process's rows of `[accumulation, global_batch, seq_len]` batches, as global arrays."""

    packer: data_lib.PackedRows | data_lib.PrefetchedRows
    sharding: NamedSharding
    position_sharding: NamedSharding
    global_shape: tuple[int, int, int]
    local_rows: range

    @property
    def local_shape(self) -> tuple[int, int, int]:
        return (self.global_shape[0], len(self.local_rows), self.global_shape[2])

    def next_batch(self, step: int) -> Batch:
        rows = self.packer.next_rows(step)
        return {
            name: jax.make_array_from_process_local_data(self.sharding, values.reshape(self.local_shape), self.global_shape)
            for name, values in rows.items()
        }

    def positions(self) -> jax.Array:
        local = self.packer.state().astype(np.int32).reshape(self.local_shape[:2])
        return jax.make_array_from_process_local_data(self.position_sharding, local, self.global_shape[:2])

    def restore(self, positions: jax.Array) -> None:
        local = np.zeros(self.local_shape[:2], dtype=np.int64)
        for shard in positions.addressable_shards:
            rows = shard.index[1]
            start = (rows.start or 0) - self.local_rows.start
            local[:, start : start + shard.data.shape[1]] = np.asarray(shard.data)
        self.packer.restore(local.reshape(-1))

    def close(self) -> None:
        if isinstance(self.packer, data_lib.PrefetchedRows):
            self.packer.close()


def make_feed(
    dataset,
    encode,
    mesh: Mesh,
    accumulation: int,
    rows_per_micro_batch: int,
    options: data_lib.PackingOptions,
    prefetch: int = 0,
) -> DataFeed:
    """`prefetch` > 0: that many batches are prepared ahead by a background thread."""
    global_shape = (accumulation, rows_per_micro_batch, options.seq_len)
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    local_rows = mesh_lib.local_batch_rows(sharding, global_shape, batch_dim=1)
    row_ids = [a * rows_per_micro_batch + row for a in range(accumulation) for row in local_rows]
    packer = data_lib.PackedRows(len(dataset), encode, row_ids, accumulation * rows_per_micro_batch, options)
    if prefetch:
        packer = data_lib.PrefetchedRows(packer, depth=prefetch)
    return DataFeed(packer, sharding, mesh_lib.batch_sharding(mesh, leading_dims=1), global_shape, local_rows)


def load_split(config: TrainConfig, source: data_lib.DataSource, tokenizer: Any) -> tuple[Any, Callable[[int], data_lib.EncodedExample]]:
    """(the dataset split, its encoder to token ids) of one data source."""
    columns = config.train_data_columns
    dataset = data_lib.load_dataset_split(source, columns)
    return dataset, data_lib.make_encoder(dataset, tokenizer, columns)


def data_feed(config: TrainConfig, mesh: Mesh, loaded, accumulation: int, on_end: data_lib.OnDataEnd) -> DataFeed:
    """The packed batches of a loaded split: shuffled and prefetched for training, in order when padded (evaluation)."""
    dataset, encode = loaded
    training = on_end != "pad"
    options = data_lib.PackingOptions(
        seq_len=config.max_target_length,
        packing=config.packing,
        shuffle=config.shuffle and training,
        seed=config.data_shuffle_seed,
        on_end=on_end,
    )
    prefetch = PREFETCH_BATCHES if training else 0
    rows_per_micro_batch = mesh_lib.global_batch_rows(config.per_device_batch_size, mesh)
    return make_feed(dataset, encode, mesh, accumulation, rows_per_micro_batch, options, prefetch)


def checkpointer(config: TrainConfig) -> ckpt.Checkpointer | None:
    """The run's checkpointer (None with checkpointing off)."""
    if not config.enable_checkpointing:
        return None
    pathways = distributed.is_pathways()
    if pathways and (config.checkpoint_storage_use_ocdbt or config.checkpoint_storage_use_zarr3):
        log.warning("Pathways: writing checkpoints without OCDBT/zarr3 (its array handler cannot read them)")
    options = ckpt.StorageOptions(
        use_zarr3=config.checkpoint_storage_use_zarr3 and not pathways,
        use_ocdbt=config.checkpoint_storage_use_ocdbt and not pathways,
        asynchronous=config.async_checkpointing,
        max_to_keep=config.max_num_checkpoints_to_keep,
    )
    return ckpt.Checkpointer(config.checkpoint_directory, options)
