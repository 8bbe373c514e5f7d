"""The Hugging Face token stays a Secret: after a full chain it appears nowhere but as a secretKeyRef to a
Secret in the LoRAJob's own namespace, and the trainer's containers run as non-root without privilege."""

from __future__ import annotations

import json
import uuid

import pytest
from lorajobs import HF_SECRET, sample

from lorajob_operator import jobsets, names

pytestmark = pytest.mark.cluster


def _all_containers(pods: list[dict]) -> list[dict]:
    return [c for pod in pods for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]]


def test_the_token_appears_only_as_a_secret_reference(lorajobs, operator):
    token = "hf_" + uuid.uuid4().hex
    lorajobs.kubectl("delete", "secret", HF_SECRET)
    lorajobs.kubectl("create", "secret", "generic", HF_SECRET, f"--from-literal=HF_TOKEN={token}")
    lorajobs.apply(sample("guarded"))
    lorajobs.wait_phase("guarded", "Succeeded", timeout=180)

    pods = lorajobs.pods()
    seen = {
        "the LoRAJob": json.dumps(lorajobs.get("guarded")),
        "the events": lorajobs.kubectl("get", "events", "-o", "json").stdout,
        "the JobSets": json.dumps(lorajobs.jobsets()),
        "the pods": json.dumps(pods),
        "the operator's log": operator.log_path.read_text(),
    }
    assert [where for where, text in seen.items() if token in text] == []

    trainers = [c for c in _all_containers(pods) if c["name"] == names.TRAINER_CONTAINER]
    assert {pod["metadata"]["labels"][names.LABEL_PHASE] for pod in pods} == {"convert", "train", "export"}
    for container in trainers:
        (credential,) = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
        assert credential == {
            "name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": HF_SECRET, "key": "HF_TOKEN", "optional": True}}
        }
        assert container["securityContext"] == jobsets.TRAINER_SECURITY_CONTEXT


def test_a_secret_of_another_namespace_cannot_be_named(lorajobs):
    body = sample("elsewhere")
    body["spec"]["credentials"]["huggingFaceToken"]["namespace"] = "kube-system"
    result = lorajobs.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert result.returncode != 0
    assert 'unknown field "spec.credentials.huggingFaceToken.namespace"' in result.stderr
    assert lorajobs.get("elsewhere") is None
