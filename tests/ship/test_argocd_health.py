"""The Argo CD health check for LoRAJob, run by a real Lua 5.1 interpreter on Argo CD's test layout."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml

from lorajob_operator.validation import validate

REPO = Path(__file__).resolve().parents[2]


def _load_runner():
    spec = importlib.util.spec_from_file_location("argocd_health_runner", REPO / "argocd" / "run_health_tests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


runner = _load_runner()
CASES = runner.cases()


def test_there_is_a_case_for_every_phase_and_health():
    phases = {yaml.safe_load(c.input_path.read_text()).get("status", {}).get("phase") for c in CASES}
    assert {"Pending", "Queued", "Converting", "Training", "Exporting", "Succeeded", "Failed", "Suspended"} <= phases
    assert {c.status for c in CASES} == {"Healthy", "Progressing", "Degraded", "Suspended", "Unknown"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_health_case(case):
    got = runner.run_case(case)
    assert (got.status, got.message) == (case.status, case.message)


# unknown-phase stands for a status written by a newer operator than this CRD knows.
@pytest.mark.parametrize("case", [c for c in CASES if c.input_path.stem != "unknown-phase"], ids=lambda c: c.name)
def test_case_inputs_are_valid_lorajobs(case):
    """The inputs' spec and status are what the CRD's schema allows, not made-up shapes (metadata is
    ObjectMeta, checked by the API server itself rather than the CRD schema)."""
    obj = yaml.safe_load(case.input_path.read_text())
    obj["metadata"] = {"name": obj["metadata"]["name"]}
    assert [str(e) for e in validate(obj)] == []


def test_queued_by_kueue_is_progressing_not_suspended():
    queued = next(c for c in CASES if c.input_path.stem == "queued-by-kueue")
    assert runner.run_case(queued).status == "Progressing"


def test_script_errors_are_reported_not_passed(tmp_path):
    broken = tmp_path / "health.lua"
    broken.write_text("return obj.status.nothing.here\n")
    with pytest.raises(RuntimeError, match="health script error"):
        runner.run_health(broken, {"metadata": {"name": "x"}})


def test_the_runner_script_passes(tmp_path):
    assert runner.main([]) == 0


def test_lua_literal_escapes_strings():
    assert runner.lua_literal({"m": 'say "hi"\n\\', "n": None, "l": [1, 2.5, True]}) == (
        '{["m"]="say \\034hi\\034\\010\\092",["l"]={1,2.5,true}}'
    )


def test_argocd_cm_example_carries_the_same_script():
    cm = yaml.safe_load((REPO / "examples" / "gitops" / "argocd-cm-lorajob.yaml").read_text())
    script = (REPO / "argocd" / "resource_customizations" / "lorajob.dev" / "LoRAJob" / "health.lua").read_text()
    assert cm["data"]["resource.customizations.health.lorajob.dev_LoRAJob"] == script


@pytest.mark.parametrize("phase, health", [("Succeeded", "Healthy"), ("Failed", "Degraded"), ("Queued", "Progressing")])
def test_a_degraded_tracker_never_changes_the_health_and_a_failure_s_message_stays_its_own(phase, health):
    degraded = next(c for c in CASES if c.input_path.stem == "training-tracking-degraded")
    obj = yaml.safe_load(degraded.input_path.read_text())
    obj["status"] |= {"phase": phase, "message": f"{phase} message"}
    got = runner.run_health(degraded.script, obj)
    assert got.status == health
    assert (got.message == f"{phase} message") == (health == "Degraded")
    assert got.message.startswith(f"{phase} message")
