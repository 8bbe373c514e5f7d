"""`lorajob plan`'s side of the fit check: it runs `python -m lorajob_trainer.fit --json` in a child process (here a
stand-in module, so that no JAX runs) with the catalogue's config.json facts, reads the plan back into the contract's
dataclasses, and says in one line why no plan was made. tests/trainer/test_plan_cli.py runs the real check."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from builders import GPU, lorajob, spec_dict
from lorajob_operator import cli, names, planning, step_commands, validation
from lorajob_trainer.contract import catalog, fit

STAND_IN = textwrap.dedent('''
    """What `python -m lorajob_trainer.fit --json` prints, from its arguments alone (no compile)."""
    import argparse, json, pathlib, sys

    from lorajob_trainer.contract.fit import Attempt, Outcome, Plan, Request, TpuChip

    parser = argparse.ArgumentParser()
    parser.add_argument("--request", required=True)
    parser.add_argument("--model-config", required=True)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("config", nargs="*")
    args = parser.parse_args()
    pathlib.Path(sys.argv[0]).with_name("seen.json").write_text(json.dumps({
        "json": args.json, "config": args.config,
        "hf_config": json.loads((pathlib.Path(args.model_config) / "config.json").read_text())}))
    ANSWER
''')


def _stand_in(tmp_path, monkeypatch, answer: str) -> None:
    (tmp_path / "stand_in_fit.py").write_text(STAND_IN.replace("ANSWER", answer))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setattr(planning, "FIT_CHECK", "stand_in_fit")


FITS = '''
request = Request.from_json(args.request)
kind = "tpu" if isinstance(request.chip, TpuChip) else "gpu"
attempt = Attempt(request.targets[0], fits=True, capacity_bytes=2, total_bytes=1, memory={"arguments": 1},
                  remat_policy="full", remat_rejected=("none: too much", "minimal: too much"), error=kind)
print("a line of JAX's own before the outcome")
print(Outcome(plan=Plan(attempt, [])).to_json())
'''


def test_the_plan_the_check_prints_is_read_back_with_the_catalogues_config_and_the_lorajobs_own_config(
        tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, FITS)
    doc = lorajob(spec=spec_dict())
    result = planning.plan_lorajob(doc)
    attempt = result.plan.attempt
    spec = validation.parse_spec(doc)[0]
    assert attempt.target == step_commands.plan_request(spec).targets[0] and attempt.error == "tpu"
    assert attempt.remat_rejected == ("none: too much", "minimal: too much") and result.plan.tried == []
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["json"] and seen["hf_config"] == catalog.released_config("qwen3-0.6b")
    assert seen["config"] == step_commands.train_config(spec, names.run_name(spec, "qwen3-gsm8k")).to_args()
    assert json.loads(json.dumps(result.to_dict()))["plan"]["remat_rejected"] == ["none: too much", "minimal: too much"]


def test_a_gpu_lorajob_asks_the_check_for_the_analytic_estimate_with_the_gpus_chip(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, FITS)
    result = planning.plan_lorajob(lorajob(spec=spec_dict(compute={"backend": "gpu", "gpu": dict(GPU)})))
    target = result.plan.attempt.target
    assert result.plan.attempt.error == "gpu"  # a plain Chip: lorajob_trainer.fit estimates, compiles nothing
    assert (target.machine_type, target.chips) == (GPU["accelerator"], GPU["nodes"] * GPU["gpusPerNode"])


def test_packages_the_check_misses_give_the_install_hint(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, "print(Outcome(no_plan=\"No module named 'jax'\", packages_missing=True).to_json())")
    with pytest.raises(planning.PlanUnavailable) as raised:
        planning.plan_lorajob(lorajob())
    assert str(raised.value) == f"{planning.INSTALL_HINT} (No module named 'jax')"


def test_a_topology_libtpu_lacks_is_said_as_the_check_says_it(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, "print(Outcome(no_plan='cannot describe TPU topology').to_json())")
    with pytest.raises(planning.PlanUnavailable, match="^cannot describe TPU topology$"):
        planning.plan_lorajob(lorajob())


def test_a_missing_trainer_is_one_line_saying_the_check_could_not_import_and_how_to_install(monkeypatch):
    monkeypatch.setattr(planning, "FIT_CHECK", "lorajob_trainer.no_such_check")
    with pytest.raises(planning.PlanUnavailable) as raised:
        planning.plan_lorajob(lorajob())
    message = str(raised.value)
    assert message.startswith(f"{planning.INSTALL_HINT} (python -m lorajob_trainer.no_such_check could not import: ")
    assert "No module named" in message and "\n" not in message


def test_a_check_that_fails_otherwise_says_its_exit_code_and_last_line(tmp_path, monkeypatch):
    _stand_in(tmp_path, monkeypatch, "print('first', file=sys.stderr); print('the last word', file=sys.stderr); sys.exit(3)")
    with pytest.raises(planning.PlanUnavailable,
                       match="^python -m stand_in_fit failed with exit code 3: the last word$"):
        planning.plan_lorajob(lorajob())


def test_lorajob_plan_exits_2_with_one_line_per_lorajob_without_a_plan(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(planning, "FIT_CHECK", "lorajob_trainer.no_such_check")
    path = tmp_path / "lorajob.yaml"
    path.write_text(json.dumps(lorajob()))
    assert cli.plan_files([path], as_json=False) == cli.NO_PLAN
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"{path}: {planning.INSTALL_HINT}")


def test_an_outcome_reads_back_as_written():
    target = fit.Target("ct6e-standard-4t", "4x4", 1, 16, 2, 1, "auto")
    plan = fit.Plan(fit.Attempt(target, fits=False, capacity_bytes=2, total_bytes=3, memory={"batch": 1},
                                remat_policy="full", remat_rejected=("none: 3 > 2",)),
                    [fit.Attempt(target, fits=True, capacity_bytes=2, analytic=True)])
    for outcome in (fit.Outcome(plan=plan), fit.Outcome(no_plan="no libtpu", packages_missing=True)):
        assert fit.Outcome.from_json(outcome.to_json()) == outcome
    for chip in (fit.Chip(1, 2.0, 3.0, 4.0), fit.TpuChip(1, 2.0, 3.0, 4.0, "v6e", 2)):
        request = fit.Request(chip, 4, (target,))
        assert fit.Request.from_json(request.to_json()) == request
        assert type(fit.Request.from_json(request.to_json()).chip) is type(chip)
