"""The Helm chart, offline: `helm lint`, `helm template` for several value sets, and the values schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from shipkit import CHART, FULLNAME, RELEASE_NAMESPACE, TEMPLATE_KUBE_VERSION
from lorajob_operator import accelerators, policy
from lorajob_operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[2]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str) -> dict:
    (found,) = by_kind(objects, kind)
    return found


@pytest.fixture(scope="module")
def defaults(helm) -> list[dict]:
    return helm.template(include_crds=True)


def test_lint_is_clean(helm):
    result = helm.run("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def test_chart_crds_are_the_generated_ones(defaults):
    """One source: the chart's crds/ are links to crds/, so what Helm installs is what the models generate."""
    shipped = {o["metadata"]["name"]: o for o in by_kind(defaults, "CustomResourceDefinition")}
    generated = {}
    for path in sorted((REPO / "crds").glob("lorajob.dev_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        generated[crd["metadata"]["name"]] = crd
    assert shipped == generated
    for link in (CHART / "crds").iterdir():
        assert link.is_symlink() and link.resolve().parent == (REPO / "crds").resolve(), link


def test_default_install_objects(defaults):
    kinds = sorted(o["kind"] for o in defaults)
    assert kinds == sorted([
        "CustomResourceDefinition", "CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRole",
        "ClusterRoleBinding", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment", "PodDisruptionBudget",
        "Service", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
    ])


def test_deployment_is_two_hardened_replicas_electing_a_leader(defaults):
    deployment = one(defaults, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    selector = spec["selector"]["matchLabels"]
    (spread,) = pod["topologySpreadConstraints"]
    assert spread == {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
                      "labelSelector": {"matchLabels": selector}}
    budget = one(defaults, "PodDisruptionBudget")["spec"]
    assert budget == {"minAvailable": 1, "selector": {"matchLabels": selector}}
    leader = OperatorSettings.from_env(_env(defaults)).leader
    assert (leader.lease_name, leader.lease_namespace, leader.identity) == (FULLNAME, RELEASE_NAMESPACE, "<metadata.name>")
    assert (leader.lease_duration_seconds, leader.renew_deadline_seconds, leader.retry_period_seconds) == (15, 10, 2)
    assert pod["serviceAccountName"] == one(defaults, "ServiceAccount")["metadata"]["name"] == FULLNAME
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    assert {"mountPath": "/tmp", "name": "tmp"} in container["volumeMounts"]


def test_probes_hit_the_operators_liveness_endpoint(defaults):
    (container,) = one(defaults, "Deployment")["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == "health"]
    assert f"--liveness=http://0.0.0.0:{port['containerPort']}/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}


def _env(objects: list[dict]) -> dict[str, str]:
    """The container's environment; a variable the downward API fills reads `<its fieldPath>`."""
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] if "value" in e else f"<{e['valueFrom']['fieldRef']['fieldPath']}>" for e in container["env"]}


def test_one_replica_has_no_disruption_budget(helm):
    objects = helm.template("operator.replicas=1")
    assert one(objects, "Deployment")["spec"]["replicas"] == 1 and by_kind(objects, "PodDisruptionBudget") == []


def test_operator_settings_from_values_are_ones_the_operator_reads(helm):
    objects = helm.template(
        "defaults.images.trainer=registry.example/trainer:1",
        "defaults.images.pathwaysServer=registry.example/server:1",
        "defaults.images.pathwaysProxy=registry.example/proxy:1",
        "defaults.cpuNodePool=batch-cpu",
        "defaults.podPriorityClassName=ml-batch",
        "operator.resyncSeconds=5",
        'json:operator.extraEnv=[{"name": "LORAJOB_RECONCILE_RETRY_BACKOFF_SECONDS", "value": "3"}]',
    )
    settings = OperatorSettings.from_env(_env(objects))  # raises on a name the operator does not know
    assert settings.render.images.trainer == "registry.example/trainer:1"
    assert settings.render.images.pathways_server == "registry.example/server:1"
    assert settings.render.images.pathways_proxy == "registry.example/proxy:1"
    assert settings.render.cpu_node_pool == "batch-cpu"
    assert settings.render.priority_class_name == "ml-batch"
    assert settings.reconcile.resync_seconds == 5.0
    assert settings.reconcile.retry_backoff_seconds == 3.0


def test_watching_namespaces_binds_permissions_per_namespace(helm):
    objects = helm.template("operator.watchNamespaces={team-a,team-b}")
    bindings = [b for b in by_kind(objects, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    assert {b["roleRef"]["name"] for b in bindings} == {f"{FULLNAME}-namespaced"}
    assert [b["roleRef"]["name"] for b in by_kind(objects, "ClusterRoleBinding")] == [f"{FULLNAME}-cluster"]
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]


def test_optional_parts_can_be_switched_off(helm):
    objects = helm.template(
        "admissionPolicy.enabled=false", "rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=existing",
        "metrics.service.enabled=false", "podDisruptionBudget.enabled=false",
    )
    assert sorted(o["kind"] for o in objects) == ["Deployment"]
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_the_metrics_endpoint_is_exposed_and_scraped_when_asked(helm, defaults):
    (container,) = one(defaults, "Deployment")["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert OperatorSettings.from_env(_env(defaults)).metrics.port == port["containerPort"]
    service = one(defaults, "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": port["containerPort"], "targetPort": "metrics"}]
    pod_labels = one(defaults, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert not by_kind(defaults, "ServiceMonitor")

    objects = helm.template("metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom")
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= one(objects, "Service")["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]


KUEUE_VALUES = [
    "kueue.enabled=true",
    'json:kueue.tpuFlavors=[{"name": "v6e-4x4", "accelerator": "tpu-v6e-slice", "topology": "4x4",'
    ' "quota": {"tpu": "32", "cpu": "720", "memory": "2880Gi"}},'
    ' {"name": "v5p-4x4x4", "accelerator": "tpu-v5p-slice", "topology": "4x4x4", "nodePool": "v5p-pool",'
    ' "quota": {"tpu": "64", "cpu": "1600", "memory": "6000Gi"}}]',
    'json:kueue.localQueues=[{"namespace": "team-a", "name": "lorajob"}, {"namespace": "team-b", "name": "lorajob"}]',
]


def test_kueue_objects_cover_tpu_cpu_and_memory(helm):
    objects = helm.template(*KUEUE_VALUES)
    flavors = {f["metadata"]["name"]: f["spec"] for f in by_kind(objects, "ResourceFlavor")}
    assert flavors["cpu-np"] == {"nodeLabels": {"cloud.google.com/gke-nodepool": "cpu-np"}}
    assert flavors["v5p-4x4x4"]["nodeLabels"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "4x4x4",
        "cloud.google.com/gke-nodepool": "v5p-pool",
    }
    assert flavors["v6e-4x4"]["tolerations"] == [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    (group,) = one(objects, "ClusterQueue")["spec"]["resourceGroups"]
    assert group["coveredResources"] == ["cpu", "memory", "google.com/tpu"]
    assert [f["name"] for f in group["flavors"]] == ["cpu-np", "v6e-4x4", "v5p-4x4x4"]  # CPU first
    quotas = {f["name"]: {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in group["flavors"]}
    assert quotas["cpu-np"]["google.com/tpu"] == "0"
    assert quotas["v5p-4x4x4"] == {"cpu": "1600", "memory": "6000Gi", "google.com/tpu": "64"}
    queues = by_kind(objects, "LocalQueue")
    assert {(q["metadata"]["namespace"], q["spec"]["clusterQueue"]) for q in queues} == {("team-a", "lorajob"), ("team-b", "lorajob")}
    assert {w["metadata"]["name"]: w["value"] for w in by_kind(objects, "WorkloadPriorityClass")} == {
        "lorajob-low": 100, "lorajob-high": 1000,
    }


def test_policies_from_values_are_valid_lorajob_policies(helm):
    objects = helm.template(
        'json:policies=[{"name": "team-a", "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}},'
        ' "queues": {"default": "lorajob", "allowed": ["lorajob"]}, "tpu": {"maxSlices": 2}}}]'
    )
    (rendered,) = by_kind(objects, "LoRAJobPolicy")
    parsed = policy.LoRAJobPolicy.from_object(rendered)
    assert parsed.spec.queues.default == "lorajob" and parsed.spec.tpu.max_slices == 2


def test_admission_policy_carries_the_generated_rules(defaults):
    vap = one(defaults, "ValidatingAdmissionPolicy")
    generated = policy.admission_policy_rules()
    assert vap["spec"]["variables"] == generated["variables"]
    assert vap["spec"]["validations"] == generated["validations"]
    assert vap["spec"]["paramKind"] == {"apiVersion": "lorajob.dev/v1alpha1", "kind": policy.KIND}
    binding = one(defaults, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
    assert binding["spec"]["validationActions"] == ["Deny"]


def test_schema_accelerators_are_the_catalogues():
    schema = json.loads((CHART / "values.schema.json").read_text())
    flavor = schema["properties"]["kueue"]["properties"]["tpuFlavors"]["items"]
    assert set(flavor["properties"]["accelerator"]["enum"]) == {m.accelerator for m in accelerators.TPU_MACHINES.values()}


@pytest.mark.parametrize(
    "value, complaint",
    [
        ("replicaCount=2", "replicaCount"),  # one replica is not a choice: kopf runs standalone
        ("operator.resyncSeconds=0", "resyncSeconds"),
        ("colour=blue", "colour"),
        ("operator.healthPort=80", "healthPort"),
        ('json:operator.extraEnv=[{"name": "HTTP_PROXY", "value": "x"}]', "extraEnv"),
        ('json:kueue.tpuFlavors=[{"name": "x", "accelerator": "tpu-v9", "topology": "4x4", "quota": {"tpu": "4", "cpu": "1", "memory": "1Gi"}}]', "accelerator"),
        ('json:kueue.localQueues=[{"namespace": "Team_A", "name": "q"}]', "namespace"),
        ("admissionPolicy.failurePolicy=Sometimes", "failurePolicy"),
        ("defaults.cpuNodePool=", "cpuNodePool"),
    ],
)
def test_bad_values_fail_with_the_field_named(helm, value, complaint):
    args = ["template", "x", str(CHART), "--namespace", RELEASE_NAMESPACE, "--kube-version", TEMPLATE_KUBE_VERSION]
    args += ["--set-json" if value.startswith("json:") else "--set", value.removeprefix("json:")]
    result = helm.run(*args, check=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr and complaint in result.stderr, result.stderr
