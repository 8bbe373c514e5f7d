"""An adapter trained on a TPU chip gives PEFT's logits on a CPU (issue 40, item 2: the last of the chip's checks).

tests/chip/test_on_chip.py, run on the chip with LORAJOB_CHIP_OUT=DIR, trains the tiny Qwen3 there, exports the
adapter with lorajob_trainer.export and writes to DIR (flat): adapter_config.json and adapter_model.safetensors,
the base it was trained on (config.json, model.safetensors), and chip_logits.json: our model's float32 logits of a
fixed prompt with that adapter, computed on the chip machine's CPU. The chip machine has no torch; here
transformers + PEFT load the same base and adapter and must give the same logits (test_parity's tolerance).

    LORAJOB_CHIP_ADAPTER=DIR .venv/bin/python -m pytest -n 0 tests/trainer/test_chip_adapter.py

Skipped without LORAJOB_CHIP_ADAPTER (CI has no chip's files).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_parity import ATOL, load_hf, torch_logits

pytestmark = pytest.mark.torch
CHIP_FILES = os.environ.get("LORAJOB_CHIP_ADAPTER")
BASE_FILES = ("config.json", "model.safetensors")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.mark.skipif(
    not CHIP_FILES,
    reason="LORAJOB_CHIP_ADAPTER names no directory of a chip run's files "
    "(tests/chip/test_on_chip.py writes them where LORAJOB_CHIP_OUT says)",
)
def test_peft_gives_the_logits_the_chip_computed_with_its_adapter(tmp_path):
    from peft import PeftModel

    source = Path(CHIP_FILES)
    # Apart: transformers would take a directory holding adapter_config.json for an adapter, not a base.
    for names, directory in ((BASE_FILES, tmp_path / "base"), (ADAPTER_FILES, tmp_path / "adapter")):
        directory.mkdir()
        for name in names:
            shutil.copyfile(source / name, directory / name)
    chip = json.loads((source / "chip_logits.json").read_text())
    ids = np.asarray(chip["prompt_ids"])
    ours = np.asarray(chip["logits"], np.float32)

    base = load_hf(tmp_path / "base")
    base_logits = torch_logits(base, ids)
    peft_logits = torch_logits(PeftModel.from_pretrained(base, tmp_path / "adapter"), ids)
    assert ours.shape == peft_logits.shape == (*ids.shape, base.config.vocab_size)
    assert np.abs(ours - base_logits).max() > 100 * ATOL, "the trained adapter changes the logits"
    np.testing.assert_allclose(ours, peft_logits, atol=ATOL, rtol=0)
