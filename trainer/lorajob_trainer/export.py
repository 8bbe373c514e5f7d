"""Export a trainer LoRA checkpoint as a Hugging Face PEFT adapter, optionally also merged weights.

    python -m lorajob_trainer.export --checkpoint CKPT --out DIR [--merged [--base BASE] [--base-config CFG]]
        [--hub-repo ORG/NAME] [--require-improvement] [--minimum-score S] [--minimum-stop-rate R] [--evaluation EVAL]
        [--tracking-record RUN/tracking.json tracking.KEY=VALUE...]

CKPT is a step directory (`.../checkpoints/<step>`) or a checkpoint root (its latest step is
used); the checkpoint metadata supplies rank, alpha, target modules, family and base model.
DIR receives `adapter_model.safetensors` + `adapter_config.json` (loadable with
`peft.PeftModel.from_pretrained`), and with `--merged` a `merged/` HF model directory
(config.json, safetensors, tokenizer files) whose weights hold W + (alpha/r)·B·A. BASE may be
any base the trainer reads (HF safetensors, our Orbax base, a MaxText checkpoint); a MaxText base
takes config.json and the tokenizer from CFG (default: the run's tokenizer_path in the metadata).
CKPT, DIR, BASE and CFG are local directories or gs:// URIs (CFG also a Hub repo id). `--hub-repo`
also pushes DIR to that Hugging Face Hub model repo with the token in HF_TOKEN. The gate options refuse the
export (exit 10, nothing written) unless EVAL, the train step's evaluation of base and adapter, shows them.
With `tracking.KEY=VALUE` (the train command line's tracking section), the adapter's files are also logged to the
experiment trackers' runs that training kept in RUN/tracking.json, with its lineage; a tracker that is down never
fails the export.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
from pathlib import Path

import numpy as np

from lorajob_trainer import evaluate, lora, stages, storage, tracking
from lorajob_trainer.contract import catalog, exit_codes
from lorajob_trainer.contract.config import ConfigError, TrackingConfig
from lorajob_trainer.checkpoint import CheckpointError, CheckpointMetadata, complete_checkpoints
from lorajob_trainer.console import configure_logging
from lorajob_trainer.contract.records import ExportGate, choose_checkpoint, join

log = logging.getLogger("lorajob_trainer.export")  # not __name__: run as __main__

MAX_SHARD_BYTES = 4 * 2**30


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked."""


def num_layers(params: dict[str, np.ndarray]) -> int:
    return 1 + max(int(key.split(".")[1]) for key in params)


def base_model_name_or_path(metadata: CheckpointMetadata) -> str:
    info = catalog.MODELS.get(metadata.base_model)
    return info.hf_repo if info and info.hf_repo else metadata.load_parameters_path or metadata.base_model


