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


def test_a_dpo_row_passes_its_reference_adapters_and_measures_both_rows_of_each_pair(chip_bench, monkeypatch, tmp_path):
    monkeypatch.setitem(chip_bench.ROWS, "tiny/1x128/dpo", chip_bench.Row("tiny-qwen3", 1, 128, method="dpo"))
    plan = chip_bench.plan_row("tiny/1x128/dpo")
    result = chip_bench.measure("tiny/1x128/dpo", plan, steps=2, profile_dir=None, work=tmp_path)
    assert result["real_tokens_per_step"] == 2 * 128 and result["final_loss"] > 0  # a pair: two full rows


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


def test_the_profile_breakdown_counts_each_op_of_the_chips_op_track_for_its_own_time(chip_bench, tmp_path):
    """Three steps, each a fusion and a loop whose body runs the kernel, a fusion of the experts' ragged_dot and
    megablox' tgmm: the loop is counted for its own 20 us, not again for its body's 500."""
    def step(start: float) -> list[dict]:
        def op(name, offset, duration, **args):
            return {"ph": "X", "pid": 1, "tid": 7, "name": name, "ts": start + offset, "dur": duration, "args": args}

        return [
            op("fusion.1", 0, 600.0, hlo_category="convolution fusion"),
            op("while.3", 600, 520.0, hlo_category="while"),
            op("splash_mha_fwd", 610, 300.0, hlo_category="custom-call"),
            op("fusion.9", 910, 150.0, hlo_category="convolution fusion",
               tf_op="jit(step)/jvp(experts)/ragged_dot_general"),
            op("tgmm", 1060, 50.0, hlo_category="custom-call"),
        ]

    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Modules"}},
        *[event for i in range(3) for event in step(10_000.0 * i)],
        {"ph": "X", "pid": 1, "tid": 8, "name": "jit_train_step", "dur": 5000.0, "ts": 0},
        {"ph": "X", "pid": 2, "tid": 7, "name": "host work", "dur": 9000.0, "ts": 0},
    ]
    trace = tmp_path / "plugins" / "profile" / "run" / "perfetto_trace.json.gz"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    breakdown = chip_bench.op_breakdown(tmp_path)
    assert breakdown["track"] == "XLA Ops" and breakdown["device_us_per_step"] == pytest.approx(1120.0)
    assert [(name, us) for name, us, _ in breakdown["top"]] == [("fusion.1", 600.0), ("splash_mha_fwd", 300.0),
                                                               ("fusion.9", 150.0), ("tgmm", 50.0), ("while.3", 20.0)]
    assert [(name, us) for name, us, _ in breakdown["categories"]] == [("convolution fusion", 750.0),
                                                                        ("custom-call", 350.0), ("while", 20.0)]
    assert breakdown["grouped_matmul"] == [("ragged_dot (XLA)", 150.0, pytest.approx(150 / 1120)),
                                           ("gmm (Pallas megablox)", 50.0, pytest.approx(50 / 1120))]


def test_a_moe_row_is_the_real_model_cut_to_a_few_layers_with_its_adapters_kernel_chosen(chip_bench):
    """The MoE rows keep the released widths at fewer layers (Gemma 4's attention kinds cut to match) and, for
    Gemma 4, fewer experts (as many per token); a row that
    measures the other grouped-matmul kernel runs with its twin's plan and builds its experts' adapters in it."""
    import jax
    from flax import nnx
    from lorajob_trainer import run as run_lib
    from lorajob_trainer.contract import catalog
    from lorajob_trainer.models import experts

    released = catalog.released_config("gemma4-26b")
    cut = chip_bench.ROWS["gemma4-26b-6layers-64experts/2x2048"].hf_config
    assert cut["num_hidden_layers"] == 6 and cut["layer_types"] == released["layer_types"][:6]
    assert cut["num_experts"] == 64 and cut["top_k_experts"] == released["top_k_experts"] == 8
    kept = ("num_hidden_layers", "layer_types", "num_experts")
    assert {key: value for key, value in cut.items() if key not in kept} == {
        key: value for key, value in released.items() if key not in kept}
    for name, row in chip_bench.ROWS.items():
        if row.expert_adapter_kernel:
            assert row.plan_of in chip_bench.PLANNED_ROWS and name not in chip_bench.PLANNED_ROWS

    row = chip_bench.Row("tiny-qwen3-moe", 1, 64, layers=1)
    for kernel in ("pallas", "xla"):
        run = run_lib.abstract_run(chip_bench.train_config(row, "none"), row.hf_config, jax.devices()[:1],
                                   expert_adapter_kernel=kernel)
        linears = [module for _, module in nnx.iter_graph(run.model.model) if isinstance(module, experts.ExpertsLinear)]
        assert linears and {module.adapter_kernel for module in linears} == {kernel}
    with pytest.raises(ValueError, match="'megablox': pallas or xla"):
        experts.use_adapter_kernel(run.model.model, "megablox")


def test_the_table_of_several_calls_keeps_each_rows_success_and_lists_the_rows_not_measured(chip_bench, tmp_path,
                                                                                           capsys):
    """A row that failed in one call and was measured in a later one shows its measurement; a row no call measured
    is listed with the plan's figures; a failed child's error is its exception line, not the traceback's footer."""
    plan = {"remat": "full", "hbm_bytes": 12e9, "step_seconds": 0.5}
    measured = {"row": "qwen3-4b/2x2048", "remat": "full", "tokens_per_s": 4800.0, "mfu": 0.44,
                "peak_hbm_bytes": 10.4e9, "step_s": 0.85, "compile_s": 66.0, "host_wait_s_per_step": 0.0, "plan": plan}
    failed = {"row": "qwen3-4b/2x2048", "plan": plan, "error": chip_bench.last_error(
        "Traceback (most recent call last):\njax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: 22.46G\n----\n"
        "For simplicity, JAX has removed its internal frames from the traceback of the following exception.", 1)}
    assert failed["error"] == "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: 22.46G"
    (tmp_path / "a.json").write_text(json.dumps([failed]))
    (tmp_path / "b.json").write_text(json.dumps([measured]))
    (tmp_path / "plan.json").write_text(json.dumps({"qwen3-0.6b/1x8192": {**plan, "hbm_bytes": 13.5e9}}))
    chip_bench.main(["table", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--plan", str(tmp_path / "plan.json")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows[0].startswith("| qwen3-4b/2x2048 | full | 4,800 | 44.0 % | 10.40 | 12.00 | 0.87 |")
    assert not any("RESOURCE_EXHAUSTED" in row for row in rows)
    assert any(row.startswith("| qwen3-0.6b/1x8192 | full | not measured | | | 13.50 |") for row in rows)
    assert len(rows) == len(chip_bench.ROWS)  # the measured row and every other row of the bench, once each
