"""bench/chip_bench.py's code on the CPU (the chip's figures come from running it on a TPU: README): a tiny row
planned by the TPU compiler without a TPU, then measured here through the trainer's data loader, and its table;
the profile's op breakdown read from a Perfetto trace of the shape jax.profiler writes."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "chip_bench.py"


@pytest.fixture
def chip_bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("chip_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "chip_bench", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setitem(module.ROWS, "tiny/2x256/feed", module.Row("tiny-qwen3", 2, 256, feed=True))
    return module


def test_a_row_is_planned_for_a_v5e_chip_then_measured_through_the_data_loader(chip_bench, tmp_path):
    plan = chip_bench.plan_row("tiny/2x256/feed")
    assert plan["fits"] and plan["remat"] == "none" and plan["remat_rejected"] == []  # a tiny model needs no remat
    assert 0 < plan["hbm_bytes"] < plan["capacity_bytes"] and plan["step_seconds"] > 0

    result = chip_bench.measure("tiny/2x256/feed", plan, steps=2, profile_dir=None, work=tmp_path)
    assert result["remat"] == "none" and result["final_loss"] > 0
    assert 0 < result["real_tokens_per_step"] <= 2 * 256  # packed rows: real tokens, padding left out
    assert result["tokens_per_s"] > 0 and result["host_wait_s_per_step"] >= 0
    assert result["chip_compiled_hbm_bytes"] > 0
    lines = chip_bench.table([result, {"row": "failed/1x8", "error": "RESOURCE_EXHAUSTED: 17.1G", "plan": plan}])
    assert lines[2].startswith("| tiny/2x256/feed | none | ") and "RESOURCE_EXHAUSTED" in lines[3]


def test_the_profile_breakdown_sums_the_chips_op_track(chip_bench, tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Modules"}},
        *[{"ph": "X", "pid": 1, "tid": 7, "name": "fusion.1", "dur": 600.0, "ts": i} for i in range(3)],
        *[{"ph": "X", "pid": 1, "tid": 7, "name": "splash_mha_fwd", "dur": 300.0, "ts": i} for i in range(3)],
        {"ph": "X", "pid": 1, "tid": 8, "name": "jit_train_step", "dur": 5000.0, "ts": 0},
        {"ph": "X", "pid": 2, "tid": 7, "name": "host work", "dur": 9000.0, "ts": 0},
    ]
    trace = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    breakdown = chip_bench.op_breakdown(tmp_path)
    assert breakdown["track"] == "XLA Ops" and breakdown["device_us_per_step"] == pytest.approx(900.0)
    assert [(name, us) for name, us, _ in breakdown["top"]] == [("fusion.1", 600.0), ("splash_mha_fwd", 300.0)]
