"""One table for one accelerator: our LoRA step vs HF transformers + PEFT, MFU of each, and the loss's memory.

    python bench/accelerator.py [--out FILE] [--smoke] [--moe 30b-a3b|26b-a4b]
                                                            (bench/accelerator.sh wraps it with a time limit)

Default sizes are for one H200-class GPU and run within 9.5 minutes: the Qwen3-8B shape (bf16, batch 2,
seq 2048, LoRA r16 on all seven projections) in our trainer's step and in HF + PEFT, 5 timed steps
each; the same for a mixture-of-experts shape (`--moe`: Qwen3-30B-A3B, default, or Gemma 4 26B-A4B;
batch 1, seq 2048, 3 timed steps; LoRA on attention and every expert; MFU from the active
parameters); then the loss and its adapter gradient with full logits against the chunked loss at vocabularies
151,936 and 262,144 (batch 4 x seq 2048, hidden 4096). `--smoke` runs the same pieces at tiny sizes
(what the CPU test runs). Every piece runs in a child process of its own (trainer_bench.py,
loss_memory.py). The table goes to stdout and to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

from trainer_bench import run_child

BENCH = Path(__file__).resolve().parent
FULL = {
    "trainer": ["--shape", "8b", "--batch", "2", "--seq", "2048", "--steps", "5"],
    "moe": ["--batch", "1", "--seq", "2048", "--steps", "3"],
    "loss": ["--batch", "4", "--seq", "2048", "--hidden", "4096", "--layers", "2", "--steps", "3"],
    "vocabs": [151936, 262144],
}
SMOKE = {
    "trainer": ["--shape", "tiny", "--batch", "2", "--seq", "32", "--steps", "1"],
    "moe": ["--batch", "2", "--seq", "32", "--steps", "1"],
    "loss": ["--batch", "1", "--seq", "32", "--hidden", "64", "--layers", "1", "--steps", "1"],
    "vocabs": [512],
}


def gib(value: float | None) -> str:
    return f"{value / 2**30:.2f}" if value is not None else "n/a"


def trainer_rows(piece: str, argv: list[str]) -> list[list[str]]:
    """Our step and HF + PEFT's on one shape, both MFUs from our FLOPs model (active parameters for MoE)."""
    trainer = {
        framework: run_child(str(BENCH / "trainer_bench.py"), [*argv, "--framework", framework], False)
        for framework in ("jax", "torch")
    }
    flops_per_token = trainer["jax"]["gflops_per_token"] * 1e9
    peak_flops = trainer["jax"]["peak_flops"]
    table = []
    for framework, result in trainer.items():
        mfu = result["tokens_per_s"] * flops_per_token / peak_flops if peak_flops else None
        table.append([
            piece, "ours" if framework == "jax" else "HF+PEFT", result["device"], f"{result['tokens_per_s']:.0f}",
            f"{1000 * result['step_s']:.1f}", f"{100 * mfu:.1f}%" if mfu is not None else "n/a",
            gib(result["peak_memory_bytes"]), "",
        ])
    return table


def rows(sizes: dict, moe_shape: str) -> list[list[str]]:
    table = [["piece", "variant", "device", "tokens/s", "step ms", "MFU", "peak GiB", "XLA temp GiB"]]
    table += trainer_rows("train step", sizes["trainer"])
    table += trainer_rows(f"moe {moe_shape}", ["--shape", moe_shape, *sizes["moe"]])
    for vocab in sizes["vocabs"]:
        for loss in ("full-logits", "chunked"):
            result = run_child(str(BENCH / "loss_memory.py"), [*sizes["loss"], "--loss", loss, "--vocab", str(vocab)],
                               False)
            table.append([f"loss, vocab {vocab}", loss, "", "", f"{1000 * result['step_s']:.1f}", "",
                          gib(result["peak_bytes"]), gib(result["temp_bytes"])])
    return table


def render(table: list[list[str]]) -> str:
    widths = [max(len(row[column]) for row in table) for column in range(len(table[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(f"accelerator-{datetime.date.today()}.txt"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check that every piece starts)")
    parser.add_argument("--moe", choices=["30b-a3b", "26b-a4b"], default="30b-a3b",
                        help="mixture-of-experts shape (--smoke: the tiny Qwen3 MoE)")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    moe_shape = "tiny-moe" if args.smoke else args.moe
    text = (f"bench/accelerator.py{' --smoke' if args.smoke else ''}: trainer {' '.join(sizes['trainer'])}; "
            f"moe {moe_shape} {' '.join(sizes['moe'])}; loss {' '.join(sizes['loss'])}\n"
            f"{render(rows(sizes, moe_shape))}\n")
    print(text, end="", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
