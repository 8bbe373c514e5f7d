"""Offline validation (`lorajob validate`) and the Python forms of the shared rules."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from lorajob_operator import api, cli, names, rules, step_commands, validation
from lorajob_operator.validation import validate
from lorajob_trainer.contract.records import (
    COLUMN_LAYOUTS, PREFERENCE_COLUMN_LAYOUTS, PREFERENCE_DEFAULTS, PREFERENCE_METHODS, TRAINING_METHODS,
)

REPO = Path(__file__).resolve().parents[2]
VALID = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "examples" / "invalid").glob("*.yaml"))


def expected_fragment(path: Path) -> str:
    return next(line.split("# expect:", 1)[1].strip() for line in path.read_text().splitlines() if line.startswith("# expect:"))


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_pass(path):
    doc = yaml.safe_load(path.read_text())
    assert validate(doc) == []
    api.LoRAJobSpec.model_validate(doc["spec"])  # the operator's typed view accepts it too


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_fail_with_their_message_alone(path):
    """Each invalid example shows one rule: its own, and no other (a run name too long, say) beside it."""
    errors = [str(error) for error in validate(yaml.safe_load(path.read_text()))]
    assert len(errors) == 1 and expected_fragment(path) in errors[0], errors


def test_cli_exit_codes(capsys):
    assert cli.main(["validate", *map(str, VALID)]) == 0
    assert cli.main(["validate", str(INVALID[0])]) == 1
    assert "is invalid" in capsys.readouterr().out


def _base() -> dict:
    return yaml.safe_load((REPO / "examples" / "qwen3-gsm8k.yaml").read_text())


def _with(doc: dict, run_name: str, *, backend="pathways", hf=True, export=True, restore_hf=False) -> dict:
    doc = copy.deepcopy(doc)
    spec = doc["spec"]
    spec["runName"] = run_name
    spec["compute"]["backend"] = backend
    if not hf:
        spec["model"].pop("huggingFace")
        spec["model"]["maxtextCheckpoint"] = "gs://b/ckpt/0/items"
    if restore_hf:
        spec["lora"]["restoreFrom"] = {"huggingFace": "org/adapter"}
    spec["export"] = {"enabled": export}
    return doc


CASES = [
    # (backend, base from HF, export, restore HF adapter) -> limit
    (("pathways", True, True, False), 20),
    (("pathways", False, False, True), 20),
    (("pathways", False, True, False), 22),
    (("pathways", False, False, False), 22),
    (("mcjax", False, True, False), 22),
    (("mcjax", False, False, False), 22),  # the check step's JobSet
    (("mcjax", True, False, False), 20),
]


@pytest.mark.parametrize("flags,limit", CASES, ids=[f"{c[0]}-limit{c[1]}" for c in CASES])
def test_run_name_limit_is_exact_and_python_agrees_with_cel(flags, limit):
    backend, hf, export, restore = flags
    for length, accepted in ((limit, True), (limit + 1, False)):
        doc = _with(_base(), "r" * length, backend=backend, hf=hf, export=export, restore_hf=restore)
        cel_errors = [e for e in validate(doc) if "run name" in e.detail]
        spec = api.LoRAJobSpec.model_validate(doc["spec"])
        python_errors = rules.run_name_errors(doc["spec"]["runName"], spec)
        assert (cel_errors == []) == accepted, cel_errors
        assert (python_errors == []) == accepted
        if not accepted:
            assert f"at most {limit} characters are allowed" in cel_errors[0].detail
            assert cel_errors[0].detail == f'"object": {python_errors[0]}'


def test_limits_follow_from_their_derivation():
    assert names.pathways_coordinator("x" * names.PATHWAYS_NAME_MAX).__len__() <= names.LABEL_VALUE_MAX
    assert len(names.pathways_coordinator("x" * (names.PATHWAYS_NAME_MAX + 1))) > names.LABEL_VALUE_MAX
    for phase in rules.PHASES:
        assert len(names.child_name("x" * 20, phase)) <= names.WORKLOAD_NAME_MAX


def test_metadata_name_is_the_default_run_name():
    doc = _base()
    doc["metadata"]["name"] = "a" * 21  # convert step present: limit 20
    assert any("at most 20" in e.detail for e in validate(doc))
    doc["spec"]["runName"] = "short"
    assert validate(doc) == []


@pytest.mark.parametrize("needs_convert", [True, False])
def test_phases(needs_convert):
    doc = _with(_base(), "r", hf=needs_convert)
    spec = api.LoRAJobSpec.model_validate(doc["spec"])
    assert rules.phases(spec) == ["convert" if needs_convert else "check", "train", "export"]


def test_every_tpu_topology_rule_accepts_its_own_topologies():
    from lorajob_operator.accelerators import TPU_MACHINES

    for machine_type, machine in TPU_MACHINES.items():
        for topology in machine.topologies:
            doc = _base()
            doc["spec"]["compute"]["tpu"] = {"machineType": machine_type, "topology": topology}
            assert validate(doc) == [], (machine_type, topology)


def test_metadata_fields_other_than_name_are_free_form():
    doc = _base()
    doc["metadata"].update({"namespace": "team-a", "labels": {"app": "x"}, "annotations": {"a": "b"}})
    assert validate(doc) == []


def test_cli_reads_yaml_1_2_floats_as_kustomize_writes_them(tmp_path):
    text = (REPO / "examples" / "qwen3-gsm8k.yaml").read_text().replace("learningRate: 3.0e-6", "learningRate: 3e-06")
    assert "3e-06" in text
    (tmp_path / "job.yaml").write_text(text)
    assert cli.load_documents(text)[0]["spec"]["training"]["learningRate"] == 3e-06
    assert cli.main(["validate", str(tmp_path / "job.yaml")]) == 0


# --- Preference tuning: spec.method, spec.preference and the dataset layout ----------------------------------

METHODS = (None, *TRAINING_METHODS)
"""None: spec.method left out (sft)."""
LAYOUTS = COLUMN_LAYOUTS + PREFERENCE_COLUMN_LAYOUTS
PREFERENCES = (
    None, {}, {"beta": 0.2}, {"lossType": "ipo"}, {"lossType": "robust", "labelSmoothing": 0.1},
    {"labelSmoothing": 0.1}, {"labelSmoothing": 0}, {"lossType": "sigmoid", "labelSmoothing": 0.0}, {"orpoLambda": 0.5},
    {"beta": 0.05, "lossType": "robust", "labelSmoothing": 0.2}, {"lossType": "robust", "labelSmoothing": 0.5},
    {"lossType": "robust", "labelSmoothing": 1},
)
"""`labelSmoothing: 0` and `1` as the integers YAML reads: the server hands CEL a number field as a double (and
compares an integer with a fractional schema bound cut to an integer, which the CRD therefore leaves to CEL)."""


def preference_doc(method: str | None, columns: tuple[str, ...], preference: dict | None) -> dict:
    doc = _base()
    doc["spec"]["dataset"] = {"name": "trl-lib/ultrafeedback_binarized", "columns": list(columns)}
    if method is not None:
        doc["spec"]["method"] = method
    if preference is not None:
        doc["spec"]["preference"] = preference
    return doc


def preference_refusals(method: str | None, columns: tuple[str, ...], preference: dict | None) -> set[str]:
    """What the rules say of a combination, written out in Python: the fragment of each message expected."""
    method = method or "sft"
    preferring = method in PREFERENCE_METHODS
    preference_set = preference or {}
    refused = set()
    if preferring != (columns in PREFERENCE_COLUMN_LAYOUTS):
        refused.add("spec.method and dataset.columns do not match")
    if preference is not None and not preferring:
        refused.add("spec.preference applies to method dpo or orpo only")
    if method == "orpo" and preference_set.keys() & {"beta", "lossType", "labelSmoothing"}:
        refused.add("are DPO's and spec.method is orpo")
    if method == "dpo" and "orpoLambda" in preference_set:
        refused.add("preference.orpoLambda is ORPO's")
    if preference_set.get("labelSmoothing") and preference_set.get("lossType") != "robust":
        refused.add("preference.labelSmoothing needs preference.lossType robust")
    if preference_set.get("labelSmoothing", 0) >= api.LABEL_SMOOTHING_BELOW:
        refused.add("preference.labelSmoothing must be below 0.5")
    return refused


PREFERENCE_CASES = [(m, c, p) for m in METHODS for c in LAYOUTS for p in PREFERENCES]


def _case_id(case) -> str:
    method, columns, preference = case
    return f"{method}-{'+'.join(columns)}-{json.dumps(preference, separators=(',', ':'))}"


@pytest.mark.parametrize("case", PREFERENCE_CASES, ids=map(_case_id, PREFERENCE_CASES))
def test_method_layout_and_preference_rules_refuse_exactly_what_they_say(case):
    """Every method with every layout and preference settings: each rule refuses its combinations, with its reason
    and no other; what the rules accept, the operator parses and the trainer's config accepts with the same
    settings (those left unset at the trainer's defaults)."""
    errors = [error.detail for error in validate(preference_doc(*case))]
    expected = preference_refusals(*case)
    assert len(errors) == len(expected) and all(any(f in e for e in errors) for f in expected), (errors, expected)
    if expected:
        return
    doc = preference_doc(*case)
    spec = api.LoRAJobSpec.model_validate(doc["spec"])
    assert validation.parse_spec(doc)[1] == ()
    config = step_commands.train_config(spec, "r")
    method, _, preference = case
    assert config.method == (method or "sft")
    if config.method in PREFERENCE_METHODS:
        settings = config.preference.model_dump()
        for field, key in (("beta", "beta"), ("lossType", "loss_type"), ("labelSmoothing", "label_smoothing"),
                           ("orpoLambda", "orpo_lambda")):
            assert settings[key] == (preference or {}).get(field, getattr(PREFERENCE_DEFAULTS, key)), (field, settings)
    else:
        assert config.preference == type(config.preference)()  # the trainer's defaults, unused by sft


def test_an_integer_number_field_compares_as_the_server_compares_it():
    """A number field written as an integer reaches CEL as a double, as on the API server (celpy alone would keep an
    int, which no double compares with)."""
    doc = preference_doc("dpo", ("chosen", "rejected"), {"labelSmoothing": 0})
    assert validate(doc) == []
    assert validation.as_cel_sees({"a": 0, "b": [1], "c": True}, {"type": "object", "properties": {
        "a": {"type": "number"}, "b": {"type": "array", "items": {"type": "number"}}, "c": {"type": "boolean"}}}) == {
        "a": 0.0, "b": [1.0], "c": True}
    # The server's schema check meets an integer with a fractional bound cut to an integer (0 is not below 0.5 there).
    errors: list = []
    validation._check_schema(0, {"type": "number", "maximum": 0.5, "exclusiveMaximum": True}, "x", errors)
    assert [error.detail for error in errors] == ["0: x in body should be less than 0"]
