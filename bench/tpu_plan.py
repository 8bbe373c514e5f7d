"""Per-chip HBM of our train step and of MaxText's, both compiled deviceless by the real TPU compiler (benchmark).

    .venv/bin/python bench/tpu_plan.py                       # the default table
    .venv/bin/python bench/tpu_plan.py --cases llama3.1-8b:v6e-8:1024 llama3.1-8b:v5p-8:1024 llama3.1-8b:v6e-8:1024:2
    .venv/bin/python bench/tpu_plan.py --smallest qwen3-8b:1024 gemma3-27b:2048 --no-maxtext

A case is model:slice:seq[:slices] (catalogue model, MaxText's slice name such as v6e-8, v5p-8 or tpu7x-8, sequence
length, number of slices); `--expert N` compiles ours with mesh.expert=N (MoE expert parallelism); batch 1 row per chip, LoRA rank 16, alpha 32 on the default targets, bf16 base weights
as the trainer loads them on TPU. For each it compiles our step (`fit.compile_attempt`: the trainer's own jitted
step, layers scanned, and the plan's roofline: predicted tokens/s per chip and MFU ceiling) and, in the same run,
MaxText 0.2.5's LoRA step (`bench/maxtext/train_compile.py`, MaxText's venv from `bench/maxtext/setup.sh`; float32
weights, MaxText's default, unless `--maxtext-weight-dtype`; its full fine-tune where its LoRA step does not build),
and prints one row per case: arguments, temporaries and total per chip for both, the ratio, whether ours fits the
chip's HBM less the plan's margin, what each device sends per step by collective kind (both counted from the
compiled HLO by lorajob_trainer.collectives), and the compile times. Total = arguments + outputs not aliased to
them + temporaries. `--smallest model:seq` compiles ours on v6e slices from the smallest up and reports the first
that fits (then MaxText on that slice).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "maxtext"))

from lorajob_operator.accelerators import TPU_CHIPS, chips_in
from lorajob_trainer.contract.records import REMAT_POLICIES

SLICES = {
    "v6e-1": ("v6e", "1x1"), "v6e-4": ("v6e", "2x2"), "v6e-8": ("v6e", "2x4"), "v6e-16": ("v6e", "4x4"),
    "v6e-32": ("v6e", "4x8"), "v6e-64": ("v6e", "8x8"), "v6e-128": ("v6e", "8x16"), "v6e-256": ("v6e", "16x16"),
    "v5p-8": ("v5p", "2x2x1"), "v5p-16": ("v5p", "2x2x2"), "v5p-32": ("v5p", "2x2x4"),
    "tpu7x-8": ("v7x", "2x2x1"), "tpu7x-16": ("v7x", "2x2x2"), "tpu7x-32": ("v7x", "2x2x4"),
}
"""MaxText's slice names -> (our chip catalogue's generation, libtpu's topology)."""
V6E_ASCENDING = [name for name in SLICES if name.startswith("v6e-")]
DEFAULT_CASES = ["qwen3-0.6b:v6e-4:1024", "qwen3-0.6b:v6e-4:2048", "llama3.1-8b:v6e-8:1024",
                 "llama3.1-8b:v6e-8:2048", "qwen3-30b-a3b:v6e-16:1024", "qwen3-30b-a3b:v6e-16:2048",
                 "gemma4-26b:v6e-16:1024", "gemma4-26b:v6e-16:2048"]


def _train_config(model: str, seq: int, remat: str, lora: dict | None = None, **fields):
    """The benchmark's setting: one row of `seq` tokens per device, LoRA rank 16, alpha 32 (plus `lora`)."""
    from lorajob_trainer.contract.config import TrainConfig

    return TrainConfig.from_dict({
        "run_name": "plan", "base_output_directory": "/tmp/plan", "model_name": model,
        "load_parameters_path": "unused", "hf_train_files": ["unused"], "steps": 1, "max_target_length": seq,
        "per_device_batch_size": 1, "remat_policy": remat, "lora": {"lora_rank": 16, "lora_alpha": 32, **(lora or {})},
        **fields,
    })


