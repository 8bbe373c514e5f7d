"""Model families and loading: `load_model` turns a base checkpoint into a sharded Tunix model.

Forward used for training (`forward`): tokens int32[B, L], positions int32[B, L] and segment ids
int32[B, L] -> float32 logits [B, L, vocab]. Segment ids number the packed sequences of a row
1, 2, ...; 0 marks padding. A token attends to earlier tokens of its own segment only (the
attention mask is built here, because Tunix's Llama 3 and Gemma 3 forwards take a dense mask and
no segment ids). Positions restart at 0 in each segment.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from lorajob_trainer import catalog, weights
from lorajob_trainer.models.families import FAMILIES, Family, ModelConfigError, TensorMap

__all__ = [
    "CheckpointFormat",
    "Family",
    "FAMILIES",
    "ModelConfigError",
    "ModelSpec",
    "TensorMap",
    "attention_mask",
    "detect_format",
    "family_for_hf_config",
    "forward",
    "load_model",
    "read_hf_config",
]

CheckpointFormat = Literal["hf", "orbax", "maxtext"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What was loaded: enough to export, convert, or rebuild the model."""

    family: Family
    hf_config: dict[str, Any]
    """The checkpoint's config.json as a dict."""
    tunix_config: Any
    """The Tunix ModelConfig built from `hf_config`."""
    checkpoint: Path
    """Absolute path of the base checkpoint."""
    format: CheckpointFormat
    tokenizer_path: Path | None
    """The checkpoint directory when it holds tokenizer files, else None."""
    dtype: Any

    def tensor_maps(self) -> list[TensorMap]:
        return self.family.tensor_maps(self.tunix_config)


def read_hf_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise weights.WeightsError(f"{directory} has no config.json")
    return json.loads(path.read_text())


def family_for_hf_config(hf_config: dict[str, Any]) -> Family:
    model_type = hf_config.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for family in FAMILIES.values() for t in family.hf_model_types)
    raise ModelConfigError(f"config.json model_type {model_type!r} is not supported (supported: {', '.join(known)})")


def detect_format(directory: Path) -> CheckpointFormat:
    if (directory / weights.BASE_MARKER).is_file():
        return "orbax"
    if any(directory.glob("*.safetensors")):
        return "hf"
    if (directory / "0" / "items").is_dir() or directory.name == "items":
        return "maxtext"
    raise weights.WeightsError(
        f"{directory} is neither an HF safetensors directory, a lorajob base checkpoint ({weights.BASE_MARKER}) "
        "nor a MaxText checkpoint (.../0/items)"
    )


def abstract_model(family: Family, tunix_config: Any, hf_config: dict[str, Any]) -> nnx.Module:
    """The model with shapes and sharding metadata only (nothing allocated)."""
    return nnx.eval_shape(lambda: family.build(tunix_config, hf_config, nnx.Rngs(0)))


def load_model(
    model_name: str,
    checkpoint: str | Path,
    *,
    mesh: Mesh,
    dtype: Any = jnp.bfloat16,
    format: CheckpointFormat | None = None,
) -> tuple[nnx.Module, ModelSpec]:
    """Load base weights into a Tunix model sharded over `mesh`; offline, from explicit files only.

    `checkpoint` is an HF directory (config.json + *.safetensors, sharded files fine) or our Orbax
    base checkpoint (see weights.py); `format` None detects it. MaxText checkpoints are detected
    but rejected (not implemented). The path is resolved to an absolute one first (Orbax requires
    it). The family comes from config.json and must agree with `model_name`'s family in the
    catalog. Parameters are created directly in their shardings; each process reads only the
    slices its devices hold.
    """
    directory = Path(checkpoint).resolve()
    if not directory.is_dir():
        raise weights.WeightsError(f"base checkpoint {directory} does not exist")
    format = format or detect_format(directory)
    if format == "maxtext":
        raise weights.WeightsError(
            f"{directory}: reading MaxText checkpoints is not implemented; convert the HF weights with "
            "`python -m lorajob_trainer.convert base` instead"
        )
    hf_config = read_hf_config(directory)
    family = family_for_hf_config(hf_config)
    expected = catalog.family_of(model_name)
    if family.name != expected:
        raise ModelConfigError(f"{directory} holds a {family.name} model but {model_name!r} is a {expected} model")
    tunix_config = family.config_from_hf(hf_config, dtype)
    graphdef, state = nnx.split(abstract_model(family, tunix_config, hf_config))
    if format == "hf":
        state = weights.load_safetensors_state(
            state, family.tensor_maps(tunix_config), directory, mesh=mesh, dtype=dtype
        )
    else:
        weights.read_base_marker(directory)
        state = weights.load_orbax_state(state, directory / "params", mesh=mesh, dtype=dtype)
    tokenizer = directory if any((directory / name).is_file() for name in TOKENIZER_FILES) else None
    spec = ModelSpec(family, hf_config, tunix_config, directory, format, tokenizer, dtype)
    return nnx.merge(graphdef, state), spec


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B, L, L]: causal, within the same segment, never to or from padding (segment 0)."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return causal[None] & same & real


def forward(model: nnx.Module, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """float32 logits [B, L, vocab] of a Tunix model of any supported family (see module docstring)."""
    logits, _ = model(tokens, positions, None, attention_mask(segment_ids))
    return logits.astype(jnp.float32)
