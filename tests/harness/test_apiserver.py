"""The apiserver-only harness is a real, stamped kube-apiserver that serves the project's CRDs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from lorajob_devcluster.versions import DEFAULT_VERSIONS

pytestmark = pytest.mark.apiserver
CRD_DIR = Path(__file__).resolve().parents[2] / "crds"


def repo_crds() -> list[dict]:
    documents = [doc for path in sorted(CRD_DIR.glob("*.y*ml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return [doc for doc in documents if doc.get("kind") == "CustomResourceDefinition"]


def test_version_is_the_stamped_release(kube):
    version = json.loads(kube.get("/version"))
    assert version["gitVersion"] == DEFAULT_VERSIONS.kubernetes
    assert version["gitTreeState"] == "clean"
    assert (version["major"], version["minor"]) == ("1", DEFAULT_VERSIONS.kubernetes.split(".")[1])


def test_kubectl_and_python_client_reach_the_same_apiserver(kube):
    kube.kubectl("create", "namespace", "harness-clients")
    names = {ns.metadata.name for ns in client.CoreV1Api(kube.api_client()).list_namespace().items}
    assert "harness-clients" in names
    assert kube.kubectl("get", "namespace", "harness-clients", "-o", "name").stdout.strip() == "namespace/harness-clients"


def test_kubectl_check_raises_with_stderr(kube):
    with pytest.raises(Exception, match="not found"):
        kube.kubectl("get", "namespace", "no-such-namespace")
    assert kube.kubectl("get", "namespace", "no-such-namespace", check=False).returncode != 0


def test_repository_crds_are_established_and_served(kube):
    crds = repo_crds()
    assert crds, f"{CRD_DIR} holds no CustomResourceDefinition"
    for crd in crds:
        status = json.loads(kube.kubectl("get", "crd", crd["metadata"]["name"], "-o", "json").stdout)["status"]
        established = {c["type"]: c["status"] for c in status["conditions"]}
        assert established.get("Established") == "True"
        group = crd["spec"]["group"]
        for version in (v["name"] for v in crd["spec"]["versions"] if v.get("served")):
            resources = json.loads(kube.get(f"/apis/{group}/{version}"))["resources"]
            assert crd["spec"]["names"]["plural"] in {r["name"] for r in resources}


def test_apply_crds_waits_until_a_new_crd_is_served(kube, tmp_path):
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.harness.lorajob.dev"},
        "spec": {
            "group": "harness.lorajob.dev",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}
            ],
        },
    }
    (tmp_path / "widget.yaml").write_text(yaml.safe_dump(crd))
    assert kube.apply_crds(tmp_path) == ["widgets.harness.lorajob.dev"]
    kube.kubectl("create", "-n", "default", "-f", "-", input=yaml.safe_dump({"apiVersion": "harness.lorajob.dev/v1", "kind": "Widget", "metadata": {"name": "w"}}))
    assert kube.kubectl("get", "widgets", "-n", "default", "-o", "name").stdout.strip() == "widget.harness.lorajob.dev/w"
