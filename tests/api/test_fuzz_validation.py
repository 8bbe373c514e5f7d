"""Generated LoRAJobs, valid and broken: each valid example with zero to three edits drawn by hypothesis
from the generated CRD schema (edge and huge numbers, null, odd unicode, values on and just past a
limit, wrong types, missing and unknown fields, bad names, a training method with a dataset layout and preference
settings drawn together). Derandomized: every run draws the same cases.

* offline: `lorajob validate` never crashes and passes every unedited example; what it accepts, the
  operator parses and renders every step of (an accepted LoRAJob never fails as InvalidSpec). The
  operator's own pass (observe from caches holding what the spec needs, then decide) creates the first
  step's JobSet of every accepted case and no child of any rejected one: an object that bypassed or
  predates the CRD's rules, CEL included, fails as InvalidSpec instead.
* against kube-apiserver: the offline verdict is the server's (dry-run create, strict field validation).

`pytest -n 0 -s` prints the counts.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime, UTC
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client
from kubernetes.client.rest import ApiException

from lorajob_devcluster import wait_for
from lorajob_operator import api, caches, crd, jobsets, names, rules, validation
from lorajob_operator.controller.observe import observe
from lorajob_operator.reconcile import decide
from lorajob_operator.local import OperatorProcess
from lorajob_operator.settings import ReconcileSettings, RenderSettings
from lorajob_operator.validation import FieldError, apply_defaults, validate
from lorajob_trainer.contract.records import COLUMN_LAYOUTS, PREFERENCE_COLUMN_LAYOUTS, TRAINING_METHODS

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = [yaml.safe_load(path.read_text()) for path in sorted((REPO / "examples").glob("*.yaml"))]
SCHEMA = crd.openapi_schema()
OFFLINE_CASES = 2000
SERVER_CASES = 200
NAMESPACE = "api-fuzz"
# celpy's parser raises the recursion limit while hypothesis runs a case; hypothesis warns it cannot reset it.
pytestmark = [pytest.mark.filterwarnings("ignore:The recursion limit will not be reset"), pytest.mark.slow(minutes=3)]


def fuzz(cases: int) -> settings:
    return settings(max_examples=cases, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))


ODD_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
ODD_STRINGS = st.one_of(
    ODD_TEXT,
    st.sampled_from(["", " ", "\n", "a\n", "gs://b\n", "Ω", "é", "e\u0301", "\u202ehf", "\u0000", "🦙" * 3, "x" * 70, "4x4\n"]),
)
HUGE_INTS = st.sampled_from([0, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, -(2**63)])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False) | ODD_TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(ODD_TEXT, children, max_size=3),
    max_leaves=6,
)


def _fields(schema: dict, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """(path, schema) of every field under spec (array items as index 0)."""
    found = [(path, schema)] if path else []
    for name, sub in schema.get("properties", {}).items():
        found += _fields(sub, (*path, name))
    if "items" in schema:
        found += _fields(schema["items"], (*path, 0))
    return found


FIELDS = [(("spec", *path), schema) for path, schema in _fields(SCHEMA["properties"]["spec"])]
OBJECTS = [(("spec",), SCHEMA["properties"]["spec"])] + [field for field in FIELDS if "properties" in field[1]]
"""The objects with fields, where an extra one is unknown (a map, e.g. tracking.mlflow.tags, takes any key)."""


def _near_limits(schema: dict) -> list:
    """Values on and just past each declared limit of a field."""
    values = []
    for key in ("minimum", "maximum"):
        if key in schema:
            bound = schema[key]
            values += [bound, bound - 1, bound + 1] if schema["type"] == "integer" else [bound, bound - 1e-9, bound + 1e-9, bound * 10]
    if "maxLength" in schema:
        values += ["a" * schema["maxLength"], "a" * (schema["maxLength"] + 1)]
    if "maxItems" in schema:
        values += [["messages"] * schema["maxItems"], ["messages"] * (schema["maxItems"] + 1), []]
    return values


def _value(schema: dict) -> st.SearchStrategy:
    """A value for a field: of its type (edges included) or of any other."""
    kind = schema.get("type")
    if kind == "integer":
        of_type = st.integers() | HUGE_INTS
    elif kind == "number":
        of_type = st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(2**53), 2**53) | st.sampled_from([-0.0, 5e-324, 1e308])
    elif kind == "string":
        of_type = ODD_STRINGS | st.sampled_from(schema.get("enum", ["valid-name"]))
    elif kind == "boolean":
        of_type = st.booleans()
    elif kind == "array":
        of_type = st.lists(_value(schema["items"]), max_size=4)
    else:
        of_type = st.dictionaries(ODD_TEXT, JSON_VALUES, max_size=2)
    limits = _near_limits(schema)
    others = st.none() | JSON_VALUES  # null: the server prunes it (then defaults), as if the field were absent
    return st.one_of(of_type, st.sampled_from(limits), others) if limits else of_type | others


def _set(node, path: tuple, value) -> None:
    """node[path[0]][path[1]]... = value, making (or replacing) the containers on the way."""
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        node.extend({} for _ in range(key + 1 - len(node)))
    if not rest:
        node[key] = value
        return
    want = list if isinstance(rest[0], int) else dict
    child = node[key] if isinstance(node, list) or key in node else None
    if not isinstance(child, want):
        child = node[key] = want()
    _set(child, rest, value)


def _delete(node, path: tuple) -> None:
    for key in path[:-1]:
        present = isinstance(key, int) and key < len(node) if isinstance(node, list) else key in node
        if not present or not isinstance(node[key], (dict, list)):
            return
        node = node[key]
    if isinstance(node, dict):
        node.pop(path[-1], None)


PREFERENCE_FIELDS = SCHEMA["properties"]["spec"]["properties"]["preference"]["properties"]
LAYOUTS = COLUMN_LAYOUTS + PREFERENCE_COLUMN_LAYOUTS


def _plausible(schema: dict) -> st.SearchStrategy:
    """A preference setting: mostly one of the values people write (its limits included), sometimes anything."""
    if "enum" in schema:
        usual = st.sampled_from(schema["enum"])
    else:
        usual = st.sampled_from([0, 0.0, 0.05, 0.1, 0.25, 0.49, 0.5, 1, 2.5])
    return st.one_of(usual, usual, usual, _value(schema))


@st.composite
def method_edit(draw, doc: dict) -> str:
    """Set spec.method, dataset.columns and (half the time) spec.preference together: drawn one field at a time, the
    edits seldom make a preference LoRAJob the rules accept, nor a near miss."""
    method = draw(st.sampled_from(TRAINING_METHODS))
    _set(doc, ("spec", "method"), method)
    _set(doc, ("spec", "dataset", "columns"), list(draw(st.sampled_from(LAYOUTS))))
    if draw(st.booleans()):
        fields = draw(st.lists(st.sampled_from(sorted(PREFERENCE_FIELDS)), unique=True, max_size=len(PREFERENCE_FIELDS)))
        _set(doc, ("spec", "preference"), {name: draw(_plausible(PREFERENCE_FIELDS[name])) for name in fields})
    return f"method {method}, columns {doc['spec']['dataset']['columns']}, preference {doc['spec'].get('preference')}"


@st.composite
def edit(draw, doc: dict) -> str:
    """Apply one random edit to `doc`; return what it did."""
    action = draw(st.sampled_from(["set", "set", "set", "delete", "extra", "method"]))
    if action == "method":
        return draw(method_edit(doc))
    path, schema = draw(st.sampled_from(OBJECTS if action == "extra" else FIELDS))
    if action == "delete":
        _delete(doc, path)
    elif action == "extra":
        path = (*path, draw(ODD_TEXT.filter(lambda text: text not in schema["properties"])))
        _set(doc, path, draw(JSON_VALUES))
    else:
        _set(doc, path, draw(_value(schema)))
    return f"{action} {'.'.join(map(str, path))}"


@st.composite
def lorajobs(draw) -> tuple[dict, list[str]]:
    """A valid example with 0-3 edits (0: the unchanged example, which must pass)."""
    doc = copy.deepcopy(draw(st.sampled_from(EXAMPLES)))
    doc["metadata"] = {"name": doc["metadata"]["name"]}
    edits = [draw(edit(doc)) for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()):
        doc["metadata"]["name"] = draw(st.sampled_from(["fuzz", "fuzz-" + "a" * 30, "-fuzz", "Fuzz", "a" * 254]))
        edits.append(f"metadata.name {doc['metadata']['name']}")
    return doc, edits


def _stored(doc: dict) -> dict:
    """The object as the API server would store it (JSON round trip, defaults) and the operator read it."""
    body = apply_defaults(json.loads(json.dumps(doc)), SCHEMA)
    body["metadata"] |= {"namespace": NAMESPACE, "uid": "uid-fuzz"}
    return body


def _as_kubectl_sends(node):
    """`node` without null map values: kubectl drops them before sending (`lora.dropout: null` is applied as if
    absent, while a raw client sending it gets "unknown field"), and `lorajob validate` predicts kubectl apply."""
    if isinstance(node, dict):
        return {key: _as_kubectl_sends(value) for key, value in node.items() if value is not None}
    if isinstance(node, list):
        return [_as_kubectl_sends(item) for item in node]
    return node


def _storable(error: FieldError) -> bool:
    """Whether an object with this error could still be stored (a CRD changed since, admission bypassed): the
    API server always prunes unknown fields and checks object names itself."""
    return error.kind != "unknown field" and not error.field.startswith("metadata.")


def _operator_pass(body: dict, spec: api.LoRAJobSpec | None) -> decide.Decision:
    """The operator's decision on `body` from caches that hold its namespace and, when it parsed, the LocalQueue
    it names (so that only the spec decides)."""
    view = caches.Caches([NAMESPACE])
    view.stores[caches.NAMESPACES].upsert({"metadata": {"name": NAMESPACE, "resourceVersion": "1"}})
    if spec and spec.scheduling.queue_name:
        view.stores[caches.LOCAL_QUEUES].upsert({"metadata": {"name": spec.scheduling.queue_name, "namespace": NAMESPACE,
                                                              "resourceVersion": "1"}, "spec": {"clusterQueue": "cq"}})
    observed = observe(view, body, datetime(2026, 1, 1, tzinfo=UTC), RenderSettings())
    return decide.decide(observed, ReconcileSettings())


COUNTS = {"offline": 0, "offline accepted": 0, "offline accepted dpo/orpo": 0, "offline edits": 0, "refused by the operator too": 0, "server": 0, "server accepted": 0}
"""Printed (pytest -n 0 -s) at the end of each test: how many cases ran and how they ended."""


def test_offline_validation_and_the_operator_agree():
    offline_case()
    assert COUNTS["offline"] >= OFFLINE_CASES
    print(f"fuzz cases: {COUNTS}")


@fuzz(OFFLINE_CASES)
@given(lorajobs())
def offline_case(case):
    doc, edits = case
    errors = validate(doc)
    assert all(error.field is not None and error.kind for error in errors)
    body = _stored(doc)
    spec, why = validation.parse_spec(body)
    if not errors:  # the operator runs it: every step renders
        assert spec is not None, (edits, doc["spec"], why)
        rendered = jobsets.render_all(spec, jobsets.Owner(body["metadata"]["name"], NAMESPACE, "uid-fuzz"), RenderSettings())
        assert [js["metadata"]["labels"][names.LABEL_PHASE] for js in rendered] == rules.phases(spec)
    if not edits:
        assert errors == [], [str(e) for e in errors]
    decision = _operator_pass(body, spec)
    storable = any(_storable(error) for error in errors)
    if storable:  # as if it had reached the operator past admission
        assert decision.create == [] and decision.status["phase"] == api.Phase.Failed.value, (edits, doc["spec"])
        assert spec is None, (edits, [str(e) for e in errors])
    elif not errors:
        first = [] if spec.suspend else rules.phases(spec)[:1]
        assert [create.phase for create in decision.create] == first, (edits, decision.status)
    COUNTS["offline"] += 1
    COUNTS["offline accepted"] += not errors
    COUNTS["offline accepted dpo/orpo"] += not errors and spec.method != "sft"
    COUNTS["refused by the operator too"] += storable
    COUNTS["offline edits"] += len(edits)


@pytest.fixture(scope="module")
def custom(kube):
    kube.kubectl("create", "namespace", NAMESPACE, check=False)
    return client.CustomObjectsApi(kube.api_client())


@pytest.mark.apiserver
def test_the_api_server_gives_the_offline_verdict(custom):
    @fuzz(SERVER_CASES)
    @given(lorajobs())
    def agree(case):
        doc, edits = case
        offline = validate(doc)
        try:
            custom.create_namespaced_custom_object(
                api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, _as_kubectl_sends(doc), dry_run="All", field_validation="Strict"
            )
            server = None
        except ApiException as error:
            assert error.status in (400, 422), error.body
            server = json.loads(error.body)["message"]
        assert (server is None) == (offline == []), (edits, server, [str(e) for e in offline])
        COUNTS["server"] += 1
        COUNTS["server accepted"] += server is None

    agree()
    assert COUNTS["server"] >= SERVER_CASES
    print(f"fuzz cases: {COUNTS}")


RUN_NAMESPACE = "api-fuzz-run"
RUN_CASES = 8


def _settled(obj: dict) -> bool:
    """A status of the object's own generation, in a phase of the API; a Failed one says why."""
    status = obj.get("status") or {}
    if status.get("observedGeneration") != obj["metadata"]["generation"] or status.get("phase") not in {p.value for p in api.Phase}:
        return False
    failed = [c for c in status.get("conditions") or [] if c["type"] == "Failed" and c["status"] == "True"]
    return status["phase"] != api.Phase.Failed.value or bool(failed and failed[0].get("reason") and failed[0].get("message"))


