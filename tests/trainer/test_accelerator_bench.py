"""bench/accelerator.sh starts and fills its table on CPU at tiny sizes (the device run uses the same code)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.large
def test_accelerator_script_runs_every_piece_and_writes_its_table(tmp_path):
    out = tmp_path / "table.txt"
    completed = subprocess.run(["bash", str(REPO_ROOT / "bench" / "accelerator.sh"), "--smoke", "--out", str(out)],
                               capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    table = out.read_text()
    assert table in completed.stdout
    rows = [line.split() for line in table.splitlines()[2:]]
    assert [row[:3] for row in rows[:4]] == [
        ["train", "step", "ours"], ["train", "step", "HF+PEFT"],
        ["moe", "tiny-moe", "ours"], ["moe", "tiny-moe", "HF+PEFT"],
    ]
    assert all(float(row[4]) > 0 for row in rows[:4]), table
    assert [row[3] for row in rows[4:]] == ["full-logits", "chunked"], table
