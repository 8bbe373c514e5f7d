"""The generated CRD, enforced by a real kube-apiserver: what `kubectl apply` users see."""

import json
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from lorajob_operator import api
from lorajob_operator.validation import validate

pytestmark = pytest.mark.apiserver

REPO = Path(__file__).resolve().parents[2]
VALID = sorted((REPO / "examples").glob("*.yaml"))
INVALID = sorted((REPO / "examples" / "invalid").glob("*.yaml"))
NAMESPACE = "api-tests"


@pytest.fixture(scope="module")
def custom(kube):
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    return client.CustomObjectsApi(kube.api_client())


def _create(custom, doc, dry_run=False):
    kwargs = {"dry_run": "All"} if dry_run else {}
    return custom.create_namespaced_custom_object(
        api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, doc, field_validation="Strict", **kwargs
    )


def _server_error(custom, doc) -> str | None:
    try:
        _create(custom, doc, dry_run=True)
    except ApiException as error:
        assert error.status in (400, 422), error.body
        return json.loads(error.body)["message"]
    return None


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_examples_are_accepted_by_kubectl(kube, custom, path):
    result = kube.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f", str(path))
    assert "created (server dry run)" in result.stdout


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_examples_are_rejected_by_kubectl_with_their_message(kube, custom, path):
    expected = next(line.split("# expect:", 1)[1].strip() for line in path.read_text().splitlines()
                    if line.startswith("# expect:"))
    result = kube.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f", str(path), check=False)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


@pytest.mark.parametrize("path", VALID + INVALID, ids=lambda p: p.name)
def test_offline_validate_gives_the_same_verdict_and_messages_as_the_server(custom, path):
    doc = yaml.safe_load(path.read_text())
    offline = validate(doc)
    server = _server_error(custom, doc)
    assert (server is None) == (offline == []), (server, [str(e) for e in offline])
    for error in offline:
        if error.kind == "unknown field":  # strict decoding reports these as `unknown field "spec.x.y"`
            assert f'unknown field "{error.field}"' in server
        elif error.kind != "Internal error":
            assert error.field in server and error.detail.split(": ", 1)[-1] in server, (str(error), server)


def test_create_applies_defaults_and_status_is_a_subresource(custom):
    doc = yaml.safe_load((REPO / "examples" / "qwen3-gsm8k.yaml").read_text())
    doc["metadata"]["name"] = "defaults"
    doc["spec"].pop("lora")
    created = _create(custom, doc)
    assert created["spec"]["lora"]["rank"] == 16
    assert created["spec"]["export"]["enabled"] is True
    assert created["spec"]["model"]["checkpointStorage"] == {"useZarr3": False, "useOcdbt": False}
    status = {"status": {"phase": "Training", "observedGeneration": 1, "progress": {"step": 3, "totalSteps": 200, "summary": "3/200"}}}
    custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, "defaults", status)
    current = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, "defaults")
    assert current["status"]["phase"] == "Training" and current["metadata"]["generation"] == 1
    api.LoRAJobStatus.model_validate(current["status"])


@pytest.fixture
def running_job(custom):
    doc = yaml.safe_load((REPO / "examples" / "llama-mcjax-from-maxtext.yaml").read_text())
    doc["metadata"]["name"] = "immutable"
    _create(custom, doc)
    yield doc
    custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, "immutable")


@pytest.mark.parametrize(
    "patch,field",
    [
        ({"lora": {"rank": 64}}, "spec.lora"),
        ({"training": {"steps": 10}}, "spec.training"),
        ({"compute": {"tpu": {"slices": 4}}}, "spec.compute"),
        ({"runName": "other"}, "spec.runName"),
        ({"scheduling": {"queueName": "other"}}, "spec.scheduling.queueName"),
        ({"credentials": {"huggingFaceToken": {"name": "tok"}}}, "spec.credentials"),
        ({"method": "dpo", "dataset": {"columns": ["chosen", "rejected"]}}, "spec.method"),
        ({"tracking": {"mlflow": {"trackingUri": "https://mlflow.example.com"}}}, "spec.tracking"),
    ],
    ids=["lora", "training", "compute", "runName-added", "queue", "credentials-added", "method", "tracking-added"],
)
def test_spec_is_immutable_except_suspend_and_lifetime(custom, running_job, patch, field):
    with pytest.raises(ApiException) as rejected:
        custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, "immutable", {"spec": patch})
    assert f"{field} is immutable" in json.loads(rejected.value.body)["message"]


