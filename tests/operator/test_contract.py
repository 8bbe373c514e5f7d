"""The operator and the trainer share one contract (`lorajob_trainer.contract`): a LoRAJob that leaves a setting
unset trains exactly as `python -m lorajob_trainer.train` does, both sides agree on every path of a run, and
no path or shared default is written anywhere else."""

from __future__ import annotations

import ast
from pathlib import Path

import pydantic
import pytest

from builders import spec_dict
from lorajob_operator import api, step_commands
from lorajob_trainer.contract import environment, records
from lorajob_trainer.contract.config import ConfigError, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (ROOT / "operator" / "lorajob_operator", ROOT / "trainer" / "lorajob_trainer")
RUN_PATH_READERS = PACKAGES + (ROOT / "devcluster" / "lorajob_devcluster", ROOT / "scripts")
"""Code that finds a run's files: the demo and the local pod runner too."""
CONTRACT_RECORDS = ROOT / "trainer" / "lorajob_trainer" / "contract" / "records.py"
"""Where the run's layout is spelled (`RunLayout`)."""

SET_BY_THE_OPERATOR = {
    "run_name", "base_output_directory", "model_name", "load_parameters_path", "tokenizer_path",  # from the spec
    "hf_path", "hf_data_dir", "train_data_columns", "steps",  # required fields, or the example's own choice
    "progress_lines",  # the operator reads progress from the pod log; a person at a terminal gets a bar
}


def _minimal_spec(**overrides) -> api.LoRAJobSpec:
    return api.LoRAJobSpec.model_validate(spec_dict(**overrides))


def _flat(config: TrainConfig) -> dict:
    values = config.model_dump()
    nested = {f"{section}.{key}": value for section in ("lora", "mesh") for key, value in values.pop(section).items()}
    return {**values, **nested}


def test_a_lorajob_that_sets_nothing_trains_with_the_trainers_own_defaults():
    rendered = _flat(step_commands.train_config(_minimal_spec(), "run-1"))
    defaults = _flat(TrainConfig.model_construct())  # the declared defaults, no validation of required keys
    differing = {key: (rendered[key], defaults.get(key)) for key in rendered
                 if key not in SET_BY_THE_OPERATOR and rendered[key] != defaults.get(key)}
    assert differing == {}, f"LoRAJob default != trainer default (rendered, trainer): {differing}"


def test_every_shared_default_is_taken_from_the_contract_by_both_sides():
    sources = {path.name: path.read_text() for path in (PACKAGES[0] / "api.py", PACKAGES[1] / "contract" / "config.py")}
    for name in records.Defaults.__dataclass_fields__:
        for file, text in sources.items():
            assert f"DEFAULTS.{name}" in text, f"{file} does not take its {name} default from the contract"


def test_every_preference_default_is_taken_from_the_contract_by_both_sides():
    sources = {path.name: path.read_text() for path in (PACKAGES[0] / "api.py", PACKAGES[1] / "contract" / "config.py")}
    for name in records.PreferenceDefaults.__dataclass_fields__:
        for file, text in sources.items():
            assert f"PREFERENCE_DEFAULTS.{name}" in text, f"{file} does not take its preference {name} default from the contract"
    assert api.PreferenceSpec().trainer_settings() == TrainConfig.model_fields["preference"].default.model_dump()


@pytest.mark.parametrize(("field", "trainer_key", "accepted", "refused"), [
    ("training.maxTargetLength", "max_target_length", (16, 1_048_576), (15, 1_048_577)),
    ("lora.rank", "lora.lora_rank", (1, 1024), (0, 1025)),
    ("training.warmupStepsFraction", "warmup_steps_fraction", (0.0, 0.99), (-0.1, 1.0)),
    ("preference.beta", "preference.beta", (1e-6, 50.0), (0.0, -0.1)),
    ("preference.orpoLambda", "preference.orpo_lambda", (1e-6, 50.0), (0.0, -0.1)),
])
def test_the_api_and_the_trainer_accept_the_same_values_of_a_shared_field(field, trainer_key, accepted, refused):
    section, key = field.split(".")
    for value in (*accepted, *refused):
        spec = _minimal_spec().model_dump(by_alias=True, exclude_none=True)
        spec.setdefault(section, {})[key] = value
        try:
            api.LoRAJobSpec.model_validate(spec)
            api_accepts = True
        except pydantic.ValidationError:
            api_accepts = False
        try:
            TrainConfig.from_args(["model_name=qwen3-0.6b", "load_parameters_path=/m", "base_output_directory=/o",
                                   "run_name=r", "steps=1", "hf_path=json", f"{trainer_key}={value}"])
            trainer_accepts = True
        except ConfigError:
            trainer_accepts = False
        assert api_accepts == trainer_accepts == (value in accepted), (field, value, api_accepts, trainer_accepts)


def test_operator_and_trainer_agree_on_every_path_of_a_run():
    spec = _minimal_spec(lora={"restoreFrom": {"huggingFace": "someone/adapter"}})
    paths = step_commands.run_paths(spec, "run-1")
    assert paths.run_directory == "gs://bucket/runs/run-1"
    assert (paths.checkpoints, paths.converted_base, paths.converted_adapter, paths.adapter_export) == (
        "gs://bucket/runs/run-1/checkpoints", "gs://bucket/runs/run-1/base",
        "gs://bucket/runs/run-1/restore-adapter", "gs://bucket/runs/run-1/huggingface")
    local = TrainConfig.model_construct(base_output_directory="/data/runs", run_name="run-1")
    assert str(local.checkpoint_directory) == "/data/runs/run-1/checkpoints"  # a local path, not a URI