def ours(model: str, slice_name: str, seq: int, remat: str, base_quantization: str = "none", slices: int = 1,
         targets: list[str] | None = None, expert: int | str = 1, capacity_factor: float | None = None) -> dict:
    from lorajob_trainer import fit
    from lorajob_trainer.contract import catalog
    from lorajob_trainer.contract.fit import Target

    dispatch = {} if capacity_factor is None else {"expert_capacity_factor": capacity_factor}
    config = _train_config(model, seq, remat, {"base_quantization": base_quantization, "target_modules": targets},
                           mesh={"expert": expert}, **dispatch)
    generation, topology = SLICES[slice_name]
    chip = TPU_CHIPS[generation]
    chips = chips_in(topology) * slices
    target = Target(slice_name, topology, slices, chips, 1, 1, remat)
    chips_per_host = 1 if chips == 1 else 4  # a one-chip slice is a one-chip VM (libtpu's host bounds)
    attempt = fit.compile_attempt(config, catalog.released_config(model), chip, chips_per_host, target)
    if attempt.error:  # the compiler's RESOURCE_EXHAUSTED and friends: a row, not a crash
        return {"error": attempt.error[:200]}
    memory = attempt.memory
    return {"base_weights_gb": memory["base_weights"] / 1e9, "arguments_gb": memory["arguments"] / 1e9,
            "temporaries_gb": memory["temporaries"] / 1e9, "total_gb": attempt.total_bytes / 1e9, "fits": attempt.fits,
            "compile_s": attempt.compile_seconds, "flops": attempt.compiler_flops,
            "tokens_per_second_per_chip": attempt.tokens_per_second_per_chip, "mfu": attempt.mfu, "bound": attempt.bound,
            "collective_bytes": attempt.collective_bytes, "mesh": attempt.mesh,
            "expert_capacity_factor": config.expert_capacity_factor}


def _depths(model: str) -> tuple[dict, int, int, int]:
    """(released config, its depth, and the two shallower depths compiled unrolled: one and two layer periods)."""
    from lorajob_trainer import models
    from lorajob_trainer.contract import catalog

    hf_config = catalog.released_config(model)
    family = models.family_for_hf_config(hf_config)
    period = family.layer_period(family.config_from_hf(hf_config, "bfloat16")) or 1
    return hf_config, hf_config["num_hidden_layers"], period, 2 * period


def _extrapolate(shallow: float, deeper: float, depths: tuple[int, int], layers: int) -> float:
    """A step's count at `layers` from its counts at two depths: what the layers add grows with their number."""
    return shallow + (deeper - shallow) * (layers - depths[0]) / (depths[1] - depths[0])


def executed_flops(model: str, slice_name: str, seq: int, remat: str, maxtext: bool) -> dict:
    """FLOPs each step executes per chip, from the compiler's cost analysis of the step unrolled at one and two
    layer periods (a scanned or chunked loop's body is counted once, so neither side is compiled scanned; our
    loss runs as one chunk), extrapolated to the model's depth, as are the model FLOPs (the plan's 4N model).
    MaxText runs with `attention=dot_product` here: its default splash-attention kernel is a custom call whose
    FLOPs the cost analysis does not see. Ours runs its attention in that kernel on TPU (models/splash.py), so its
    count is the compiler's plus the kernel's from the plan's model (`CompiledStep.kernel_flops_per_token`)."""
    from lorajob_trainer import plan
    from lorajob_trainer.contract import catalog

    hf_config, layers, *depths = _depths(model)
    config = _train_config(model, seq, remat, loss_chunk_length=seq)
    generation, topology = SLICES[slice_name]
    devices = plan.topology_devices(f"{TPU_CHIPS[generation].compiler_name}:{topology}")
    steps = [plan.compile_train_step(config, catalog.at_depth(hf_config, depth), devices, scan_layers=False)
             for depth in depths]
    model_flops = [step.flops_per_token * step.tokens_per_device for step in steps]
    row = {"model_flops": _extrapolate(*model_flops, tuple(depths), layers),
           "ours": _extrapolate(*(step.flops + step.kernel_flops_per_token * step.tokens_per_device for step in steps),
                                tuple(depths), layers)}
    if maxtext:
        import train_compile

        theirs = []
        for depth in depths:
            result = train_compile.run(model, slice_name, seq=seq, weight_dtype="bfloat16", extra=(
                "override_model_config=True", f"base_num_decoder_layers={depth}", "scan_layers=False",
                "attention=dot_product"))
            if not result.get("ok") or result.get("flops") is None:
                row["maxtext_reason"] = str(result.get("reason"))[:200]
                break
            theirs.append(result["flops"])
        else:
            row["maxtext"] = _extrapolate(*theirs, tuple(depths), layers)
    return row