def test_suspend_and_lifetime_can_change(custom, running_job):
    patch = {"spec": {"suspend": True, "scheduling": {"ttlSecondsAfterFinished": 60, "activeDeadlineSeconds": 3600}}}
    updated = custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, "immutable", patch)
    assert updated["spec"]["suspend"] is True and updated["metadata"]["generation"] == 2


def test_kubectl_explain_shows_field_docs(kube, custom):
    out = kube.kubectl("explain", "lorajob.spec.lora").stdout
    assert "lora adapter settings" in out and "rank\t<integer>" in out and "restoreFrom\t<Object>" in out and "adapters." in out
    out = kube.kubectl("explain", "lj.spec.compute.tpu.topology").stdout
    assert "16x16" in out


def test_kubectl_get_shows_printer_columns(kube, custom):
    doc = yaml.safe_load((REPO / "examples" / "gemma3-gpu-restore.yaml").read_text())
    _create(custom, doc)
    custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, doc["metadata"]["name"],
        {"status": {"phase": "Queued", "progress": {"summary": "0/500"}, "resolved": {"queueName": "team-q"}}},
    )
    out = kube.kubectl("get", "lj", "-n", NAMESPACE, doc["metadata"]["name"]).stdout
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "PROGRESS", "MODEL", "QUEUE", "SCORE", "AGE"]
    assert row.split()[:5] == ["gemma3-support-v2", "Queued", "0/500", "gemma3-4b", "team-q"]
    wide = kube.kubectl("get", "lj", "-n", NAMESPACE, doc["metadata"]["name"], "-o", "wide").stdout
    assert "BACKEND" in wide and "gpu" in wide


def test_kubectl_get_wide_shows_a_preference_runs_reward_accuracy(kube, custom):
    doc = yaml.safe_load((REPO / "examples" / "lorajob-dpo.yaml").read_text())
    _create(custom, doc)
    custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, doc["metadata"]["name"],
        {"status": {"phase": "Training", "progress": {"step": 40, "totalSteps": 1000, "summary": " 40/1000   4%",
                                                      "loss": 0.5123, "rewardAccuracy": 0.8125, "rewardMargin": 1.25,
                                                      "chosenLogps": -210.5, "rejectedLogps": -260.25,
                                                      "evalPreferenceAccuracy": 0.75, "evalStep": 40}}},
    )
    header, row = kube.kubectl("get", "lj", "-n", NAMESPACE, doc["metadata"]["name"], "-o", "wide").stdout.splitlines()[:2]
    assert "REWARD ACC" in header
    assert row[header.index("REWARD ACC"):].split()[0] == "0.8125"
    stored = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, doc["metadata"]["name"])
    assert api.LoRAJobStatus.model_validate(stored["status"]).progress.eval_preference_accuracy == 0.75


def test_kubectl_get_wide_links_the_mlflow_run(kube, custom):
    doc = yaml.safe_load((REPO / "examples" / "lorajob-tracking.yaml").read_text())
    _create(custom, doc)
    url = "https://mlflow.example.com/#/experiments/3/runs/9f1c"
    custom.patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, doc["metadata"]["name"],
        {"status": {"phase": "Training", "tracking": {"mlflow": {"url": url}, "wandb": {"url": "https://wandb.ai/t/p/runs/x"}}}},
    )
    header, row = kube.kubectl("get", "lj", "-n", NAMESPACE, doc["metadata"]["name"]).stdout.splitlines()[:2]
    assert "MLFLOW RUN" not in header  # -o wide only
    header, row = kube.kubectl("get", "lj", "-n", NAMESPACE, doc["metadata"]["name"], "-o", "wide").stdout.splitlines()[:2]
    assert row[header.index("MLFLOW RUN"):].split()[0] == url
    stored = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, doc["metadata"]["name"])
    assert api.LoRAJobStatus.model_validate(stored["status"]).tracking.wandb.url == "https://wandb.ai/t/p/runs/x"


def test_the_server_refuses_the_same_method_layout_and_preference_combinations_with_the_same_reasons(custom):
    """test_validation's grid of methods, layouts and preference settings, on the API server: each verdict and each
    reason is the offline one."""
    from test_validation import PREFERENCE_CASES, preference_doc, preference_refusals

    for case in PREFERENCE_CASES:
        doc = preference_doc(*case)
        doc["metadata"]["name"] = "preference-grid"
        server = _server_error(custom, doc)
        expected = preference_refusals(*case)
        assert (server is None) == (not expected) == (validate(doc) == []), (case, server)
        assert all(fragment in server for fragment in expected), (case, server)
