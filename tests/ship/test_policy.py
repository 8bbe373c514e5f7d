"""LoRAJobPolicy in Python: namespace selection, every rule, default resolution, and generated files."""

from __future__ import annotations

from pathlib import Path

import pytest

from shipkit import example_spec

from lorajob_operator import api, policy, policy_crd

REPO = Path(__file__).resolve().parents[2]


def lorajob_spec(**changes) -> api.LoRAJobSpec:
    """The example LoRAJob's spec with dotted-path changes (None removes the field)."""
    return api.LoRAJobSpec.model_validate(example_spec(**changes))


def team_policy(name: str = "team-a", **spec) -> policy.LoRAJobPolicy:
    return policy.LoRAJobPolicy.from_object({"metadata": {"name": name}, "spec": spec})


STRICT = team_policy(
    namespaceSelector={"matchLabels": {"team": "a"}},
    queues={"allowed": ["lorajob", "team-a-batch"]},
    tpu={
        "allowed": [{"machineType": "ct6e-standard-4t", "topologies": ["2x2", "4x4"]}, {"machineType": "ct5p-hightpu-4t"}],
        "maxSlices": 2,
        "maxChipsPerJob": 32,
    },
    outputs={"allowedPrefixes": ["gs://my-bucket/lorajob", "/mnt/team-a/"]},
)
TEAM_A = {"team": "a"}


def test_the_example_satisfies_the_strict_policy():
    assert policy.violations([STRICT], TEAM_A, lorajob_spec()) == []


@pytest.mark.parametrize(
    "changes, rule, message",
    [
        (
            {"scheduling__queueName": "other"},
            "queues.allowed",
            'queue "other" is not allowed in this namespace; use one of: lorajob, team-a-batch',
        ),
        (
            {"scheduling__queueName": None},
            "queues.allowed",
            "spec.scheduling.queueName is required in this namespace (the policy sets no default queue); "
            "use one of: lorajob, team-a-batch",
        ),
        (
            {"compute__tpu": {"machineType": "ct6e-standard-4t", "topology": "2x4"}},
            "tpu.allowed",
            "TPU ct6e-standard-4t 2x4 (spec.compute.tpu) is not allowed in this namespace; "
            "allowed: ct6e-standard-4t (2x2, 4x4); ct5p-hightpu-4t (any topology)",
        ),
        (
            {"compute__tpu": {"machineType": "ct5lp-hightpu-4t", "topology": "2x2"}},
            "tpu.allowed",
            "TPU ct5lp-hightpu-4t 2x2 (spec.compute.tpu) is not allowed in this namespace; "
            "allowed: ct6e-standard-4t (2x2, 4x4); ct5p-hightpu-4t (any topology)",
        ),
        (
            {"compute__tpu": {"machineType": "ct6e-standard-4t", "topology": "2x2", "slices": 3}},
            "tpu.maxSlices",
            "spec.compute.tpu.slices is 3; at most 2 slices are allowed per LoRAJob in this namespace",
        ),
        (
            {"output__baseOutputDirectory": "gs://my-bucket/lorajob-other"},
            "outputs.allowedPrefixes",
            'spec.output.baseOutputDirectory "gs://my-bucket/lorajob-other" is not under an allowed prefix: '
            "gs://my-bucket/lorajob, /mnt/team-a/",
        ),
        (
            {"export": {"path": "gs://elsewhere/adapter"}},
            "outputs.allowedPrefixes",
            'spec.export.path "gs://elsewhere/adapter" is not under an allowed prefix: gs://my-bucket/lorajob, /mnt/team-a/',
        ),
        (
            {"output__compilationCache": "gs://shared/jax-cache"},
            "outputs.allowedPrefixes",
            'spec.output.compilationCache "gs://shared/jax-cache" is not under an allowed prefix: '
            "gs://my-bucket/lorajob, /mnt/team-a/",
        ),
    ],
    ids=["queue-not-allowed", "queue-missing", "topology", "machine-type", "slices", "output-prefix-boundary", "export-path",
         "compilation-cache"],
)
def test_each_rule_names_itself_and_says_what_is_allowed(changes, rule, message):
    found = policy.violations([STRICT], TEAM_A, lorajob_spec(**changes))
    assert [(v.policy, v.rule, v.message) for v in found] == [("team-a", rule, f'LoRAJobPolicy "team-a" rule {rule}: {message}')]


@pytest.mark.parametrize(
    "changes",
    [
        {"compute__tpu": {"machineType": "ct6e-standard-4t", "topology": "4x4", "slices": 2}},
        {"compute__tpu": {"machineType": "ct5p-hightpu-4t", "topology": "2x2x4", "slices": 2}},
        {"output__baseOutputDirectory": "/mnt/team-a"},
        {"output__baseOutputDirectory": "gs://my-bucket/lorajob/nested/run", "export": {"path": "/mnt/team-a/x"}},
        {"scheduling__queueName": "team-a-batch"},
    ],
    ids=["chips-at-limit-2d", "chips-at-limit-3d", "prefix-itself", "below-prefixes", "second-queue"],
)
def test_limits_and_prefixes_are_inclusive(changes):
    assert policy.violations([STRICT], TEAM_A, lorajob_spec(**changes)) == []


def test_chips_over_the_limit_count_slices_times_topology():
    found = policy.violations([STRICT], TEAM_A, lorajob_spec(compute__tpu={"machineType": "ct5p-hightpu-4t", "topology": "4x4x4", "slices": 1}))
    assert [v.message for v in found] == [
        'LoRAJobPolicy "team-a" rule tpu.maxChipsPerJob: the LoRAJob requests 64 TPU chips (1 x 4x4x4); '
        "at most 32 are allowed per LoRAJob in this namespace"
    ]


