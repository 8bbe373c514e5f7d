"""`lorajob render FILE` prints the operator's JobSets for review, from the same rendering code."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lorajob_operator import jobsets, validation
from lorajob_operator.settings import RenderSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))


def _lorajob_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lorajob_operator.cli", *args], capture_output=True, text=True, cwd=REPO_ROOT)


def test_render_prints_every_step_of_every_example_as_the_operator_renders_it():
    result = _lorajob_cli("render", *map(str, EXAMPLES))
    assert result.returncode == 0, result.stderr
    printed = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    expected = []
    for path in EXAMPLES:
        body = yaml.safe_load(path.read_text())
        spec, _ = validation.parse_spec(body)
        owner = jobsets.Owner(body["metadata"]["name"], "default", "<uid>")
        expected += jobsets.render_all(spec, owner, RenderSettings())
    assert printed == expected
    assert [doc["metadata"]["name"] for doc in printed] == [
        "gemma3-support-v2-convert", "gemma3-support-v2", "gemma3-support-v2-to-hf",
        "gemma4-26b-gsm8k-convert", "gemma4-26b-gsm8k", "gemma4-26b-gsm8k-to-hf",
        "llama31-ultrachat-check", "llama31-ultrachat",
        "llama31-dpo-convert", "llama31-dpo", "llama31-dpo-to-hf",
        "qwen3-gsm8k-tracked-convert", "qwen3-gsm8k-tracked", "qwen3-gsm8k-tracked-to-hf",
        "qwen3-30b-a3b-gsm8k-convert", "qwen3-30b-a3b-gsm8k", "qwen3-30b-a3b-gsm8k-to-hf",
        "qwen3-4b-orpo-convert", "qwen3-4b-orpo", "qwen3-4b-orpo-to-hf",
        "qwen3-gsm8k-convert", "qwen3-gsm8k", "qwen3-gsm8k-to-hf",
    ]
    # The preference examples' train command lines (and their checks) say the method.
    for name, method in (("llama31-dpo", "dpo"), ("qwen3-4b-orpo", "orpo")):
        step = next(doc for doc in printed if doc["metadata"]["name"] == name)
        assert f"method={method}" in yaml.safe_dump(step["spec"]), name
        checks = next(doc for doc in printed if doc["metadata"]["name"] == f"{name}-convert")
        assert yaml.safe_dump(checks["spec"]).count(f"method={method}") == 2, name  # the data check and the fit check
    # The tracking example's train step reports to its trackers as its LoRAJob; its checks report to none.
    tracked = yaml.safe_dump(next(doc for doc in printed if doc["metadata"]["name"] == "qwen3-gsm8k-tracked")["spec"])
    assert "tracking.mlflow_tracking_uri=https://mlflow.example.com" in tracked and "tracking.job_uid=<uid>" in tracked
    checks = next(doc for doc in printed if doc["metadata"]["name"] == "qwen3-gsm8k-tracked-convert")
    assert "tracking." not in yaml.safe_dump(checks["spec"]).replace("LORAJOB_", "")


def test_render_does_not_need_a_kubernetes_client():
    code = (
        "import sys; from lorajob_operator import cli; cli.main(['render', 'examples/qwen3-gsm8k.yaml']);"
        "assert 'kubernetes' not in sys.modules and 'kopf' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr


TEAM_POLICY = """
apiVersion: lorajob.dev/v1alpha1
kind: LoRAJobPolicy
metadata: {name: team-a}
spec:
  namespaceSelector: {matchLabels: {team: a}}
  queues: {default: team-a-queue}
  tpu: {allowed: [{machineType: ct6e-standard-4t, topologies: [4x4]}]}
  defaults: {cpuNodePool: team-a-cpu, images: {trainer: registry.example/team-a/trainer:1}}