def base_weight_bytes(model: str) -> int:
    """The model's weights in bf16, from its abstract shapes (nothing allocated)."""
    import jax
    from flax import nnx
    from lorajob_trainer import models
    from lorajob_trainer.contract import catalog

    hf_config = catalog.released_config(model)
    family = models.family_for_hf_config(hf_config)
    abstract = models.abstract_model(family, family.config_from_hf(hf_config, "bfloat16"), hf_config)
    return sum(2 * leaf.size for leaf in jax.tree.leaves(nnx.state(abstract)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=None, help="model:slice:seq[:slices]")
    parser.add_argument("--smallest", nargs="+", default=[], help="model:seq: the smallest v6e slice ours fits")
    parser.add_argument("--remat", default="full", choices=REMAT_POLICIES,
                        help="our remat policy (MaxText's default is full)")
    parser.add_argument("--no-maxtext", action="store_true")
    parser.add_argument("--maxtext-weight-dtype", default="float32")
    parser.add_argument("--base-quantization", default="none", help="ours: lora.base_quantization (QLoRA)")
    parser.add_argument("--expert", default="1", help="ours: mesh.expert, a number or auto (expert parallelism for MoE "
                        "models; default 1: the FSDP-style step)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="ours, with --expert > 1: expert_capacity_factor (default: the trainer's)")
    parser.add_argument("--executed-flops", nargs="+", default=[], metavar="MODEL:SLICE:SEQ",
                        help="FLOPs each side's step executes per chip against the model FLOPs (MFU ceiling if "
                             "compute-bound)")
    parser.add_argument("--targets", default=None,
                        help="ours: comma-separated LoRA targets (default: the family's; MaxText's qwen3 path adapts "
                             "attention only: q_proj,k_proj,v_proj,o_proj is the same work)")
    args = parser.parse_args(argv)
    targets = args.targets.split(",") if args.targets else None
    expert = args.expert if args.expert == "auto" else int(args.expert)
    if args.executed_flops:
        return _print_executed_flops(args.executed_flops, args.remat, not args.no_maxtext)
    cases = args.cases if args.cases is not None else ([] if args.smallest else DEFAULT_CASES)
    rows = []
    header = ("model", "slice", "seq", "base", "expert", "ours weights", "ours args", "ours temp", "ours total", "fits",
              "tok/s/chip", "MFU", "sent GB/chip", "ours compile s", "MaxText step", "MaxText total", "MaxText temp",
              "ratio", "MaxText sent GB/chip", "MaxText compile s")
    print(" | ".join(header), flush=True)

    def report(model: str, slice_name: str, seq: int, slices: int, mine: dict) -> None:
        row = {"model": model, "slice": slice_name, "slices": slices, "seq": seq, "remat": args.remat,
               "base_quantization": args.base_quantization, "targets": args.targets, "ours": mine}
        if not args.no_maxtext:
            import train_compile

            theirs = train_compile.run(model, slice_name, num_slices=slices, seq=seq,
                                       weight_dtype=args.maxtext_weight_dtype)
            if not theirs["ok"] and "compile_s" not in theirs and "timeout" not in str(theirs.get("reason")):
                # Its LoRA step did not build (nothing was compiled): its full fine-tune, the nearest step it has.
                lora_reason = theirs.get("reason")
                theirs = train_compile.run(model, slice_name, num_slices=slices, seq=seq,
                                           weight_dtype=args.maxtext_weight_dtype, lora=False)
                theirs["lora_reason"] = lora_reason
            row["maxtext"] = theirs
        rows.append(row)
        print(_line(row), flush=True)

    for case in cases:
        model, slice_name, seq, *rest = case.split(":")
        slices = int(rest[0]) if rest else 1
        report(model, slice_name, int(seq), slices,
               ours(model, slice_name, int(seq), args.remat, args.base_quantization, slices, targets, expert,
                    args.capacity_factor))
    for wanted in args.smallest:
        model, seq = wanted.split(":")
        weight_bytes = base_weight_bytes(model)
        for slice_name in V6E_ASCENDING:
            generation, topology = SLICES[slice_name]
            per_chip = weight_bytes / chips_in(topology)
            if per_chip > TPU_CHIPS[generation].capacity_bytes and slice_name != V6E_ASCENDING[-1]:
                print(f"  {model} {seq}: {slice_name} does not fit (bf16 weights alone {per_chip / 1e9:.2f} GB per "
                      "chip; not compiled)", flush=True)
                continue
            mine = ours(model, slice_name, int(seq), args.remat, args.base_quantization, targets=targets)
            if mine.get("fits") or slice_name == V6E_ASCENDING[-1]:
                report(model, slice_name, int(seq), 1, mine)
                break
            why = mine.get("error") or f"{mine['total_gb']:.2f} GB per chip"
            print(f"  {model} {seq}: {slice_name} does not fit ({why})", flush=True)
    print(json.dumps(rows))
    return 0


def _print_executed_flops(cases: list[str], remat: str, maxtext: bool) -> int:
    print("model | slice | seq | remat | model FLOPs/chip | ours executed | ours MFU ceiling | MaxText executed | "
          "MaxText MFU ceiling | ours/MaxText executed", flush=True)
    rows = []
    for case in cases:
        model, slice_name, seq = case.split(":")
        row = {"model": model, "slice": slice_name, "seq": int(seq), "remat": remat,
               **executed_flops(model, slice_name, int(seq), remat, maxtext)}
        rows.append(row)
        cells = [model, slice_name, seq, remat, f"{row['model_flops']:.3e}", f"{row['ours']:.3e}",
                 f"{row['model_flops'] / row['ours']:.0%}"]
        if "maxtext" in row:
            cells += [f"{row['maxtext']:.3e}", f"{row['model_flops'] / row['maxtext']:.0%}",
                      f"{row['ours'] / row['maxtext']:.2f}"]
        else:
            cells += [row.get("maxtext_reason", "-"), "", ""]
        print(" | ".join(cells), flush=True)
    print(json.dumps(rows))
    return 0


def _line(row: dict) -> str:
    ours_row, theirs = row["ours"], row.get("maxtext") or {}
    if "error" in ours_row:
        mine = ["", "", ours_row["error"], "", "", "no", "", "", "", ""]
    else:
        sent = ", ".join(f"{kind} {value / 1e9:.2f}" for kind, value in ours_row["collective_bytes"].items())
        mine = [str(ours_row["mesh"].get("expert")), f"{ours_row['base_weights_gb']:.2f}", f"{ours_row['arguments_gb']:.2f}",
                f"{ours_row['temporaries_gb']:.2f}", f"{ours_row['total_gb']:.2f}", "yes" if ours_row["fits"] else "no",
                f"{ours_row['tokens_per_second_per_chip']:,.0f}", f"{ours_row['mfu']:.1%} ({ours_row['bound']})", sent,
                f"{ours_row['compile_s']:.0f}"]
    their_total = theirs.get("total_per_chip_bytes")
    mode = theirs.get("mode", "-") + (" (its LoRA step did not build)" if theirs.get("lora_reason") else "")
    if theirs.get("ok") and their_total:
        their_sent = ", ".join(f"{kind} {value / 1e9:.2f}" for kind, value in theirs.get("collective_bytes", {}).items())
        theirs_cols = [mode, f"{their_total / 1e9:.2f}", f"{theirs.get('temp_bytes', 0) / 1e9:.2f}",
                       f"{ours_row.get('total_gb', float('nan')) / (their_total / 1e9):.2f}", their_sent or "-",
                       f"{theirs.get('compile_s', float('nan')):.0f}"]
    else:
        theirs_cols = [mode, str(theirs.get("reason") or "-")[:80], "", "", "", ""]
    slice_name = row["slice"] + (f" x {row['slices']}" if row["slices"] > 1 else "")
    return " | ".join([row["model"], slice_name, str(row["seq"]), row["base_quantization"], *mine, *theirs_cols])


if __name__ == "__main__":
    sys.exit(main())
