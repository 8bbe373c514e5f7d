"""Convert Hugging Face checkpoints into the trainer's formats.

    python -m lorajob_trainer.convert base --model-name NAME --hf SOURCE --out DIR [--dtype bfloat16]
    python -m lorajob_trainer.convert adapter --model-name NAME --base DIR --adapter SOURCE --out ROOT

`base` writes our Orbax base checkpoint (layout in weights.py) from an HF safetensors directory.
`adapter` turns an HF PEFT adapter (adapter_model.safetensors + adapter_config.json) into a
trainer LoRA checkpoint `ROOT/0` (layout in lora.py), usable as `lora.lora_restore_path` or by
export. Only the base's config.json is read for an adapter, not its weights.
A SOURCE is a local directory, a gs:// URI or a Hugging Face repo id (org/name, downloaded with
the HF_TOKEN environment variable); DIR and ROOT are local directories or gs:// URIs.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lorajob_trainer import loading, lora, models, stages, storage, weights
from lorajob_trainer.contract import catalog
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer.checkpoint import CheckpointMetadata
from lorajob_trainer.console import configure_logging

log = logging.getLogger("lorajob_trainer.convert")  # not __name__: run as __main__

# adapter_config.json options that change the adapter's meaning, with the only value we accept
# (an absent or empty value means the default too).
_UNSUPPORTED_PEFT_OPTIONS = {
    "bias": "none",
    "layers_to_transform": None,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "fan_in_fan_out": False,
}


class ConvertError(ValueError):
    """The input cannot be converted; the message says why."""


def convert_base(model_name: str, hf: str | Path, out: str | Path, *, dtype: Any = jnp.bfloat16) -> str | Path:
    """HF safetensors source -> our Orbax base checkpoint at `out` (returned; a URI stays a string)."""
    out = out if storage.is_remote(out) else Path(out).resolve()
    if storage.exists(storage.join(out, "params")):
        raise ConvertError(f"{out} already holds a base checkpoint")
    with (
        stages.stage(log, f"converting {model_name} from {hf} to {out}"),
        storage.local_input(hf, patterns=storage.MODEL_FILES, hub=True) as hf_dir,
        storage.local_output(out) as local_out,
    ):
        _write_base(model_name, hf_dir, local_out, dtype)
    return out


def _write_base(model_name: str, hf_dir: Path, out: Path, dtype: Any) -> None:
    with stages.stage(log, f"loading the safetensors of {hf_dir}"):
        model, spec = loading.load_model(model_name, hf_dir, mesh=mesh_lib.host_mesh(), dtype=dtype, format="hf")
    out.mkdir(parents=True, exist_ok=True)
    params = {weights.path_key(path): v.get_value() for path, v in nnx.to_flat_state(nnx.state(model))}
    gib = sum(value.nbytes for value in params.values()) / 2**30
    with stages.stage(log, f"writing {len(params)} arrays ({gib:.2f} GiB) to {out / 'params'}"):
        weights.save_orbax_params(out / "params", params)
    for name in (*loading.TOKENIZER_FILES, "generation_config.json", "config.json"):
        if (spec.checkpoint / name).is_file():
            shutil.copy2(spec.checkpoint / name, out / name)
    marker = {"format": weights.BASE_FORMAT, "family": spec.family.name, "dtype": jnp.dtype(dtype).name}
    (out / weights.BASE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def read_peft_adapter(adapter_dir: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    config_path, tensors_path = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for path in (config_path, tensors_path):
        if not path.is_file():
            raise ConvertError(f"{adapter_dir} is not a PEFT adapter: {path.name} is missing")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ConvertError(f"peft_type {config['peft_type']!r} is not LORA")
    for key, supported in _UNSUPPORTED_PEFT_OPTIONS.items():
        if config.get(key) and config[key] != supported:
            raise ConvertError(f"adapter_config.json sets {key}={config[key]!r}; only {supported!r} is supported")
    modules = config.get("target_modules")
    if not isinstance(modules, (list, str)) or modules == "all-linear":
        raise ConvertError(
            f"adapter_config.json target_modules={modules!r}: only an explicit list or a regex over module names "
            "is supported"
        )
    return config, load_file(tensors_path)


def lora_template(family: models.Family, tunix_config: Any, hf_config: dict, rank: int, regex: str,
                  dora: bool = False) -> dict[str, Any]:
    """Shapes of the LoRA params Qwix creates for this model, without loading any weights."""
    mesh = mesh_lib.host_mesh(jax.devices()[:1])

    def build() -> nnx.Module:
        model = family.build(tunix_config, hf_config, models.tracing_rngs())
        return lora.apply_lora(model, rank=rank, alpha=float(rank), target_regex=regex, mesh=mesh,
                               rngs=models.tracing_rngs(), dora=dora)

    return lora.get_lora_params(nnx.eval_shape(build))


def convert_adapter(model_name: str, base: str | Path, adapter: str | Path, out: str | Path) -> str | Path:
    """HF PEFT adapter -> trainer LoRA checkpoint step `out/0`; returns the step directory."""
    base = base if storage.is_remote(base) else Path(base).resolve()
    with (
        stages.stage(log, f"converting the adapter {adapter} to {out}"),
        storage.local_input(adapter, patterns=storage.ADAPTER_FILES, hub=True) as adapter_dir,
        storage.local_input(base, patterns=("config.json",)) as base_dir,
        storage.local_output(out) as local_out,
    ):
        step_dir = _write_adapter(model_name, base, base_dir, adapter_dir.resolve(), local_out)
    return storage.join(out, step_dir.name) if storage.is_remote(out) else step_dir


def _write_adapter(model_name: str, base: str | Path, base_dir: Path, adapter: Path, out: Path) -> Path:
    """`base` is recorded in the checkpoint metadata; only `base_dir`/config.json is read."""
    config, tensors = read_peft_adapter(adapter)
    hf_config = loading.read_hf_config(base_dir)
    family = loading.family_of_checkpoint(model_name, hf_config, base)
    tunix_config = family.config_from_hf(hf_config, jnp.float32)
    rank = int(config["r"])
    modules = config["target_modules"]
    if isinstance(modules, str):  # a regex, as PEFT's own default for Gemma 4 is
        modules = lora.names_for_peft_regex(family.name, modules, tunix_config.num_layers, hf_config)
        if not modules:
            raise ConvertError(f"adapter_config.json target_modules={config['target_modules']!r} selects no projection")
    names = list(modules) + list(config.get("target_parameters") or [])
    tensors = lora.peft_names_from_base(tensors, hf_config)
    targets = lora.target_modules(family.name, names)
    dora = bool(config.get("use_dora"))
    template = lora_template(family, tunix_config, hf_config, rank, lora.target_regex(family.name, names), dora)
    params = lora.from_peft(tensors, targets, template)
    metadata = CheckpointMetadata(
        step=0,
        lora_rank=rank,
        lora_alpha=float(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora")),
        use_dora=dora,
        target_modules=names,
        lora_module_path="",
        base_model=model_name,
        family=family.name,
        load_parameters_path=str(base),
    )
    return lora.save_adapter_checkpoint(out, params, metadata)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    base = sub.add_parser("base", help="HF safetensors -> Orbax base checkpoint")
    base.add_argument("--model-name", required=True, choices=sorted(catalog.MODELS))
    base.add_argument("--hf", required=True, help="HF model directory, gs:// URI or Hub repo id")
    base.add_argument("--out", required=True, help="directory or gs:// URI")
    base.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    adapter = sub.add_parser("adapter", help="HF PEFT adapter -> trainer LoRA checkpoint")
    adapter.add_argument("--model-name", required=True, choices=sorted(catalog.MODELS))
    adapter.add_argument("--base", required=True, help="base checkpoint directory or gs:// URI (its config.json)")
    adapter.add_argument("--adapter", required=True, help="PEFT adapter directory, gs:// URI or Hub repo id")
    adapter.add_argument("--out", required=True, help="checkpoint root directory or gs:// URI")
    args = parser.parse_args(argv)
    configure_logging()
    try:
        if args.command == "base":
            print(convert_base(args.model_name, args.hf, args.out, dtype=jnp.dtype(args.dtype)))
        else:
            print(convert_adapter(args.model_name, args.base, args.adapter, args.out))
    except ValueError as error:  # WeightsError, LoraError, ModelConfigError, ConvertError, StorageError
        raise SystemExit(f"convert failed: {error}") from error


if __name__ == "__main__":
    main()