def _path_parts(path: Path) -> set[str]:
    """String constants used to build a path: an operand of `/`, an argument of a join or of Path(...), or a
    piece of an f-string after a slash."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            operands = [node.left, node.right]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("join", "Path"):
            operands = node.args
        elif isinstance(node, ast.JoinedStr):
            operands = [value for value in node.values if isinstance(value, ast.Constant)]
            parts |= {piece for value in operands for piece in str(value.value).split("/")[1:]}
            continue
        else:
            continue
        parts |= {operand.value for operand in operands if isinstance(operand, ast.Constant) and isinstance(operand.value, str)}
    return parts


def test_no_run_path_is_spelled_outside_the_contract():
    layout = records.RunLayout("BASE", "RUN")
    names = {getattr(layout, name).removeprefix("BASE/RUN/") for name, member in vars(records.RunLayout).items()
             if isinstance(member, property) and name != "run_directory"}
    offenders = {}
    for package in RUN_PATH_READERS:
        for path in package.rglob("*.py"):
            if path == CONTRACT_RECORDS:
                continue
            found = names & _path_parts(path)
            if found:
                offenders[str(path.relative_to(ROOT))] = sorted(found)
    assert offenders == {}, f"run paths spelled outside {CONTRACT_RECORDS.relative_to(ROOT)}: {offenders}"


@pytest.mark.parametrize("record", [
    records.ProgressRecord(step=3, total_steps=10, loss=1.5, tokens_per_second=900.0, eta_seconds=12.0,
                            state="running", eval_loss=1.7, updated=1.0),
    records.ProgressRecord(step=10, total_steps=10, state="failed", message="dataset has no column 'messages'"),
])
def test_a_progress_record_reads_back_as_written(record):
    assert records.ProgressRecord.from_line("some prefix " + record.line()) == record


def test_a_data_record_reads_back_as_written_and_a_garbled_one_not_at_all():
    record = records.DataRecord(examples=7473, tokens=1402116, trained_tokens=512330, epochs=4.28,
                                 truncated_examples=12, truncated_share=0.003)
    log = f"data check passed: ...\npod log timestamp {record.line()}\nconverting the checkpoint\n"
    assert records.last_data(log) == record
    assert records.last_data(record.line()[:-5]) is None  # cut short
    negative = record.line().replace('"examples":7473', '"examples":-1')
    assert records.DataRecord.from_line(negative) is None
    assert records.DataRecord.from_line(record.line().replace("4.28", "NaN")) is None
    assert records.last_data("no data line") is None


def test_a_plan_record_reads_back_as_written_and_a_garbled_one_not_at_all():
    record = records.PlanRecord(fits=False, target="v5e 1x1 (1 chips)", chips=1, hbm_bytes_per_chip=None,
                                 capacity_bytes=15_461_882_265, compile_seconds=12.5, suggestion="v5e 2x2 (4 chips)")
    assert records.last_plan(f"data check passed\n{record.line()}\n") == record
    assert records.last_plan(record.line()[:-3]) is None
    assert records.PlanRecord.from_line(record.line().replace('"fits":false', '"fits":"no"')) is None
    assert records.PlanRecord.from_line(record.line().replace('"chips":1', '"chips":-1')) is None


def test_a_named_token_that_did_not_arrive_is_reported_by_name():
    source = {"LORAJOB_HF_TOKEN_SECRET": "hf-token/token"}
    assert environment.missing_credentials(source) == (
        "the Hugging Face token is missing: no Secret hf-token with a non-empty key token in the LoRAJob's namespace "
        "(spec.credentials.huggingFaceToken)")
    assert environment.missing_credentials({**source, environment.HF_TOKEN_ENV: ""}) is not None
    assert environment.missing_credentials({**source, environment.HF_TOKEN_ENV: "hf_x"}) is None
    assert environment.missing_credentials({}) is None  # no token named


def test_every_credential_that_did_not_arrive_is_reported_by_name():
    named = {credential.source_variable: f"s-{credential.variable.lower()}/k" for credential in environment.CREDENTIALS}
    missing = environment.missing_credentials(named).split("; ")
    assert [m.split(" is missing")[0] for m in missing] == [c.what for c in environment.CREDENTIALS]
    assert all(f"(spec.credentials.{c.field})" in m for c, m in zip(environment.CREDENTIALS, missing))
    arrived = {**named, **{credential.variable: "x" for credential in environment.CREDENTIALS[1:]}}
    assert environment.missing_credentials(arrived).startswith("the Hugging Face token is missing")


def test_every_tracker_of_the_contract_has_its_spec_status_and_name():
    assert tuple(api.TrackingSpec.model_fields) == tuple(api.TrackingStatus.model_fields) == records.TRACKERS
    assert tuple(api.TRACKER_TITLES) == records.TRACKERS


def test_the_credentials_the_api_names_are_the_contract_s():
    assert [field.alias for field in api.Credentials.model_fields.values()] == [c.field for c in environment.CREDENTIALS]


def test_non_finite_numbers_are_written_as_unknown():
    record = records.ProgressRecord(step=1, total_steps=2, loss=float("nan"), eta_seconds=float("inf"))
    assert (record.loss, record.eta_seconds) == (None, None)
    assert records.ProgressRecord.from_line(record.line()) == record
