"""LoRAJobPolicy at reconcile time: a violating LoRAJob fails before any child exists; defaults reach the
rendered JobSets and status.resolved, never the spec."""

from __future__ import annotations

from datetime import datetime, UTC

import pytest
from builders import UID, jobset, lorajob, owner, spec_dict

from lorajob_operator import jobsets, names, policy, validation
from lorajob_operator.reconcile.decide import Create, decide
from lorajob_operator.reconcile.observed import Observed, observe_child
from lorajob_operator.settings import ReconcileSettings, RenderSettings
from lorajob_trainer.contract.config import TrainConfig

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SETTINGS = ReconcileSettings()
TEAM_LABELS = {"lorajob.dev/team": "a"}
TPU_RULE = 'LoRAJobPolicy "v5e-only" rule tpu.allowed: TPU ct6e-standard-4t 4x4 (spec.compute.tpu) is not allowed'


def _policy(name: str, spec: dict, selector: dict | None = None) -> policy.LoRAJobPolicy:
    selector = selector if selector is not None else {"matchLabels": TEAM_LABELS}
    return policy.LoRAJobPolicy.from_object({"metadata": {"name": name}, "spec": {"namespaceSelector": selector, **spec}})


V5E_ONLY = _policy("v5e-only", {"tpu": {"allowed": [{"machineType": "ct5lp-hightpu-4t"}]}})
DEFAULTS = _policy("team-defaults", {
    "queues": {"default": "team-a-queue"},
    "defaults": {"images": {"trainer": "registry.example/trainer:team"}, "cpuNodePool": "team-cpu"},
})


def _observe(body: dict, policies=(), labels=TEAM_LABELS, children: dict | None = None) -> Observed:
    spec, errors = validation.parse_spec(body)
    return Observed(
        name=body["metadata"]["name"], namespace=body["metadata"]["namespace"], generation=body["metadata"]["generation"],
        spec=spec, spec_errors=errors, status=body.get("status") or {},
        children={phase: observe_child(child, UID) for phase, child in (children or {}).items()},
        problems=(), cluster_queue=None, now=NOW, policies=tuple(policies), namespace_labels=labels,
    )


def _failed(decision) -> dict:
    return next(c for c in decision.status["conditions"] if c["type"] == "Failed")


def test_a_violating_lorajob_fails_with_the_rule_named_and_creates_nothing():
    decision = decide(_observe(lorajob(), [V5E_ONLY]), SETTINGS)

    assert decision.create == []
    assert decision.status["phase"] == "Failed"
    failed = _failed(decision)
    assert (failed["status"], failed["reason"]) == ("True", policy.VIOLATION_REASON)
    assert failed["message"].startswith(TPU_RULE) and decision.status["message"] == failed["message"]
    assert [(e.type, e.reason) for e in decision.events] == [("Warning", "Failed")]


def test_every_broken_rule_is_in_the_message():
    capped = _policy("capped", {"tpu": {"maxSlices": 1}, "outputs": {"allowedPrefixes": ["gs://team-a"]}})
    body = lorajob(spec=spec_dict(compute={"backend": "pathways", "tpu": {"machineType": "ct6e-standard-4t", "topology": "4x4", "slices": 2}}))

    message = decide(_observe(body, [capped]), SETTINGS).status["message"]

    assert 'LoRAJobPolicy "capped" rule tpu.maxSlices' in message
    assert 'LoRAJobPolicy "capped" rule outputs.allowedPrefixes' in message


def test_a_policy_for_other_namespaces_does_not_apply():
    decision = decide(_observe(lorajob(), [V5E_ONLY], labels={"lorajob.dev/team": "b"}), SETTINGS)

    assert decision.create == [Create("convert", 0)]
    assert decision.status["resolved"]["policies"] == []


def test_a_policy_changed_after_the_first_step_started_does_not_stop_the_run():
    body = lorajob()
    started = lorajob(status={"phase": "Converting", "startTime": "2026-01-01T11:00:00Z"})

    decision = decide(_observe(started, [V5E_ONLY], children={"convert": jobset(body, "convert")}), SETTINGS)

    assert decision.status["phase"] != "Failed"
    assert decision.status["resolved"]["policies"] == ["v5e-only"]


def test_policy_defaults_are_resolved_into_status_and_the_spec_is_left_alone():
    body = lorajob(spec=spec_dict(scheduling={}))
    observed = _observe(body, [DEFAULTS])

    decision = decide(observed, SETTINGS)

    assert decision.create == [Create("convert", 0)]
    assert decision.status["resolved"] == {
        "queueName": "team-a-queue",
        "cpuNodePool": "team-cpu",
        "images": {
            "trainer": "registry.example/trainer:team",
            "pathwaysServer": RenderSettings().images.pathways_server,
            "pathwaysProxy": RenderSettings().images.pathways_proxy,
        },
        "policies": ["team-defaults"],
    }
    assert observed.spec.scheduling.queue_name is None and observed.spec.images.trainer is None
    # A LoRAJob queued through the policy's default queue waits for Kueue like one that names it.
    assert decision.status["phase"] == "Queued"