def adapter_config(metadata: CheckpointMetadata, target_modules: list[str], base_name: str) -> dict:
    """PEFT's adapter_config.json; routed-expert targets go to `target_parameters` (models/experts.py)."""
    modules, parameters = lora.peft_target_lists(metadata.family, target_modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": metadata.lora_rank,
        "lora_alpha": metadata.lora_alpha,
        "target_modules": modules,
        **({"target_parameters": parameters} if parameters else {}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": metadata.use_rslora,
        "use_dora": metadata.use_dora,
        "inference_mode": True,
        "modules_to_save": None,
    }


def export_adapter(checkpoint: str | Path, out: str | Path, *, base_name: str | None = None) -> Path:
    """Write the PEFT adapter of `checkpoint` to `out`; returns `out`."""
    from safetensors.numpy import save_file

    params, metadata = lora.load_adapter_checkpoint(checkpoint)
    tensors, found = lora.to_peft(params, metadata.family, num_layers(params), metadata.lora_rank)
    base_config = _base_hf_config(metadata)
    tensors = lora.peft_names_for_base(tensors, base_config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # PEFT reads no quantisation from an adapter: a QLoRA adapter is an ordinary one, its base's quantisation noted here.
    save_file(tensors, out / "adapter_model.safetensors",
              metadata={"format": "pt", "lorajob.base_quantization": metadata.base_quantization})
    config = adapter_config(metadata, found, base_name or base_model_name_or_path(metadata))
    config["target_modules"] = lora.peft_target_modules(config["target_modules"], base_config)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _base_hf_config(metadata: CheckpointMetadata) -> dict:
    """The base model's config.json (it says whether PEFT sees a multimodal layout): from the base
    checkpoint, else the run's tokenizer/config location (a MaxText base; local, gs:// or a Hub repo id).
    Without one, the text-only layout is assumed, with a warning."""
    base = metadata.load_parameters_path
    if base and storage.exists(storage.join(base, "config.json")):
        with storage.local_input(base, patterns=("config.json",)) as directory:
            return json.loads((directory / "config.json").read_text())
    if metadata.tokenizer_path:
        try:
            with storage.local_input(metadata.tokenizer_path, hub=True, patterns=("config.json",)) as directory:
                if (directory / "config.json").is_file():
                    return json.loads((directory / "config.json").read_text())
        except (OSError, ValueError) as error:  # StorageError, Hub errors
            log.warning("cannot read config.json from %s: %s", metadata.tokenizer_path, error)
    log.warning(
        "no config.json for base %s: writing the adapter for a text-only model layout (not the "
        "model.language_model. names a multimodal base needs)",
        base,
    )
    return {}


def select_checkpoint(checkpoint: str | Path, step: str) -> str:
    """The step directory that `step` (best or a number) names under a checkpoint root; `latest` leaves
    `checkpoint` as given (a step directory, or a root whose newest step is read)."""
    if step == "latest":
        return str(checkpoint)
    try:
        chosen = choose_checkpoint(step, complete_checkpoints(checkpoint))
    except (LookupError, CheckpointError) as error:
        raise ExportError(f"--step {step} of {checkpoint}: {error.args[0]}") from None
    log.info("exporting checkpoint step %d (%s)", chosen.step, step)
    return join(str(checkpoint), str(chosen.step))


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    step: str = "latest",
    base_name: str | None = None,
    merged: bool = False,
    base: str | Path | None = None,
    base_config: str | Path | None = None,
    hub_repo: str | None = None,
    trackers: tracking.Trackers | None = None,
) -> None:
    """Export `checkpoint` to `out` (adapter, and `out`/merged if `merged`); push `out` to `hub_repo` if set; log the
    adapter to `trackers` if given."""
    if hub_repo:
        storage.hf_token()  # a missing token fails before any work
    checkpoint = select_checkpoint(checkpoint, step)
    with (
        stages.stage(log, f"exporting {checkpoint} to {out}" + (" with merged weights" if merged else "")),
        storage.local_input(checkpoint) as local_checkpoint,
        storage.local_output(out) as local_out,
    ):
        export_adapter(local_checkpoint, local_out, base_name=base_name)
        if trackers is not None:
            trackers.log_adapter(local_out, adapter_lineage(local_out, checkpoint, out, trackers.lineage))
        if merged:
            export_merged(local_checkpoint, local_out / "merged", base=base, base_config=base_config)
        if hub_repo:
            storage.upload_to_hub(local_out, hub_repo)


def adapter_lineage(adapter: Path, checkpoint: str, out: str | Path, trained: dict[str, str]) -> dict[str, str]:
    """What the trackers record with the exported adapter: what its run trained on (`trained`: base model, dataset),
    the checkpoint it came from, where it went and the base it names."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    return {**trained, "checkpoint": str(checkpoint), "location": str(out),
            "base_model_name_or_path": config["base_model_name_or_path"]}


def export_merged(
    checkpoint: str | Path, out: str | Path, *, base: str | Path | None = None, base_config: str | Path | None = None
) -> Path:
    """Write base + adapter as one HF model directory (host memory holds the whole model)."""
    from lorajob_trainer import loading

    params, metadata = lora.load_adapter_checkpoint(checkpoint)
    base = str(base or metadata.load_parameters_path)
    if not base or not (storage.is_remote(base) or Path(base).is_dir()):
        raise ExportError(f"--merged needs the base checkpoint; {base} is not a directory (pass --base)")
    config_dir = base_config or metadata.tokenizer_path or None
    # The Orbax formats are read in place; HF safetensors only from local files.
    remote_hf = storage.is_remote(base) and loading.detect_format(base) == "hf"
    with storage.local_input(base) if remote_hf else contextlib.nullcontext(base) as base_location:
        return _write_merged(params, metadata, base_location, config_dir, Path(out))


def _write_merged(
    params: dict[str, np.ndarray],
    metadata: CheckpointMetadata,
    base: str | Path,
    config_dir: str | Path | None,
    out: Path,
) -> Path:
    import jax
    import jax.numpy as jnp
    from etils import epath
    from flax import nnx

    from lorajob_trainer import mesh as mesh_lib
    from lorajob_trainer import loading, weights

    mesh = mesh_lib.host_mesh(jax.devices()[:1])
    model, spec = loading.load_model(metadata.base_model, base, mesh=mesh, dtype=jnp.float32, config_dir=config_dir)
    regex = lora.target_regex(spec.family.name, metadata.target_modules, metadata.lora_module_path)
    model = lora.apply_lora(
        model, rank=metadata.lora_rank, alpha=metadata.lora_alpha, target_regex=regex, mesh=mesh, rngs=nnx.Rngs(0),
        rslora=metadata.use_rslora, dora=metadata.use_dora,
    )
    lora.set_lora_params(model, params)
    merged = lora.merged_base_params(
        model, metadata.lora_rank, lora.scale(metadata.lora_alpha, metadata.lora_rank, metadata.use_rslora)
    )
    dtype = _hf_dtype(spec.hf_config)
    prefix, towers = _other_towers(spec) if lora.is_multimodal(spec.hf_config) else ("model.", {})
    tensors = {k: v.astype(dtype) for k, v in weights.hf_tensors(merged, spec.tensor_maps(), prefix).items()}
    tensors.update(towers)
    total = sum(t.nbytes for t in tensors.values())
    weights.save_hf_safetensors(out, tensors, shards=max(1, math.ceil(total / MAX_SHARD_BYTES)))
    (out / "config.json").write_text(json.dumps(spec.hf_config, indent=2) + "\n")
    for name in (*loading.TOKENIZER_FILES, "generation_config.json"):
        source = epath.Path(spec.config_source) / name
        if source.is_file():
            source.copy(out / name, overwrite=True)
    return out


def _other_towers(spec) -> tuple[str, dict[str, np.ndarray]]:
    """A multimodal base's language-model prefix and its other tensors (vision/audio towers, projections),
    copied unchanged so that the merged export is the full checkpoint."""
    from lorajob_trainer import weights

    if spec.format != "hf":
        raise ExportError(
            f"{spec.checkpoint} is a {spec.format} checkpoint of a multimodal model and holds its language model "
            "only; pass the Hugging Face checkpoint as --base to write the full merged model"
        )
    source = weights.SafetensorsDir(spec.checkpoint)
    prefix = weights.decoder_prefix(source.names())
    return prefix, {name: source.read(name) for name in sorted(source.names()) if not name.startswith(prefix)}


def _hf_dtype(hf_config: dict) -> np.dtype:
    import ml_dtypes

    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(name, np.float32)


def _gate(gate: ExportGate, evaluation: str) -> None:
    """Exit before writing anything when the gate refuses the adapter (or has no evaluation to judge it by)."""
    if not gate.active:
        return
    record = evaluate.read_record(evaluation)
    if record is None:
        print(f"export refused: the export gate needs the evaluation of base and adapter at {evaluation}, which is "
              "missing or unreadable (the train step writes it with generation_eval.enabled)", file=sys.stderr)
        raise SystemExit(exit_codes.CONFIG)
    refusal = gate.refusal(record)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        raise SystemExit(exit_codes.NO_IMPROVEMENT)
    log.info("export gate passed: adapter %.3f, base %.3f (stop rate %.2f)", record.adapter.score, record.base.score,
             record.adapter.stop_rate)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="step directory or checkpoint root (or gs:// URI)")
    parser.add_argument("--out", required=True, help="directory or gs:// URI")
    parser.add_argument("--step", default="latest",
                        help="which checkpoint of a checkpoint root: latest (default), best (lowest eval loss) or a step")
    parser.add_argument("--merged", action="store_true", help="also write merged full weights to OUT/merged")
    parser.add_argument("--base", help="base checkpoint for --merged (default: from the metadata)")
    parser.add_argument(
        "--base-config",
        help="config.json + tokenizer directory (or Hub repo id) of a MaxText base for --merged "
        "(default: the run's tokenizer_path from the metadata)",
    )
    parser.add_argument("--base-model-name-or-path", help="adapter_config.json base_model_name_or_path")
    parser.add_argument("--hub-repo", help="also push OUT to this Hugging Face Hub model repo (org/name)")
    gate = parser.add_argument_group("export gate", "refuse to export (exit 10, NoImprovement) unless the evaluation "
                                     "of base and adapter (the train step's generation_eval) shows:")
    gate.add_argument("--require-improvement", action="store_true", help="the adapter scores above the base")
    gate.add_argument("--minimum-score", type=float, help="the adapter's score is at least this (0 to 1)")
    gate.add_argument("--minimum-stop-rate", type=float, help="the adapter's stop rate is at least this (0 to 1)")
    gate.add_argument("--evaluation", help="the evaluation record, <run>/evaluation.json (needed with the above)")
    parser.add_argument("--tracking-record", help="the trackers' runs training kept, <run>/tracking.json")
    parser.add_argument("tracking", nargs="*", metavar="tracking.KEY=VALUE",
                        help="the train config's tracking section (the trackers to log the adapter to)")
    args = parser.parse_args(argv)
    export_gate = ExportGate(args.require_improvement, args.minimum_score, args.minimum_stop_rate)
    if export_gate.active and not args.evaluation:
        parser.error("--require-improvement, --minimum-score and --minimum-stop-rate need --evaluation")
    try:
        tracking_settings = TrackingConfig.from_args(args.tracking)
    except ConfigError as error:
        parser.error(str(error))
    if tracking_settings.trackers and not args.tracking_record:
        parser.error("tracking.* keys need --tracking-record")
    configure_logging()
    _gate(export_gate, args.evaluation)
    trackers = tracking.Trackers.for_export(tracking_settings, args.tracking_record) if args.tracking_record else None
    try:
        export(
            args.checkpoint,
            args.out,
            step=args.step,
            base_name=args.base_model_name_or_path,
            merged=args.merged,
            base=args.base,
            base_config=args.base_config,
            hub_repo=args.hub_repo,
            trackers=trackers,
        )
    except ValueError as error:  # ExportError, LoraError, StorageError, WeightsError
        raise SystemExit(f"export failed: {error}") from error
    finally:
        if trackers is not None:
            trackers.close()
    print(args.out)


if __name__ == "__main__":
    main()