def test_gpu_jobs_are_not_held_to_tpu_rules():
    spec = lorajob_spec(compute={"backend": "gpu", "gpu": {"accelerator": "nvidia-h100-80gb", "nodes": 4}})
    assert policy.violations([STRICT], TEAM_A, spec) == []


def test_default_queue_is_checked_when_the_lorajob_names_none():
    allowed_default = team_policy(queues={"default": "team-a-batch", "allowed": ["team-a-batch"]})
    bad_default = team_policy(queues={"default": "shared", "allowed": ["team-a-batch"]})
    spec = lorajob_spec(scheduling__queueName=None)
    assert policy.violations([allowed_default], {}, spec) == []
    assert [v.rule for v in policy.violations([bad_default], {}, spec)] == ["queues.allowed"]


@pytest.mark.parametrize(
    "selector, labels, selected",
    [
        ({}, {}, True),
        ({"matchLabels": {"team": "a"}}, {"team": "a", "x": "y"}, True),
        ({"matchLabels": {"team": "a"}}, {"team": "b"}, False),
        ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["a", "b"]}]}, {"team": "b"}, True),
        ({"matchExpressions": [{"key": "team", "operator": "In", "values": ["a"]}]}, {}, False),
        ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]}, {}, True),
        ({"matchExpressions": [{"key": "team", "operator": "NotIn", "values": ["a"]}]}, {"team": "a"}, False),
        ({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}, {"gpu": ""}, True),
        ({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}, {"gpu": ""}, False),
    ],
)
def test_namespace_selection_follows_kubernetes_label_selectors(selector, labels, selected):
    assert policy.selects(policy.NamespaceSelector.model_validate(selector), labels) is selected


def test_policies_for_other_namespaces_do_not_apply():
    assert policy.violations([STRICT], {"team": "b"}, lorajob_spec(scheduling__queueName="other")) == []


def test_every_governing_policy_applies():
    second = team_policy("shared", outputs={"allowedPrefixes": ["gs://shared/"]})
    found = policy.violations([second, STRICT], TEAM_A, lorajob_spec(scheduling__queueName="other"))
    assert [(v.policy, v.rule) for v in found] == [("shared", "outputs.allowedPrefixes"), ("team-a", "queues.allowed")]


def test_defaults_come_from_the_lorajob_first_then_policies_by_name():
    first = team_policy("a-defaults", queues={"default": "q-a"}, defaults={"images": {"trainer": "img/a"}, "cpuNodePool": "pool-a"})
    second = team_policy("b-defaults", queues={"default": "q-b"}, defaults={"images": {"trainer": "img/b", "pathwaysProxy": "proxy/b"}})
    spec = lorajob_spec(scheduling__queueName=None, images={"pathwaysServer": "server/own"})
    resolved = policy.resolve_defaults([second, first], {}, spec)
    assert resolved == policy.ResolvedDefaults(
        queue_name="q-a",
        images=api.ImagesSpec(trainer="img/a", pathways_server="server/own", pathways_proxy="proxy/b"),
        cpu_node_pool="pool-a",
        mlflow=None,
        policies=("a-defaults", "b-defaults"),
    )
    assert policy.resolve_defaults([first], {}, lorajob_spec()).queue_name == "lorajob"


MLFLOW_A = {"trackingUri": "https://mlflow-a.example.com"}


def test_the_mlflow_server_comes_from_the_lorajob_first_then_policies_by_name():
    first = team_policy("a-mlflow", defaults={"mlflow": MLFLOW_A})
    second = team_policy("b-mlflow", defaults={"mlflow": {"trackingUri": "https://mlflow-b.example.com"}})
    assert policy.resolve_defaults([second, first], {}, lorajob_spec()).mlflow == api.MLflowTracking(**MLFLOW_A)
    own = lorajob_spec(tracking={"mlflow": {"trackingUri": "https://mine.example.com"}})
    assert policy.resolve_defaults([first], {}, own).mlflow.tracking_uri == "https://mine.example.com"
    assert policy.resolve_defaults([], {}, lorajob_spec()).mlflow is None


def test_a_required_tracker_is_met_by_the_lorajob_or_that_policy_s_own_default():
    required = team_policy("tracked", tracking={"required": ["mlflow"]})
    defaulting = team_policy("defaulting", defaults={"mlflow": MLFLOW_A})
    # Each policy on its own, as admission sees them: another policy's default server does not count.
    assert [v.policy for v in policy.violations([required, defaulting], {}, lorajob_spec())] == ["tracked"]
    assert policy.violations([team_policy("tracked", tracking={"required": ["mlflow"]}, defaults={"mlflow": MLFLOW_A})],
                             {}, lorajob_spec()) == []
    assert policy.violations([required], {}, lorajob_spec(tracking={"mlflow": MLFLOW_A})) == []


def test_policy_objects_reject_unknown_fields():
    with pytest.raises(ValueError, match="maxSlice"):
        team_policy(tpu={"maxSlice": 2})


def test_checked_in_policy_crd_and_admission_rules_are_generated():
    assert (REPO / "crds" / policy_crd.CRD_FILE).read_text() == policy_crd.render_crd(), (
        "stale: run `make crds`"
    )
    chart_rules = REPO / "helm" / "lorajob" / "files" / policy_crd.ADMISSION_RULES_FILE
    assert chart_rules.read_text() == policy_crd.render_admission_rules(), "stale: run `make crds`"


def test_admission_rules_cover_every_policy_rule_once():
    validations = policy.admission_policy_rules()["validations"]
    assert len(validations) == len(policy.RULES)
    for rule, validation in zip(policy.RULES, validations):
        assert f"rule {rule.name}: " in validation["messageExpression"]

