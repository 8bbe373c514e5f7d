"""Model loading: `load_model` turns a base checkpoint (Hugging Face safetensors, our Orbax base or a MaxText
checkpoint) into a sharded Tunix model of one of the families of lorajob_trainer.models. It sits above the
families, weights.py and maxtext.py, which import none of it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from lorajob_trainer import maxtext, storage, weights
from lorajob_trainer.contract import catalog
from lorajob_trainer.models import Family, ModelConfigError, TensorMap, abstract_model, family_for_hf_config

CheckpointFormat = Literal["hf", "orbax", "maxtext"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json")
CONFIG_FILES = tuple(pattern for pattern in storage.MODEL_FILES if "safetensors" not in pattern)
"""What a tokenizer / config directory is fetched for: the model files other than weights."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What was loaded: enough to export, convert, or rebuild the model."""

    family: Family
    hf_config: dict[str, Any]
    """The checkpoint's config.json as a dict."""
    tunix_config: Any
    """The Tunix ModelConfig built from `hf_config`."""
    checkpoint: Path | epath.Path
    """The base checkpoint: an absolute local path, or a gs:// URI (MaxText: its `.../0/items`)."""
    format: CheckpointFormat
    tokenizer_path: Path | epath.Path | None
    """`config_source` when it holds tokenizer files, else None."""
    dtype: Any
    config_source: Path | epath.Path
    """The directory config.json was read from: the checkpoint, or for MaxText the config directory."""

    def tensor_maps(self) -> list[TensorMap]:
        return self.family.tensor_maps(self.tunix_config)


def read_hf_config(directory: Path | epath.Path) -> dict[str, Any]:
    path = epath.Path(directory) / "config.json"
    if not path.is_file():
        raise weights.WeightsError(f"{directory} has no config.json")
    return json.loads(path.read_text())


@functools.cache
def local_config_directory(location: str) -> Path:
    """`location` (a local directory, gs:// URI or Hugging Face repo id) as a local directory with its
    config.json and tokenizer files, fetched once per process (a gs:// copy lives until exit)."""
    stack = contextlib.ExitStack()
    try:
        directory = stack.enter_context(storage.local_input(location, hub=True, patterns=CONFIG_FILES))
    except storage.StorageError as error:
        raise weights.WeightsError(f"tokenizer/config directory: {error}") from error
    atexit.register(stack.close)
    return directory


def family_of_checkpoint(model_name: str, hf_config: dict, source: object) -> Family:
    """The model family of a checkpoint's config.json, which must be the family `model_name` names."""
    family = family_for_hf_config(hf_config)
    expected = catalog.family_of(model_name)
    if family.name != expected:
        raise ModelConfigError(f"{source} holds a {family.name} model but {model_name!r} is a {expected} model")
    return family


def detect_format(directory: Path | epath.Path) -> CheckpointFormat:
    directory = epath.Path(directory)
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


