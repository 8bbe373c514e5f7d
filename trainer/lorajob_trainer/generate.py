"""Greedy generation with the model the step trains: the same graphdef, adapters and base state, on the same mesh.

Prompts are right-padded into one `[batch, prompt + max_new_tokens]` buffer; each new token comes from a forward
over the whole buffer, read at each row's own last position (causal attention makes the padding after it
irrelevant), and is written after it. Rows that emitted a stop token keep their length. One jitted function runs
every new token (`lax.scan`), so it compiles once per buffer shape. There is no KV cache yet: each token costs a
forward over the buffer (see docs/user-guide.md, "Evaluation").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lorajob_trainer import models
from lorajob_trainer.mesh import BATCH_AXES, data_parallel_size


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    """The generated tokens, the stop token included when there was one."""
    stopped: bool
    """A stop token ended it before max_new_tokens."""


def greedy_tokens(make_model: Callable[[], nnx.Module], tokens: jax.Array, lengths: jax.Array, max_new_tokens: int,
                  stop_ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(buffer, lengths, stopped) after `max_new_tokens` greedy steps over `tokens` [B, T] whose row b holds its
    prompt in the first `lengths[b]` places (T >= max(lengths) + max_new_tokens). The model is made inside each
    step (`make_model`): Qwix's LoRA modules set attributes when called, which NNX allows only at the trace level
    the module was made at."""
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    mask = models.attention_mask(jnp.ones((batch, width), jnp.int32))
    rows = jnp.arange(batch)

    def step(carry, _):
        tokens, lengths, stopped = carry
        model = make_model()
        hidden, _ = model(tokens, positions, None, mask, hidden=True)
        logits = model.logits(hidden[rows, lengths - 1][:, None])[:, 0]
        chosen = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
        active = ~stopped
        tokens = tokens.at[rows, lengths].set(jnp.where(active, chosen, tokens[rows, lengths]))
        stopped = stopped | (active & jnp.isin(chosen, stop_ids))
        return (tokens, lengths + active.astype(lengths.dtype), stopped), None

    start = (tokens, lengths, jnp.zeros((batch,), bool))
    return jax.lax.scan(step, start, None, length=max_new_tokens)[0]


class Generator:
    """Greedy answers of the model `graphdef` with given adapters (LoraLayout's flat dict) and base state."""

    def __init__(self, graphdef: nnx.GraphDef, layout, dtype: jnp.dtype, mesh: Mesh, lora_shardings, base_shardings,
                 max_new_tokens: int, stop_ids: Sequence[int]):
        self.mesh = mesh
        self.max_new_tokens = max_new_tokens
        self.stop_ids = np.asarray(sorted(set(stop_ids)), np.int32)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES)) if set(BATCH_AXES) <= set(mesh.axis_names) else replicated

        def run(lora, base, tokens, lengths, stop_ids):
            adapters = layout.state({name: value.astype(dtype) for name, value in lora.items()})
            return greedy_tokens(lambda: nnx.merge(graphdef, adapters, base), tokens, lengths, max_new_tokens, stop_ids)

        self._run: Callable = jax.jit(
            run, in_shardings=(lora_shardings, base_shardings, self.rows, self.rows, replicated),
            out_shardings=replicated,
        )

    def batch_rows(self, wanted: int) -> int:
        """A batch size of at least `wanted` that the data-parallel axes divide."""
        parallel = data_parallel_size(self.mesh) if self.rows.spec else 1
        return -(-max(wanted, 1) // parallel) * parallel

    def generate(self, lora, base, prompts: Sequence[Sequence[int]], batch_rows: int) -> list[Generation]:
        """Each prompt's greedy generation, `batch_rows` prompts at a time (the last batch padded with copies of
        its first prompt). Every process passes the same prompts."""
        width = max(len(p) for p in prompts) + self.max_new_tokens
        results: list[Generation] = []
        for start in range(0, len(prompts), batch_rows):
            chunk = list(prompts[start : start + batch_rows])
            chunk += [chunk[0]] * (batch_rows - len(chunk))
            buffer = np.zeros((batch_rows, width), np.int32)
            lengths = np.asarray([len(p) for p in chunk], np.int32)
            for row, prompt in enumerate(chunk):
                buffer[row, : len(prompt)] = prompt
            tokens, ends, stopped = self._run(lora, base, self._global(buffer), self._global(lengths), self.stop_ids)
            tokens, ends, stopped = np.asarray(tokens), np.asarray(ends), np.asarray(stopped)
            for row in range(min(batch_rows, len(prompts) - start)):
                results.append(Generation(tokens[row, lengths[row] : ends[row]].tolist(), bool(stopped[row])))
        return results

    def _global(self, host: np.ndarray) -> jax.Array:
        """`host` (the same on every process) as one array split over the mesh's rows."""
        return jax.make_array_from_callback(host.shape, self.rows, lambda index: host[index])