"""


def test_render_applies_the_policies_of_the_namespace_as_the_operator_does(tmp_path):
    lorajob = yaml.safe_load((REPO_ROOT / "examples" / "qwen3-gsm8k.yaml").read_text())
    del lorajob["spec"]["scheduling"]["queueName"]  # the policy's default applies
    files = [tmp_path / "policy.yaml", tmp_path / "lorajob.yaml"]
    files[0].write_text(TEAM_POLICY)
    files[1].write_text(yaml.safe_dump(lorajob))
    governed = _lorajob_cli("render", str(files[1]), "--policy", str(files[0]), "--namespace", "team-a",
                            "--namespace-labels", "team=a")
    assert governed.returncode == 0, governed.stderr
    jobsets = [doc for doc in yaml.safe_load_all(governed.stdout) if doc]
    assert {js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for js in jobsets} == {"team-a-queue"}
    convert = next(js for js in jobsets if js["metadata"]["name"].endswith("-convert"))
    pod = convert["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-nodepool"] == "team-a-cpu"
    assert pod["containers"][0]["image"] == "registry.example/team-a/trainer:1"

    ungoverned = _lorajob_cli("render", *map(str, files), "--namespace", "team-b")  # the policy selects team=a only
    assert ungoverned.returncode == 0, ungoverned.stderr
    rendered = [js for js in yaml.safe_load_all(ungoverned.stdout) if js]
    assert rendered and "team-a-queue" not in {js["metadata"]["labels"].get("kueue.x-k8s.io/queue-name") for js in rendered}
    assert "no LoRAJobPolicy applied" in _lorajob_cli("render", str(files[1])).stderr

    lorajob["spec"]["compute"]["tpu"]["topology"] = "8x8"  # a topology the policy does not allow
    files[1].write_text(yaml.safe_dump(lorajob))
    refused = _lorajob_cli("render", *map(str, files), "--namespace-labels", "team=a")
    assert refused.returncode == 1 and 'LoRAJobPolicy "team-a" rule tpu.allowed' in refused.stderr, refused.stderr


@pytest.mark.apiserver
def test_render_from_a_cluster_applies_its_policies_and_namespace_labels(kube, tmp_path):
    kube.kubectl("create", "namespace", "render-team-a")
    kube.kubectl("label", "namespace", "render-team-a", "team=a")
    kube.kubectl("apply", "-f", "-", input=TEAM_POLICY)
    try:
        lorajob = yaml.safe_load((REPO_ROOT / "examples" / "qwen3-gsm8k.yaml").read_text())
        del lorajob["spec"]["scheduling"]["queueName"]
        lorajob["metadata"]["namespace"] = "render-team-a"
        path = tmp_path / "lorajob.yaml"
        path.write_text(yaml.safe_dump(lorajob))
        governed = _lorajob_cli("render", str(path), "--kubeconfig", str(kube.kubeconfig))
        assert governed.returncode == 0 and "no LoRAJobPolicy applied" not in governed.stderr, governed.stderr
        jobsets = [doc for doc in yaml.safe_load_all(governed.stdout) if doc]
        assert {js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] for js in jobsets} == {"team-a-queue"}

        lorajob["metadata"]["namespace"] = "render-nowhere"
        path.write_text(yaml.safe_dump(lorajob))
        missing = _lorajob_cli("render", str(path), "--kubeconfig", str(kube.kubeconfig))
        assert missing.returncode == 1 and "namespace 'render-nowhere' does not exist in the cluster" in missing.stderr
    finally:
        kube.kubectl("delete", "lorajobpolicy", "team-a", "--wait=false")
        kube.kubectl("delete", "namespace", "render-team-a", "--wait=false")
    unreachable = _lorajob_cli("render", str(path), "--kubeconfig", str(tmp_path / "no-such-kubeconfig"))
    assert unreachable.returncode == 1 and unreachable.stderr.startswith("lorajob render: no usable kubeconfig")


def test_render_refuses_an_invalid_lorajob_with_the_reason(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO_ROOT / "examples" / "invalid" / "run-name-too-long-pathways.yaml").read_text())
    result = _lorajob_cli("render", str(bad))
    assert result.returncode == 1
    assert "cannot render" in result.stderr and "at most 22" in result.stderr


NEEDS = {"validate": "Needs no cluster", "render": "Needs no cluster, unless", "plan": 'pip install "lorajob[trainer]" "jax[tpu]"',
         "status": "Needs the kubernetes package", "logs": "Needs the kubernetes package", "plot": "Also needs matplotlib"}
"""What each subcommand's --help says it needs."""


def test_version_and_help_on_every_argument():
    version = _lorajob_cli("--version")
    assert version.returncode == 0 and version.stdout.split() == ["lorajob", importlib.metadata.version("lorajob")]
    for command in ("validate", "render", "plan"):
        help_text = _lorajob_cli(command, "--help").stdout
        positionals = help_text.partition("positional arguments:")[2]  # the usage line may wrap onto "FILE [FILE ...]"
        described = [line.split(maxsplit=1) for line in positionals.splitlines() if line.strip().startswith("FILE ")]
        assert described and described[0][1].startswith("YAML files"), help_text


@pytest.mark.parametrize("command", NEEDS)
def test_help_of_every_subcommand_says_what_it_does_and_needs(command):
    result = _lorajob_cli(command, "--help")
    assert result.returncode == 0, result.stderr
    description = " ".join(result.stdout.partition("\n\n")[2].partition("\n\n")[0].split())  # between usage and arguments
    assert NEEDS[command] in description, result.stdout
