#!/usr/bin/env bash
# One accelerator, one call, at most 9.5 minutes: our LoRA step vs HF + PEFT on the Qwen3-8B shape and on a
# MoE shape (Qwen3-30B-A3B, or --moe 26b-a4b: Gemma 4 26B-A4B) (bf16, seq 2048) with the MFU of each, and the
# chunked loss's memory at vocabularies 151,936 and 262,144.
# Prints one table and writes it to a file (default accelerator-<date>.txt; see bench/accelerator.py).
#
#   bash bench/accelerator.sh [--out FILE] [--smoke] [--moe 30b-a3b|26b-a4b]       PYTHON=... to use another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
exec timeout 570 "${PYTHON:-.venv/bin/python}" bench/accelerator.py "$@"
