"""Runs MaxText's deviceless `train_compile` and prints the compiled train step's figures as one JSON line.

Launched by `train_compile.py` in MaxText's venv, with libtpu on PYTHONPATH; its arguments are
`train_compile`'s own (`<maxtext>/configs/base.yml key=value ...`). `train_compile.main` prints
`memory_analysis()` and `cost_analysis()` only as Python reprs, after a successful compile; this wraps its
`jit_and_compile` to time the compile and read both from the compiled object, and to report the compiler's
error (e.g. RESOURCE_EXHAUSTED) when the compile fails. The JSON line starts with `MARKER`.

LoRA: MaxText 0.2.5's `train_compile` honours `lora.enable_lora=True` only by differentiating with respect
to `nnx.LoRAParam`, but never adds the adapters (only `train_sft`, MaxText's LoRA trainer, calls
`lora_utils.apply_lora_to_model`). Unpatched, its "LoRA" step has nothing to train, XLA drops the backward
pass, and the figures are a forward pass's (no adapter bytes in the arguments; the flops of one forward).
So with `lora.enable_lora=True` this wraps the model factory that `train_compile` traces to apply MaxText's
own `apply_lora_to_model` (Qwix, the module paths of `configs/post_train/lora_module_path.yml`, adapters
replicated as `train_sft` makes them), and reports the adapters it found.

With `HLO_PATH_VARIABLE` set, the compiled step's HLO text is written to that file (train_compile.py counts its
collectives' bytes with the trainer's own reader).
"""

import json
import os
import re
import sys
import time

MARKER = "LORAJOB_TRAIN_COMPILE_RESULT "
HLO_PATH_VARIABLE = "LORAJOB_TRAIN_COMPILE_HLO"
MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "peak_memory_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
)
COST_FIELDS = ("flops", "transcendentals", "bytes accessed")
LAYER_INDEX = re.compile(r"(?<=layers_)[0-9]+|(?<=/)[0-9]+(?=/|$)")


def _emit(result):
    print(MARKER + json.dumps(result), flush=True)


def _versions():
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("maxtext", "jax", "jaxlib", "libtpu"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def _add_lora_adapters(train_compile, lora_found):
    """Makes `train_compile`'s model factory return the model with MaxText's LoRA adapters applied."""
    from flax import nnx
    from maxtext.utils import lora_utils

    model_creation_utils = train_compile.model_creation_utils
    original = model_creation_utils.create_nnx_abstract_model

    def create_nnx_abstract_model(config, *args, **kwargs):
        create_model, abstract_model = original(config, *args, **kwargs)
        if not config.lora.enable_lora:
            return create_model, abstract_model

        def create_model_with_lora():
            # mesh=None: tiny dummy inputs for Qwix's tracing pass and no device_put of the (abstract)
            # adapters; their sharding metadata is set to replicated either way.
            model = lora_utils.apply_lora_to_model(create_model(), None, config)
            # Qwix's tracing pass leaves sown intermediates (MoE's moe_has_overflow) in the model; train_sft
            # pops them too, and train_step's output state has none.
            nnx.pop(model, nnx.Intermediate)
            adapters = [(path, value) for path, value in nnx.iter_graph(model) if isinstance(value, nnx.LoRAParam)]
            lora_found["lora_param_arrays"] = len(adapters)
            lora_found["lora_params"] = sum(int(value.get_value().size) for _, value in adapters)
            modules = {"/".join(map(str, path[:-1])) for path, _ in adapters}
            # Layer indices as *: one entry per kind of module, scanned or not.
            lora_found["lora_modules"] = sorted({LAYER_INDEX.sub("*", module) for module in modules})
            return model

        return create_model_with_lora, abstract_model

    model_creation_utils.create_nnx_abstract_model = create_nnx_abstract_model


def main():
    from absl import app
    from maxtext.trainers.pre_train import train_compile

    lora_found = {}
    if "lora.enable_lora=True" in sys.argv[1:]:
        _add_lora_adapters(train_compile, lora_found)
    original = train_compile.jit_and_compile

    def measured(*args, **kwargs):
        result = {"versions": _versions(), **lora_found}
        start = time.perf_counter()
        try:
            compiled = original(*args, **kwargs)
        except Exception as error:
            result["compile_s"] = round(time.perf_counter() - start, 1)
            result["error"] = f"{type(error).__name__}: {error}"
            _emit(result)
            raise
        result["compile_s"] = round(time.perf_counter() - start, 1)
        memory = compiled.memory_analysis()
        result["memory"] = {field: getattr(memory, field, None) for field in MEMORY_FIELDS}
        cost = compiled.cost_analysis()
        if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
            cost = cost[0] if cost else {}
        result["cost"] = {field: cost.get(field) for field in COST_FIELDS} if cost else {}
        if os.environ.get(HLO_PATH_VARIABLE):  # the compiled step's HLO, for its collectives' bytes
            with open(os.environ[HLO_PATH_VARIABLE], "w") as handle:
                handle.write(compiled.as_text())
        _emit(result)
        return compiled

    train_compile.jit_and_compile = measured
    app.run(train_compile.main, argv=[sys.argv[0], *sys.argv[1:]])


if __name__ == "__main__":
    main()
