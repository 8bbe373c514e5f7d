"""Trainer config: key=value parsing on top of YAML, errors that name the key, no JAX import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lorajob_trainer.contract.config import ConfigError, TrainConfig, all_keys, resolve_target_modules

REQUIRED = [
    "run_name=demo",
    "base_output_directory=/tmp/out",
    "model_name=tiny-qwen3",
    "load_parameters_path=/models/tiny",
    "hf_train_files=[/data/train.jsonl]",
    "steps=10",
]


def parse(*overrides: str, base_yaml: Path | None = None) -> TrainConfig:
    return TrainConfig.from_args([*REQUIRED, *overrides], base_yaml=base_yaml)


def test_maxtext_style_overrides_parse_into_typed_fields():
    config = parse(
        "train_data_columns=['question','answer']",
        "lora.lora_rank=8",
        "lora.lora_alpha=16",
        "learning_rate=1e-4",
        "per_device_batch_size=2",
        "checkpoint_storage_use_zarr3=False",
        "mesh.fsdp=2",
    )
    assert config.train_data_columns == ["question", "answer"]
    assert config.lora.lora_rank == 8 and config.lora.lora_alpha == 16.0
    assert config.learning_rate == pytest.approx(1e-4)
    assert config.checkpoint_storage_use_zarr3 is False
    assert config.mesh.fsdp == 2
    assert config.checkpoint_directory == Path("/tmp/out/demo/checkpoints")


def test_string_values_are_never_reinterpreted_as_yaml():
    config = parse("lora.lora_module_path=.*(q_proj|v_proj)", "run_name=123", "hf_path=*star")
    assert config.lora.lora_module_path == ".*(q_proj|v_proj)"
    assert config.run_name == "123"
    assert config.hf_path == "*star"


def test_to_args_round_trips():
    config = parse("train_data_columns=['prompt','completion']", "lora.target_modules=[q_proj,v_proj]",
                   "hf_eval_files=[/data/eval dir]", "eval_interval=5", "dtype=bfloat16")
    assert TrainConfig.from_args(config.to_args()) == config


def test_yaml_file_then_command_line_overrides(tmp_path):
    config_file = tmp_path / "train.yaml"
    config_file.write_text(
        "run_name: from-yaml\nsteps: 3\nlora:\n  lora_rank: 4\n  lora_alpha: 8\n"
        "lora.lora_restore_path: /adapters/x\n"
    )
    config = TrainConfig.from_args([str(config_file), *REQUIRED[1:5], "lora.lora_rank=2"])
    assert config.run_name == "from-yaml"
    assert config.steps == 3
    assert config.lora.lora_rank == 2
    assert config.lora.lora_alpha == 8.0
    assert config.lora.lora_restore_path == "/adapters/x"


def test_base_yaml_is_below_the_config_file(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("learning_rate: 0.5\nwarmup_steps_fraction: 0.2\n")
    task = tmp_path / "task.yaml"
    task.write_text("learning_rate: 0.25\n")
    config = TrainConfig.from_args([str(task), *REQUIRED], base_yaml=base)
    assert config.learning_rate == 0.25
    assert config.warmup_steps_fraction == 0.2


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        pytest.param(["lora.lora_rnak=4"], "lora.lora_rnak", id="unknown-nested-key"),
        pytest.param(["learning_rat=1"], "learning_rat", id="unknown-top-level-key"),
        pytest.param(["mesh.fsdp.x=1"], "mesh.fsdp.x", id="sub-key-of-a-scalar"),
        pytest.param(["steps"], "steps", id="missing-equals"),
        pytest.param(["=3"], "=3", id="missing-key"),
        pytest.param(["steps=ten"], "steps", id="not-an-integer"),
        pytest.param(["lora.lora_rank=0"], "lora.lora_rank", id="rank-zero"),
        pytest.param(["train_data_columns=['a','b']"], "train_data_columns", id="unknown-layout"),
        pytest.param(["train_data_columns=[a, b"], "train_data_columns", id="malformed-list"),
        pytest.param(["model_name=gpt-9"], "gpt-9", id="unknown-model"),
        pytest.param(["dtype=float8"], "dtype", id="bad-literal"),
        pytest.param(["eval_interval=5"], "eval_interval", id="eval-without-data"),
        pytest.param(["lora.enable_lora=false"], "lora.enable_lora", id="full-finetuning"),
        pytest.param(["lora.lora_module_path=.*q", "lora.target_modules=[q_proj]"], "lora", id="two-selectors"),
        pytest.param(["mesh.data=0"], "mesh.data", id="zero-axis"),
    ],
)
def test_bad_keys_and_values_fail_naming_the_key(overrides, named):
    with pytest.raises(ConfigError) as raised:
        parse(*overrides)
    assert named in str(raised.value)


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError, match="steps: required key is missing"):
        TrainConfig.from_args([arg for arg in REQUIRED if not arg.startswith("steps=")])


def test_unknown_key_in_yaml_names_key_and_file(tmp_path):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text("lora:\n  rank: 4\n")
    with pytest.raises(ConfigError, match=r"lora\.rank.*bad\.yaml"):
        TrainConfig.from_args([str(config_file), *REQUIRED])


def test_missing_or_invalid_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TrainConfig.from_args([str(tmp_path / "absent.yaml"), *REQUIRED])
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        TrainConfig.from_args([str(listed), *REQUIRED])


def test_target_modules_command_line_beats_yaml_beats_family_default(tmp_path):
    family_default = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert resolve_target_modules(parse().lora, family_default) == family_default
    task = tmp_path / "task.yaml"
    task.write_text("lora:\n  target_modules: [q_proj, v_proj]\n")
    from_yaml = TrainConfig.from_args([str(task), *REQUIRED])
    assert resolve_target_modules(from_yaml.lora, family_default) == ["q_proj", "v_proj"]
    from_cli = TrainConfig.from_args([str(task), *REQUIRED, "lora.target_modules=[down_proj]"])
    assert resolve_target_modules(from_cli.lora, family_default) == ["down_proj"]
    regex = parse("lora.lora_module_path=.*q_proj")
    assert resolve_target_modules(regex.lora, family_default) is None


def test_config_imports_without_jax():
    code = (
        "import sys; from lorajob_trainer.contract.config import TrainConfig; "
        "assert 'jax' not in sys.modules and 'flax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": str(Path(__file__).parents[2] / "trainer")})


def test_help_lists_every_key_with_type_default_and_doc():
    completed = subprocess.run([sys.executable, "-m", "lorajob_trainer.train", "--help"], capture_output=True,
                               text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    for key in all_keys():
        entry = next((i for i, line in enumerate(lines) if line.startswith(f"  {key}  (")), None)
        assert entry is not None, f"--help does not list {key}"
        assert ("default: " in lines[entry] or "required" in lines[entry]), lines[entry]
        assert lines[entry + 1].startswith("      ") and lines[entry + 1].strip(), f"{key} has no doc line"
    assert "lora.lora_rank  (int, default: 16)" in completed.stdout
    assert "lr_schedule  (cosine | linear | constant, default: cosine)" in completed.stdout


@pytest.mark.parametrize(("typo", "suggested"), [
    ("learnig_rate", "learning_rate"),
    ("lora.rank", "lora.lora_rank"),
    ("rank", "lora.lora_rank"),
    ("mesh.fsdpp", "mesh.fsdp"),
])
def test_an_unknown_key_suggests_the_closest_valid_one(typo, suggested):
    with pytest.raises(ConfigError, match=f"Did you mean '{suggested}'"):
        parse(f"{typo}=1")