def test_the_rendered_jobsets_use_the_policy_defaults():
    observed = _observe(lorajob(spec=spec_dict(scheduling={})), [DEFAULTS])

    convert = jobsets.render_phase("convert", observed.effective_spec, owner(lorajob()), RenderSettings(), 0)

    assert convert["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "team-a-queue"
    pod = convert["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"][names.NODE_POOL_LABEL] == "team-cpu"
    assert {c["image"] for c in pod["containers"]} == {"registry.example/trainer:team"}


def test_the_lorajob_own_values_win_over_policy_defaults():
    body = lorajob(spec=spec_dict(images={"trainer": "mine:1"}))  # scheduling.queueName: lorajob

    resolved = decide(_observe(body, [DEFAULTS]), SETTINGS).status["resolved"]

    assert (resolved["queueName"], resolved["images"]["trainer"], resolved["cpuNodePool"]) == ("lorajob", "mine:1", "team-cpu")


def test_without_policies_the_operator_settings_are_recorded():
    resolved = decide(_observe(lorajob(), [], labels={}), SETTINGS).status["resolved"]

    assert resolved["cpuNodePool"] == RenderSettings().cpu_node_pool
    assert resolved["images"]["trainer"] == RenderSettings().images.trainer
    assert resolved["policies"] == []


def test_a_finished_lorajob_keeps_what_it_ran_with_when_policies_change():
    body = lorajob(spec=spec_dict(scheduling={}))
    ran = decide(_observe(body, [DEFAULTS]), SETTINGS).status["resolved"]
    finished = lorajob(spec=spec_dict(scheduling={}), status={"phase": "Succeeded", "resolved": ran})

    assert decide(_observe(finished, []), SETTINGS).status["resolved"] == ran


TEAM_MLFLOW = {"trackingUri": "https://mlflow.team-a.example.com", "experiment": "team-a-runs", "tags": {"team": "a"}}


def _train_tracking(observed: Observed):
    train = jobsets.render_phase("train", observed.effective_spec, owner(lorajob()), RenderSettings(), 0)
    (trainer,) = train["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    return TrainConfig.from_args(trainer["command"][3:]).tracking


def test_a_policy_default_mlflow_server_is_where_a_lorajob_without_one_reports():
    observed = _observe(lorajob(), [_policy("team-mlflow", {"defaults": {"mlflow": TEAM_MLFLOW}})])

    tracking = _train_tracking(observed)

    assert (tracking.mlflow_tracking_uri, tracking.mlflow_experiment, tracking.mlflow_tags) == (
        "https://mlflow.team-a.example.com", "team-a-runs", {"team": "a"})
    assert tracking.mlflow_run_name == "qwen3-gsm8k"  # the policy's server, the LoRAJob's run
    assert decide(observed, SETTINGS).status["resolved"]["mlflowTrackingUri"] == "https://mlflow.team-a.example.com"
    assert observed.spec.tracking.mlflow is None  # never written into the spec


def test_the_lorajob_own_mlflow_server_wins_over_the_policy_default():
    own = {"mlflow": {"trackingUri": "https://mlflow.mine.example.com"}}
    observed = _observe(lorajob(spec=spec_dict(tracking=own)), [_policy("team-mlflow", {"defaults": {"mlflow": TEAM_MLFLOW}})])

    tracking = _train_tracking(observed)

    assert (tracking.mlflow_tracking_uri, tracking.mlflow_experiment) == ("https://mlflow.mine.example.com", "team-a")


@pytest.mark.parametrize("tracking, policy_spec, violation", [
    ({}, {"tracking": {"required": ["mlflow"]}},
     'LoRAJobPolicy "tracked" rule tracking.required: the runs of this namespace must report to MLflow: set '
     "spec.tracking.mlflow (the policy sets no default server in defaults.mlflow)"),
    ({"mlflow": {"trackingUri": "https://mlflow.example.com"}}, {"tracking": {"required": ["mlflow", "wandb"]}},
     'LoRAJobPolicy "tracked" rule tracking.required: the runs of this namespace must report to Weights & Biases: set '
     "spec.tracking.wandb"),
    ({}, {"tracking": {"required": ["mlflow"]}, "defaults": {"mlflow": TEAM_MLFLOW}}, None),
    ({"wandb": {"project": "p", "mode": "offline"}}, {"tracking": {"required": ["wandb"]}}, None),
], ids=["mlflow-missing", "wandb-missing", "mlflow-by-default", "wandb-set"])
def test_a_lorajob_without_a_required_tracker_fails_naming_the_rule(tracking, policy_spec, violation):
    decision = decide(_observe(lorajob(spec=spec_dict(tracking=tracking)), [_policy("tracked", policy_spec)]), SETTINGS)

    if violation is None:
        assert decision.create == [Create("convert", 0)]
    else:
        assert decision.create == [] and _failed(decision)["reason"] == policy.VIOLATION_REASON
        assert _failed(decision)["message"] == violation