def load_model(
    model_name: str,
    checkpoint: str | Path,
    *,
    mesh: Mesh,
    dtype: Any = jnp.bfloat16,
    format: CheckpointFormat | None = None,
    config_dir: str | Path | None = None,
) -> tuple[nnx.Module, ModelSpec]:
    """Load base weights into a Tunix model sharded over `mesh`; offline, from explicit files only.

    `checkpoint` is an HF directory (config.json + *.safetensors, sharded files fine), our Orbax
    base checkpoint (see weights.py) or a MaxText checkpoint (`<dir>` holding `0/items`, or the
    `.../0/items` itself; scanned or unscanned, see maxtext.py); `format` None detects it. The
    Orbax formats (ours, MaxText) are read in place from a local path or a gs:// URI; HF
    safetensors must be local (convert a gs:// HF model first: `python -m lorajob_trainer.convert
    base`). A MaxText checkpoint carries no config.json: it comes from `config_dir` (a local
    directory, gs:// URI or Hub repo id, resolved by `local_config_directory`; the trainer passes
    tokenizer_path). The family comes from config.json and must agree with `model_name`'s family in
    the catalog. Parameters are created directly in their shardings; each process reads only the
    slices its devices hold.
    """
    location, format, config_source = _sources(checkpoint, format, config_dir)
    hf_config = read_hf_config(config_source)
    family = family_of_checkpoint(model_name, hf_config, config_source)
    tunix_config = family.config_from_hf(hf_config, dtype)
    graphdef, state = nnx.split(abstract_model(family, tunix_config, hf_config))
    if format == "hf":
        state = weights.load_safetensors_state(
            state, family.tensor_maps(tunix_config), location, mesh=mesh, dtype=dtype
        )
    elif format == "maxtext":
        state = maxtext.load_state(state, family.name, tunix_config, str(location), mesh=mesh, dtype=dtype)
    else:
        weights.read_base_marker(location)
        state = weights.load_orbax_state(state, location / "params", mesh=mesh, dtype=dtype)
    has_tokenizer = any((config_source / name).is_file() for name in TOKENIZER_FILES)
    spec = ModelSpec(
        family=family,
        hf_config=hf_config,
        tunix_config=tunix_config,
        checkpoint=location,
        format=format,
        tokenizer_path=config_source if has_tokenizer else None,
        dtype=dtype,
        config_source=config_source,
    )
    return nnx.merge(graphdef, state), spec


def checkpoint_hf_config(checkpoint: str | Path, config_dir: str | Path | None = None) -> dict[str, Any]:
    """The config.json of the checkpoint `load_model` would load (`config_dir`: as there), without its weights."""
    return read_hf_config(_sources(checkpoint, None, config_dir)[2])


def _sources(
    checkpoint: str | Path, format: CheckpointFormat | None, config_dir: str | Path | None
) -> tuple[Path | epath.Path, CheckpointFormat, Path | epath.Path]:
    """(where the weights are, their format, where config.json is) of a checkpoint, as `load_model` reads it."""
    location = _checkpoint_location(checkpoint)
    format = format or detect_format(location)
    if format == "hf" and storage.is_remote(str(location)):
        raise weights.WeightsError(
            f"{location} is a Hugging Face safetensors directory on gs://, which the trainer does not read in "
            "place; convert it first (`python -m lorajob_trainer.convert base --hf URI --out URI`) or copy it locally"
        )
    if format == "maxtext":
        location = _maxtext_items(location)
        return location, format, _maxtext_config_source(location, config_dir)
    return location, format, location


def _checkpoint_location(checkpoint: str | Path) -> Path | epath.Path:
    """A gs:// URI as an epath, a local path made absolute (Orbax requires it); WeightsError if missing."""
    location = epath.Path(checkpoint) if storage.is_remote(str(checkpoint)) else Path(checkpoint).resolve()
    if not location.is_dir():
        raise weights.WeightsError(f"base checkpoint {checkpoint} does not exist")
    return location


def _maxtext_items(location: Path | epath.Path) -> Path | epath.Path:
    """The `0/items` directory of a MaxText checkpoint given as its root or as the items directory."""
    return location / "0" / "items" if (location / "0" / "items").is_dir() else location


def _maxtext_config_source(location: Path | epath.Path, config_dir: str | Path | None) -> Path:
    """Where a MaxText base's config.json is; WeightsError saying what to set when there is none."""
    hint = (
        "set tokenizer_path (export: --base-config) to the model's Hugging Face directory or repo id, "
        "which holds config.json next to the tokenizer"
    )
    if not config_dir:
        raise weights.WeightsError(f"{location} is a MaxText checkpoint, which carries no config.json; {hint}")
    directory = local_config_directory(str(config_dir))
    if not (directory / "config.json").is_file():
        raise weights.WeightsError(
            f"{location} is a MaxText checkpoint, which carries no config.json, and the tokenizer/config directory "
            f"{config_dir} has none either (looked for {directory / 'config.json'}); {hint}"
        )
    return directory
