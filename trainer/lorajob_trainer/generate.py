"""Greedy generation with the model the step trains: the same graphdef, adapters and base state, on the same mesh,
with a KV cache per layer (models/decoder.py).

The prompts are left-padded to one length P, so every row writes its next token's keys and values at the same cache
position; one forward over the prompts fills the caches (prefill), then each new token is one forward of one position
per row. Positions count each row's own tokens; the masks hide the padding. One jitted function runs the prefill and
every new token (`lax.scan`), so it compiles once per prompt length; a row that emitted a stop token is done (its
later tokens are computed and dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lorajob_trainer.mesh import BATCH_AXES, data_parallel_size


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    """The generated tokens, the stop token included when there was one."""
    stopped: bool
    """A stop token ended it before max_new_tokens."""


def greedy_tokens(make_model: Callable[[], nnx.Module], tokens: jax.Array, pads: jax.Array, max_new_tokens: int,
                  stop_ids: jax.Array, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(new tokens [B, max_new_tokens], how many of them each row generated, stopped) for prompts `tokens` [B, P]
    whose row b starts with `pads[b]` padding tokens. The model is made inside each step (`make_model`): Qwix's LoRA
    modules set attributes when called, which NNX allows only at the trace level the module was made at."""
    batch, prompt = tokens.shape
    size = prompt + max_new_tokens
    slots = jnp.arange(size)
    real = slots[None, :] >= pads[:, None]
    steps = jnp.arange(prompt)
    positions = jnp.maximum(steps[None, :] - pads[:, None], 0)
    mask = real[:, None, :] & (slots[None, None, :] <= steps[None, :, None])
    model = make_model()
    logits, caches = model(tokens, positions, model.init_caches(batch, size, dtype), mask)
    lengths = prompt - pads

    def step(carry, t):
        caches, chosen, stopped, counts, out = carry
        active = ~stopped
        out = out.at[:, t].set(chosen)
        counts = counts + active.astype(counts.dtype)
        stopped = stopped | (active & jnp.isin(chosen, stop_ids))
        # The next token's logits (after the last step they are not used).
        mask = (real & (slots[None, :] <= prompt + t))[:, None, :]
        logits, caches = make_model()(chosen[:, None], (lengths + t)[:, None], caches, mask)
        return (caches, jnp.argmax(logits, axis=-1).astype(tokens.dtype), stopped, counts, out), None

    start = (caches, jnp.argmax(logits, axis=-1).astype(tokens.dtype), jnp.zeros((batch,), bool),
             jnp.zeros((batch,), jnp.int32), jnp.zeros((batch, max_new_tokens), tokens.dtype))
    _, _, stopped, counts, out = jax.lax.scan(step, start, jnp.arange(max_new_tokens))[0]
    return out, counts, stopped


class Generator:
    """Greedy answers of the model `graphdef` with given adapters (LoraLayout's flat dict) and base state (as
    `base_layout` stores it: step.BaseLayout)."""

    def __init__(self, graphdef: nnx.GraphDef, layout, base_layout, dtype: jnp.dtype, mesh: Mesh, lora_shardings,
                 base_shardings, max_new_tokens: int, stop_ids: Sequence[int]):
        self.mesh = mesh
        self.max_new_tokens = max_new_tokens
        self.stop_ids = np.asarray(sorted(set(stop_ids)), np.int32)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES)) if set(BATCH_AXES) <= set(mesh.axis_names) else replicated

        def run(lora, base, tokens, pads, stop_ids):
            base = base_layout.for_model(base)
            adapters = layout.state({name: value.astype(dtype) for name, value in lora.items()})
            return greedy_tokens(lambda: nnx.merge(graphdef, adapters, base), tokens, pads, max_new_tokens, stop_ids, dtype)

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
        width = max(len(p) for p in prompts)
        results: list[Generation] = []
        for start in range(0, len(prompts), batch_rows):
            chunk = list(prompts[start : start + batch_rows])
            chunk += [chunk[0]] * (batch_rows - len(chunk))
            buffer = np.zeros((batch_rows, width), np.int32)
            pads = np.asarray([width - len(p) for p in chunk], np.int32)
            for row, prompt in enumerate(chunk):
                buffer[row, pads[row] :] = prompt
            tokens, counts, stopped = self._run(lora, base, self._global(buffer), self._global(pads), self.stop_ids)
            tokens, counts, stopped = np.asarray(tokens), np.asarray(counts), np.asarray(stopped)
            for row in range(min(batch_rows, len(prompts) - start)):
                results.append(Generation(tokens[row, : counts[row]].tolist(), bool(stopped[row])))
        return results

    def _global(self, host: np.ndarray) -> jax.Array:
        """`host` (the same on every process) as one array split over the mesh's rows."""
        return jax.make_array_from_callback(host.shape, self.rows, lambda index: host[index])
