"""examples/gitops: an Argo CD Application and the kustomization it syncs (team namespace, LocalQueue,
LoRAJob), rendered by kustomize, validated offline, and dry-run against the real API server."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from lorajob_devcluster import build
from lorajob_operator import api
from lorajob_operator.cli import main as lorajob_cli

REPO = Path(__file__).resolve().parents[2]
GITOPS = REPO / "examples" / "gitops"
APPLICATION = yaml.safe_load((GITOPS / "application.yaml").read_text())
SOURCE = REPO / APPLICATION["spec"]["source"]["path"]


@pytest.fixture(scope="module")
def rendered_text() -> str:
    """What Argo CD applies: `kustomize build` of the Application's path."""
    kubectl = build.build(("kubernetes",)) / "kubectl"
    return subprocess.run([str(kubectl), "kustomize", str(SOURCE)], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def rendered(rendered_text) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered_text) if doc]


def _documents_of_kind(text: str, kind: str) -> str:
    """The YAML documents of one kind, as kustomize wrote them (no re-serialisation)."""
    return "---\n".join(doc for doc in text.split("---\n") if re.search(rf"^kind: {kind}$", doc, re.M))


def test_application_points_at_the_kustomization():
    assert (SOURCE / "kustomization.yaml").is_file()
    kustomization = yaml.safe_load((SOURCE / "kustomization.yaml").read_text())
    assert APPLICATION["spec"]["destination"]["namespace"] == kustomization["namespace"]
    assert "ServerSideApply=true" in APPLICATION["spec"]["syncPolicy"]["syncOptions"]


def test_kustomization_renders_namespace_queue_and_lorajob(rendered):
    kinds = {o["kind"]: o for o in rendered}
    assert sorted(kinds) == ["LoRAJob", "LocalQueue", "Namespace"]
    namespace = kinds["Namespace"]["metadata"]["name"]
    assert kinds["LocalQueue"]["metadata"]["namespace"] == kinds["LoRAJob"]["metadata"]["namespace"] == namespace
    assert kinds["LoRAJob"]["spec"]["scheduling"]["queueName"] == kinds["LocalQueue"]["metadata"]["name"]


def test_lorajobs_pass_offline_validation(rendered_text, tmp_path, capsys):
    """`kubectl kustomize … > out.yaml && lorajob validate out.yaml`, as a pull-request check would run it."""
    path = tmp_path / "rendered.yaml"
    path.write_text(_documents_of_kind(rendered_text, api.KIND))
    assert lorajob_cli(["validate", str(path)]) == 0, capsys.readouterr().out
    assert "is valid" in capsys.readouterr().out


def test_git_managed_lorajobs_have_no_ttl(rendered):
    """Argo CD would recreate a LoRAJob deleted by its TTL and run the fine-tune again."""
    for job in (o for o in rendered if o["kind"] == api.KIND):
        assert "ttlSecondsAfterFinished" not in job["spec"].get("scheduling", {})


@pytest.mark.apiserver
def test_the_api_server_accepts_the_lorajob(kube, rendered, rendered_text):
    namespace = next(o for o in rendered if o["kind"] == "Namespace")
    kube.kubectl("apply", "-f", "-", input=json.dumps(namespace))
    job = _documents_of_kind(rendered_text, api.KIND)
    result = kube.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-", input=job, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.cluster
def test_the_whole_kustomization_dry_runs_with_kueue_installed(sim_cluster, rendered_text):
    sim_cluster.kubectl("apply", "-f", "-", input=_documents_of_kind(rendered_text, "Namespace"))
    result = sim_cluster.kubectl("apply", "--dry-run=server", "--server-side", "-f", "-", input=rendered_text, check=False)
    assert result.returncode == 0, result.stderr
