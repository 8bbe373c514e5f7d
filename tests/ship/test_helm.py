"""The Helm chart, offline: `helm lint`, `helm template` for several value sets, and the values schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from shipkit import API_FULLNAME, CHART, FULLNAME, RELEASE_NAMESPACE, api_values, set_args
from lorajob_operator import accelerators, policy
from lorajob_operator.openai_api.config import REQUEST_FIELDS, Limits, ModelOffer, ServerConfig
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


@pytest.mark.parametrize("values", [[], api_values("team-a")], ids=["defaults", "api"])
def test_lint_is_clean(helm, values):
    result = helm.run("lint", "--strict", str(CHART), *set_args(*values))
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
    refusal = helm.refusal(value)
    assert "values don't meet the specifications of the schema" in refusal and complaint in refusal, refusal


# --- The fine-tuning API server (api.*) -------------------------------------------------------------------

API_NAMESPACES = ["team-a", "team-b"]
API_SUBJECTS = [{"kind": "ServiceAccount", "name": API_FULLNAME, "namespace": RELEASE_NAMESPACE}]


@pytest.fixture(scope="module")
def api_objects(helm) -> list[dict]:
    return helm.template(*api_values(*API_NAMESPACES))


def api_part(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "api"]


def named(objects: list[dict], kind: str, name: str = API_FULLNAME) -> dict:
    (found,) = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def test_the_api_is_off_by_default(defaults):
    assert yaml.safe_load((CHART / "values.yaml").read_text())["api"]["enabled"] is False
    assert api_part(defaults) == []
    assert not [o for o in defaults if o["metadata"]["name"].startswith(API_FULLNAME)]


def test_enabling_the_api_adds_its_own_objects_and_changes_no_other(defaults, api_objects):
    assert [o for o in api_objects if o not in api_part(api_objects)] == [
        o for o in defaults if o["kind"] != "CustomResourceDefinition"
    ]
    placed = sorted((o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in api_part(api_objects))
    assert placed == sorted([
        ("ServiceAccount", API_FULLNAME, RELEASE_NAMESPACE), ("ConfigMap", API_FULLNAME, RELEASE_NAMESPACE),
        ("Deployment", API_FULLNAME, RELEASE_NAMESPACE), ("Service", API_FULLNAME, RELEASE_NAMESPACE),
        ("ClusterRole", API_FULLNAME, None), ("ClusterRoleBinding", API_FULLNAME, None),
        ("ClusterRoleBinding", f"{API_FULLNAME}-auth-delegator", None),
        ("Role", API_FULLNAME, "team-a"), ("RoleBinding", API_FULLNAME, "team-a"),
        ("Role", API_FULLNAME, "team-b"), ("RoleBinding", API_FULLNAME, "team-b"),
    ])


def test_api_deployment_runs_the_server_as_hardened_as_the_operator(api_objects):
    operator = named(api_objects, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    (operator_container,) = operator["containers"]
    deployment = named(api_objects, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == operator_container["image"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080}]
    assert container["command"] == ["lorajob", "api", "--config", "/etc/lorajob-api/config.yaml", "--listen", "0.0.0.0:8080"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert pod["serviceAccountName"] == named(api_objects, "ServiceAccount")["metadata"]["name"] == API_FULLNAME
    assert pod["securityContext"] == operator["securityContext"] and pod["securityContext"]["runAsNonRoot"] is True
    security = container["securityContext"]
    assert security == operator_container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]  # uploads are spooled there
    assert mounts["/etc/lorajob-api"]["readOnly"] is True
    assert volumes[mounts["/etc/lorajob-api"]["name"]]["configMap"]["name"] == named(api_objects, "ConfigMap")["metadata"]["name"]


def test_api_service_reaches_the_server_and_no_selector_crosses_over(api_objects):
    api = named(api_objects, "Deployment")["spec"]
    operator = named(api_objects, "Deployment", FULLNAME)["spec"]
    service = named(api_objects, "Service")["spec"]
    assert service["type"] == "ClusterIP"
    assert service["ports"] == [{"name": "http", "port": 80, "targetPort": "http"}]
    api_pods, operator_pods = api["template"]["metadata"]["labels"], operator["template"]["metadata"]["labels"]
    assert service["selector"].items() <= api_pods.items() and api["selector"]["matchLabels"].items() <= api_pods.items()
    # The operator's Deployment, PodDisruptionBudget and metrics Service select on its selector labels.
    assert not operator["selector"]["matchLabels"].items() <= api_pods.items()
    assert not named(api_objects, "Service", f"{FULLNAME}-metrics")["spec"]["selector"].items() <= api_pods.items()
    assert not api["selector"]["matchLabels"].items() <= operator_pods.items()


def test_api_config_is_a_server_config(api_objects):
    config = ServerConfig.model_validate(yaml.safe_load(named(api_objects, "ConfigMap")["data"]["config.yaml"]))
    assert config.storage == "gs://ship-bucket/api"
    assert config.namespaces == API_NAMESPACES
    assert list(config.models) == ["qwen3-0.6b"] and config.models["qwen3-0.6b"].owned_by == "ship"
    assert config.limits == Limits()  # none set: the server's defaults


def test_a_config_change_and_only_that_rolls_the_api_pods(helm, api_objects):
    def checksum(objects: list[dict]) -> str:
        return named(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    changed = helm.template(*api_values(*API_NAMESPACES), "api.config.limits.fileLines=10", "api.config.limits.lineErrors=5")
    limits = ServerConfig.model_validate(yaml.safe_load(named(changed, "ConfigMap")["data"]["config.yaml"])).limits
    assert (limits.file_lines, limits.line_errors) == (10, 5)
    assert checksum(changed) != checksum(api_objects)
    assert checksum(helm.template(*api_values(*API_NAMESPACES), "api.replicas=2")) == checksum(api_objects)


def test_api_rbac_is_exactly_the_servers_calls(api_objects):
    bindings = {b["roleRef"]["name"]: b for b in by_kind(api_part(api_objects), "ClusterRoleBinding")}
    assert set(bindings) == {"system:auth-delegator", API_FULLNAME}  # tokenreviews, subjectaccessreviews: create
    assert all(b["roleRef"]["kind"] == "ClusterRole" and b["subjects"] == API_SUBJECTS for b in bindings.values())
    assert named(api_objects, "ClusterRole")["rules"] == [
        {"apiGroups": [""], "resources": ["namespaces"], "resourceNames": API_NAMESPACES, "verbs": ["get"]},
        {"apiGroups": ["lorajob.dev"], "resources": ["lorajobpolicies"], "verbs": ["list"]},
    ]
    roles = by_kind(api_part(api_objects), "Role")
    role_bindings = by_kind(api_part(api_objects), "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(b["metadata"]["namespace"] for b in role_bindings) == API_NAMESPACES
    for role in roles:
        assert role["rules"] == [
            {"apiGroups": ["lorajob.dev"], "resources": ["lorajobs"], "verbs": ["get", "list", "create", "patch"]},
            {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
        ]
    for binding in role_bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": API_FULLNAME}
        assert binding["subjects"] == API_SUBJECTS


def test_api_values_reach_its_objects(helm):
    objects = helm.template(
        *api_values("team-a"), "api.replicas=2", "api.port=9000", "api.service.type=LoadBalancer", "api.service.port=443",
        'json:api.serviceAccount.annotations={"iam.gke.io/gcp-service-account": "api@p.iam.gserviceaccount.com"}',
        'json:api.extraVolumes=[{"name": "data", "persistentVolumeClaim": {"claimName": "lorajob-data"}}]',
        'json:api.extraVolumeMounts=[{"name": "data", "mountPath": "/data"}]',
        "api.tmpSizeLimit=8Gi", "api.podAnnotations.team=ml",
    )
    deployment = named(objects, "Deployment")["spec"]
    pod = deployment["template"]["spec"]
    (container,) = pod["containers"]
    assert deployment["replicas"] == 2
    assert container["ports"] == [{"name": "http", "containerPort": 9000}] and container["command"][-1] == "0.0.0.0:9000"
    assert named(objects, "Service")["spec"]["type"] == "LoadBalancer"
    assert named(objects, "Service")["spec"]["ports"] == [{"name": "http", "port": 443, "targetPort": "http"}]
    annotations = named(objects, "ServiceAccount")["metadata"]["annotations"]
    assert annotations == {"iam.gke.io/gcp-service-account": "api@p.iam.gserviceaccount.com"}
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "lorajob-data"}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}} in pod["volumes"]
    assert deployment["template"]["metadata"]["annotations"]["team"] == "ml"


def test_api_with_an_existing_service_account_and_no_rbac(helm):
    objects = helm.template(*api_values("team-a"), "api.serviceAccount.create=false", "api.serviceAccount.name=fine-tuning")
    assert not by_kind(api_part(objects), "ServiceAccount")
    assert named(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "fine-tuning"
    bindings = by_kind(api_part(objects), "ClusterRoleBinding") + by_kind(api_part(objects), "RoleBinding")
    assert {s["name"] for b in bindings for s in b["subjects"]} == {"fine-tuning"}
    # rbac.create=false leaves every role and binding, the server's too, to the cluster's admins.
    objects = helm.template(*api_values("team-a"), "rbac.create=false")
    assert sorted(o["kind"] for o in api_part(objects)) == ["ConfigMap", "Deployment", "Service", "ServiceAccount"]


def test_api_namespaces_must_be_ones_the_operator_watches(helm):
    refusal = helm.refusal(*api_values("team-a", "team-b"), "operator.watchNamespaces={team-a,team-c}")
    assert "api.config.namespaces has team-b, which operator.watchNamespaces leaves out" in refusal, refusal
    objects = helm.template(*api_values("team-a"), "operator.watchNamespaces={team-a,team-c}")
    assert [r["metadata"]["namespace"] for r in by_kind(api_part(objects), "Role")] == ["team-a"]


def test_schema_api_config_has_the_servers_fields():
    schema = json.loads((CHART / "values.schema.json").read_text())
    config = schema["properties"]["api"]["properties"]["config"]["properties"]

    def aliases(model) -> set[str]:
        return {field.alias for field in model.model_fields.values()}

    assert set(config) == aliases(ServerConfig)
    assert set(config["limits"]["properties"]) == aliases(Limits)
    assert set(config["models"]["additionalProperties"]["properties"]) == aliases(ModelOffer)


# Fields of a model's template: what each request decides (the server refuses them there), and others it takes.
TEMPLATE_FIELDS = [*REQUEST_FIELDS, "training.steps", "training.packing", "output.baseOutputDirectory",
                   "training.learningRate", "output.compilationCache", "lora.rank", "model.name"]


@pytest.mark.parametrize("field", TEMPLATE_FIELDS)
def test_schema_refuses_in_a_models_template_what_the_server_refuses(helm, field):
    *parents, leaf = field.split(".")
    template = {leaf: "x"}
    for parent in reversed(parents):
        template = {parent: template}
    try:
        ModelOffer.model_validate({"template": template})
        server_refuses = False
    except ValidationError:
        server_refuses = True
    models = json.dumps({"m": {"template": template}})
    refusal = helm.refusal(*api_values("team-a"), f"json:api.config.models={models}")
    assert bool(refusal) == server_refuses, refusal
    assert not refusal or f"/template/{field.replace('.', '/')}': false schema" in refusal, refusal


def test_enabling_the_api_without_its_config_names_what_is_missing(helm):
    refusal = helm.refusal("api.enabled=true")
    assert "values don't meet the specifications of the schema" in refusal
    assert all(f"at '/api/config/{field}'" in refusal for field in ("storage", "namespaces", "models")), refusal


@pytest.mark.parametrize(
    "value, complaint",
    [
        ("api.config.storage=", "at '/api/config/storage'"),
        ("api.config.storage=s3://bucket/api", "at '/api/config/storage'"),
        ("json:api.config.namespaces=[]", "at '/api/config/namespaces'"),
        ('json:api.config.namespaces=["Team_A"]', "at '/api/config/namespaces/0'"),
        ("json:api.config.models={}", "at '/api/config/models'"),
        ('json:api.config.models={"m": {"ownedBy": "me"}}', "missing property 'template'"),
        ("api.config.limits.lineErrors=5000", "at '/api/config/limits/lineErrors'"),
        ("api.config.limits.fileBytes=0", "at '/api/config/limits/fileBytes'"),
        ("api.config.limits.perHour=3", "'perHour' not allowed"),
        ("api.config.colour=blue", "'colour' not allowed"),
        ("api.service.type=ExternalName", "at '/api/service/type'"),
        ("api.port=80", "at '/api/port'"),
        ("api.tmpSizeLimit=lots", "at '/api/tmpSizeLimit'"),
    ],
)
def test_bad_api_values_fail_with_the_field_named(helm, value, complaint):
    refusal = helm.refusal(*api_values("team-a"), value)
    assert "values don't meet the specifications of the schema" in refusal and complaint in refusal, refusal