@pytest.mark.cluster
def test_accepted_cases_run_on_the_operator_to_a_settled_status(sim_cluster, tmp_path):
    """Accepted cases, created for real beside a running operator (its default settings): each gets a settled
    status of its generation, the operator neither crashes nor stops answering, and every JobSet belongs to one."""
    accepted: list[dict] = []

    @fuzz(200)
    @given(lorajobs())
    def collect(case):
        doc = copy.deepcopy(case[0])  # hypothesis may hand the same objects to a later case, whose edits would change it
        doc["metadata"]["name"] = f"fuzz-run-{len(accepted)}"
        if len(accepted) < RUN_CASES and not validate(doc):
            accepted.append(doc)

    collect()
    assert len(accepted) == RUN_CASES
    core, custom = client.CoreV1Api(sim_cluster.api_client()), client.CustomObjectsApi(sim_cluster.api_client())
    specs = [validation.parse_spec(_stored(doc))[0] for doc in accepted]  # what they name exists: they can run
    sim_cluster.create_namespace_with_queue(RUN_NAMESPACE)
    for queue in {spec.scheduling.queue_name for spec in specs} - {None}:
        sim_cluster.create_namespace_with_queue(RUN_NAMESPACE, queue)
    secret_keys: dict[str, dict[str, str]] = {}
    for spec in specs:
        if (token := spec.credentials and spec.credentials.hugging_face_token) is not None:
            secret_keys.setdefault(token.name, {})[token.key] = "hf_fuzz"
    for name, keys in secret_keys.items():
        core.create_namespaced_secret(RUN_NAMESPACE, client.V1Secret(metadata=client.V1ObjectMeta(name=name), string_data=keys))
    log = tmp_path / "operator.log"
    with OperatorProcess(sim_cluster.kubeconfig, [RUN_NAMESPACE], log) as operator:
        for doc in accepted:
            custom.create_namespaced_custom_object(api.GROUP, api.VERSION, RUN_NAMESPACE, api.PLURAL, doc, field_validation="Strict")

        def lorajobs_now() -> list[dict]:
            return custom.list_namespaced_custom_object(api.GROUP, api.VERSION, RUN_NAMESPACE, api.PLURAL)["items"]

        def all_settled() -> list[dict] | None:
            found = lorajobs_now()
            return found if len(found) == RUN_CASES and all(map(_settled, found)) else None

        settled = wait_for(all_settled, 90, "every fuzzed LoRAJob to get a settled status")
        first = settled[0]["metadata"]["name"]  # still answering: a spec change is seen and settled too
        custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, RUN_NAMESPACE, api.PLURAL, first, {"spec": {"suspend": True}})
        wait_for(lambda: next(o for o in lorajobs_now() if o["metadata"]["name"] == first)["metadata"]["generation"] > 1
                 and all_settled(), 60, f"{first} to settle again after a spec change")
        assert operator.healthy(), operator.log_tail()
    assert "Traceback" not in log.read_text(), log.read_text()[-4000:]
    owners = {o["metadata"]["uid"] for o in lorajobs_now()}
    jobsets = sim_cluster.get_json("jobsets.jobset.x-k8s.io", "-n", RUN_NAMESPACE)["items"]
    assert all({ref["uid"] for ref in js["metadata"].get("ownerReferences", [])} & owners for js in jobsets), jobsets
    print(f"fuzz cases run on the operator: {RUN_CASES}, phases {sorted(o['status']['phase'] for o in lorajobs_now())}, "
          f"reasons {sorted(c['reason'] for o in lorajobs_now() for c in o['status'].get('conditions', []) if c['status'] == 'True')}, "
          f"{len(jobsets)} JobSets")
