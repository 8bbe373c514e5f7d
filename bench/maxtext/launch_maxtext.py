"""Run a MaxText module (LoRA SFT or its HF -> MaxText conversion) in a process that is safe to share a machine with.

Usage, with the MaxText environment's interpreter (bench/maxtext/setup.sh):

    <maxtext-venv>/bin/python bench/maxtext/launch_maxtext.py sft [sft.yml] key=value...
    <maxtext-venv>/bin/python bench/maxtext/launch_maxtext.py to_maxtext HF_CONFIG_JSON key=value...

Two changes are made to MaxText, in this process only (site-packages stays untouched):

- MaxText's data-loader cleanup (`_cleanup_orphaned_multiprocessing_processes` in
  `maxtext.input_pipeline.multihost_dataloading`) scans /proc and SIGKILLs every
  `multiprocessing` worker on the machine whose parent is PID 1, whoever owns it. It runs whenever an
  iterator closes, so a benchmark would kill other people's jobs; here it becomes a no-op.
- `to_maxtext` builds its name mapping from the *published* HF config of `model_name` (28 layers for
  qwen3-0.6b), so a shrunk model (`override_model_config=True`) cannot be converted. The `to_maxtext`
  command takes our checkpoint's config.json and registers it under `model_name` first. Its eager
  loader also opens safetensors as torch tensors, and maxtext[tpu] has no torch (its lazy loader's
  proxies are not accepted by Orbax's v1 save path), so without torch the files are read as numpy.

If MaxText renames either patched name, the launcher stops instead of running unguarded.

For the benchmark, `LORAJOB_REAL_TOKENS_FILE=PATH` appends one JSON line per training batch with its
number of real (non-padding) input tokens; MaxText itself logs only the trained (target) tokens.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from importlib import resources

SFT_MODULE = "maxtext.trainers.post_train.sft.train_sft"
CONVERT_MODULE = "maxtext.checkpoint_conversion.to_maxtext"
CLEANUP_MODULE = "maxtext.input_pipeline.multihost_dataloading"
CLEANUP_FUNCTION = "_cleanup_orphaned_multiprocessing_processes"


def disable_machine_wide_cleanup() -> None:
    import importlib

    module = importlib.import_module(CLEANUP_MODULE)
    if not callable(getattr(module, CLEANUP_FUNCTION, None)):
        raise SystemExit(f"launch_maxtext: {CLEANUP_MODULE}.{CLEANUP_FUNCTION} not found; refusing to run MaxText "
                         "without knowing how its orphan cleanup works")

    def keep_other_processes_alive() -> None:
        """Replacement: this process's own workers are still closed by MaxText's iterator code."""

    setattr(module, CLEANUP_FUNCTION, keep_other_processes_alive)
    print(f"launch_maxtext: disabled {CLEANUP_MODULE}.{CLEANUP_FUNCTION} (machine-wide SIGKILL of orphans)",
          file=sys.stderr)


def count_real_tokens(path: str) -> None:
    """Record `inputs_segmentation != 0` of every training batch as MaxText's data hook loads it."""
    import numpy as np
    from maxtext.trainers.post_train import hooks

    load_next_train_batch = hooks.BaseDataHooks.load_next_train_batch

    def load_and_count(self, train_ctx):
        batch = load_next_train_batch(self, train_ctx)
        if batch is not None:
            real_tokens = int(np.count_nonzero(np.asarray(batch["inputs_segmentation"])))
            with open(path, "a", encoding="utf-8") as stream:
                stream.write(json.dumps({"batch": train_ctx.train_steps + 1, "real_tokens": real_tokens}) + "\n")
        return batch

    hooks.BaseDataHooks.load_next_train_batch = load_and_count


def register_hf_config(model_name: str, config_json: str) -> None:
    """Make `to_maxtext` map the layers of the checkpoint actually given, not of the published model."""
    import transformers
    from maxtext.checkpoint_conversion.utils import hf_model_configs

    with open(config_json, encoding="utf-8") as handle:
        values = json.load(handle)
    config_class = transformers.AutoConfig.for_model(values["model_type"]).__class__
    if model_name not in hf_model_configs.HF_MODEL_CONFIGS:
        raise SystemExit(f"launch_maxtext: MaxText has no HF config registered for model_name={model_name}")
    hf_model_configs.HF_MODEL_CONFIGS[model_name] = config_class(**values)


def read_safetensors_without_torch() -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return
    import safetensors
    from maxtext.checkpoint_conversion.utils import utils

    def numpy_safe_open(path, framework="numpy", **kwargs):
        return safetensors.safe_open(path, framework="numpy" if framework == "pt" else framework, **kwargs)

    utils.safe_open = numpy_safe_open


def default_sft_config() -> str:
    return str(resources.files("maxtext") / "configs" / "post_train" / "sft.yml")


def option(arguments: list[str], key: str) -> str:
    for argument in arguments:
        name, _, value = argument.partition("=")
        if name.lstrip("-") == key:
            return value
    raise SystemExit(f"launch_maxtext: {key}=... is required")


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("sft", "to_maxtext"):
        raise SystemExit(__doc__)
    command, arguments = argv[0], argv[1:]
    disable_machine_wide_cleanup()
    if command == "sft":
        if os.environ.get("LORAJOB_REAL_TOKENS_FILE"):
            count_real_tokens(os.environ["LORAJOB_REAL_TOKENS_FILE"])
        if not arguments or "=" in arguments[0]:
            arguments = [default_sft_config(), *arguments]
        sys.argv = [SFT_MODULE, *arguments]
        runpy.run_module(SFT_MODULE, run_name="__main__", alter_sys=True)
        return
    config_json, arguments = arguments[0], arguments[1:]
    register_hf_config(option(arguments, "model_name"), config_json)
    read_safetensors_without_torch()
    sys.argv = [CONVERT_MODULE, *arguments]
    runpy.run_module(CONVERT_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
