"""Per-chip HBM of our train step and of MaxText's, both compiled deviceless by the real TPU compiler (benchmark).

    .venv/bin/python bench/tpu_plan.py                       # the default table
    .venv/bin/python bench/tpu_plan.py --cases llama3.1-8b:v6e-8:1024 --remat full --no-maxtext

For each case (catalogue model, MaxText topology name, sequence length; batch 1 row per chip, LoRA rank 16,
alpha 32 on the default targets, bf16 base weights as the trainer loads them on TPU) it compiles our step
(`lorajob_trainer.plan.compile_train_step`, the trainer's own jitted step with the layers scanned) and, in the
same run, MaxText 0.2.5's LoRA step (`bench/maxtext/train_compile.py`, MaxText's venv from
`bench/maxtext/setup.sh`; float32 weights, MaxText's default, unless `--maxtext-weight-dtype`), and prints
one row per case: arguments, temporaries and total per chip for both, the ratio, whether ours fits the
chip's HBM, and the compile times. Total = arguments + outputs not aliased to them + temporaries.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "maxtext"))

from lorajob_operator.accelerators import TPU_CHIPS  # noqa: E402  (JAX-free)

TOPOLOGIES = {"v6e-4": "v6e:2x2", "v6e-8": "v6e:2x4", "v6e-16": "v6e:4x4", "v6e-32": "v6e:4x8", "v6e-64": "v6e:8x8", "v6e-128": "v6e:8x16"}
"""MaxText's compile_topology names -> libtpu's topology names."""
DEFAULT_CASES = ["qwen3-0.6b:v6e-4:1024", "qwen3-0.6b:v6e-4:2048", "llama3.1-8b:v6e-8:1024",
                 "llama3.1-8b:v6e-8:2048", "qwen3-30b-a3b:v6e-16:1024"]


def ours(model: str, topology: str, seq: int, remat: str, base_quantization: str = "none") -> dict:
    from lorajob_trainer import catalog, plan
    from lorajob_trainer.config import TrainConfig

    config = TrainConfig.from_dict({
        "run_name": "plan", "base_output_directory": "/tmp/plan", "model_name": model,
        "load_parameters_path": "unused", "hf_train_files": ["unused"], "steps": 1, "max_target_length": seq,
        "per_device_batch_size": 1, "remat_policy": remat,
        "lora": {"lora_rank": 16, "lora_alpha": 32, "base_quantization": base_quantization},
    })
    try:
        step = plan.compile_train_step(config, catalog.released_config(model), plan.topology_devices(topology))
    except Exception as error:  # the compiler's RESOURCE_EXHAUSTED and friends: a row, not a crash
        return {"error": str(error).splitlines()[0][:200]}
    memory = step.memory
    return {"base_weights_gb": memory.base_weights / 1e9, "arguments_gb": memory.arguments / 1e9,
            "temporaries_gb": memory.temporaries / 1e9,
            "total_gb": memory.total / 1e9, "compile_s": step.compile_seconds, "flops": step.flops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, help="model:maxtext-topology:seq")
    parser.add_argument("--remat", default="full", choices=["none", "minimal", "full"],
                        help="our remat policy (MaxText's default is full)")
    parser.add_argument("--no-maxtext", action="store_true")
    parser.add_argument("--maxtext-weight-dtype", default="float32")
    parser.add_argument("--base-quantization", default="none", help="ours: lora.base_quantization (QLoRA)")
    args = parser.parse_args(argv)
    rows = []
    header = ("model", "topology", "seq", "base", "ours weights", "ours args", "ours temp", "ours total", "fits", "ours compile s",
              "MaxText total", "MaxText temp", "ratio", "MaxText compile s")
    print(" | ".join(header))
    for case in args.cases:
        model, topology, seq = case.split(":")
        row = {"model": model, "topology": topology, "seq": int(seq), "remat": args.remat,
               "base_quantization": args.base_quantization,
               "ours": ours(model, TOPOLOGIES[topology], int(seq), args.remat, args.base_quantization)}
        if not args.no_maxtext:
            import train_compile

            row["maxtext"] = train_compile.run(model, topology, seq=int(seq), weight_dtype=args.maxtext_weight_dtype)
        rows.append(row)
        print(_line(row), flush=True)
    print(json.dumps(rows))
    return 0


def _line(row: dict) -> str:
    ours_row, theirs = row["ours"], row.get("maxtext") or {}
    if "error" in ours_row:
        mine = ["", ours_row["error"], "", "", "no", ""]
    else:
        hbm = TPU_CHIPS[row["topology"].split("-")[0]].hbm_bytes / 1e9
        mine = [f"{ours_row['base_weights_gb']:.2f}", f"{ours_row['arguments_gb']:.2f}", f"{ours_row['temporaries_gb']:.2f}", f"{ours_row['total_gb']:.2f}",
                "yes" if ours_row["total_gb"] <= hbm else "no", f"{ours_row['compile_s']:.0f}"]
    their_total = theirs.get("total_per_chip_bytes")
    if theirs.get("ok") and their_total:
        theirs_cols = [f"{their_total / 1e9:.2f}", f"{theirs.get('temp_bytes', 0) / 1e9:.2f}",
                       f"{ours_row.get('total_gb', float('nan')) / (their_total / 1e9):.2f}",
                       f"{theirs.get('compile_s', float('nan')):.0f}"]
    else:
        theirs_cols = [str(theirs.get("reason") or "-")[:80], "", "", ""]
    return " | ".join([row["model"], row["topology"], str(row["seq"]), row["base_quantization"], *mine, *theirs_cols])


if __name__ == "__main__":
    sys.exit(main())
