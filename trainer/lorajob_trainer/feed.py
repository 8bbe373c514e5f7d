"""The data feeds on the mesh: each process's rows of the packed batches (data.py), as global arrays of the
shape the step takes (`run.batch_spec`): shuffled and prefetched for training, in order and padded for evaluation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from lorajob_trainer import data as data_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer.contract.config import TrainConfig
from lorajob_trainer.step import Batch


PREFETCH_BATCHES = 2
"""Training batches prepared ahead of the device step (evaluation reads synchronously)."""


@dataclass
class DataFeed:
    """This process's rows of `[accumulation, global_batch, seq_len]` batches, as global arrays."""

    packer: data_lib.PackedRows | data_lib.PairedRows | data_lib.PrefetchedRows
    sharding: NamedSharding
    """Rows split over the mesh's batch axes: of the batch's arrays and of the packer's positions alike."""
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
        return jax.make_array_from_process_local_data(self.sharding, local, self.global_shape[:2])

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
    pairs: bool = False,
) -> DataFeed:
    """`prefetch` > 0: that many batches are prepared ahead by a background thread; `pairs`: the rows hold
    preference pairs (data.PairedRows)."""
    global_shape = (accumulation, rows_per_micro_batch, options.seq_len)
    sharding = mesh_lib.batch_sharding(mesh, leading_dims=1)
    local_rows = mesh_lib.local_batch_rows(sharding, global_shape, batch_dim=1)
    row_ids = [a * rows_per_micro_batch + row for a in range(accumulation) for row in local_rows]
    rows_type = data_lib.PairedRows if pairs else data_lib.PackedRows
    packer = rows_type(len(dataset), encode, row_ids, accumulation * rows_per_micro_batch, options)
    if prefetch:
        packer = data_lib.PrefetchedRows(packer, depth=prefetch)
    return DataFeed(packer, sharding, global_shape, local_rows)


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
    rows_per_micro_batch = mesh_lib.global_batch_rows(config.rows_per_device, mesh)
    return make_feed(dataset, encode, mesh, accumulation, rows_per_micro_batch, options, prefetch,
                     pairs=config.preference_method)
