"""LoRAJobPolicy (lorajob.dev/v1alpha1, cluster-scoped): what the LoRAJobs of a set of namespaces may use.

An admin's policy selects namespaces by label and sets
* queues:   the default Kueue LocalQueue and the allowed ones,
* tpu:      the allowed machine types/topologies and the most slices and chips one LoRAJob may take,
* outputs:  the storage prefixes runs may write under,
* tracking: the experiment trackers every run must report to,
* defaults: images, the CPU node pool and the MLflow server used when a LoRAJob leaves them unset.

Each check is written once, as a `PolicyRule` holding the Python predicate the operator runs at
reconcile time next to the CEL expression the ValidatingAdmissionPolicy shipped in the Helm chart
runs at admission (the policy object is the VAP's parameter). Both build their message from the
same parts, so a rejected `kubectl apply` and a Failed LoRAJob say the same thing and name the rule.

Every matching policy applies on its own: a LoRAJob must satisfy all of them, and a LoRAJob without
a queue name is checked against each policy's own default queue (as the VAP sees one policy at a
time), one without an MLflow server against each policy's own default server. Defaults are resolved
here for the operator to record in status; they are never written into the LoRAJob's spec, so Git
stays the truth.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Annotated, Literal, TypeVar
from collections.abc import Callable, Iterable, Mapping

from pydantic import ConfigDict, Field

from lorajob_operator import accelerators, api, names
from lorajob_trainer.contract.records import TRACKERS

KIND = "LoRAJobPolicy"
PLURAL = "lorajobpolicies"
SHORT_NAMES = ("ljp",)
VIOLATION_REASON = "PolicyViolation"
"""Condition reason of a LoRAJob that the operator fails because a policy forbids it."""

_T = TypeVar("_T")
_LABEL_KEY_MAX = 317  # <253-character prefix>/<63-character name>
_LIST_MAX = 64


class _Model(api._Model):
    """The same conventions as the LoRAJob API (camelCase, forbid extras, docstrings as descriptions)."""


class LabelSelectorRequirement(_Model):
    """One namespace-label requirement, as in a Kubernetes label selector."""

    key: str = Field(max_length=_LABEL_KEY_MAX)
    """key of the namespace label."""
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    """operator relating the label to values."""
    values: list[Annotated[str, Field(max_length=names.LABEL_VALUE_MAX)]] = Field(default_factory=list, max_length=_LIST_MAX)
    """values for In and NotIn (empty for Exists and DoesNotExist)."""


class NamespaceSelector(_Model):
    """Selects namespaces by their labels; the empty selector selects every namespace."""

    match_labels: dict[str, Annotated[str, Field(max_length=names.LABEL_VALUE_MAX)]] = Field(
        default_factory=dict, max_length=_LIST_MAX
    )
    """matchLabels: every label given must be on the namespace with the same value."""
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)
    """matchExpressions: every requirement must hold."""


class QueuePolicy(_Model):
    """Kueue LocalQueues the LoRAJobs may use."""

    default: api.QueueName | None = None
    """default LocalQueue for LoRAJobs that set no spec.scheduling.queueName."""
    allowed: list[api.QueueName] = Field(default_factory=list, max_length=_LIST_MAX)
    """allowed LocalQueues; empty allows any. When set, a LoRAJob must name one (or rely on the default)."""


class TpuAllowance(_Model):
    """A TPU machine type and the slice topologies allowed for it."""

    machine_type: api.TpuMachineType
    """machineType of the TPU node pool, as in LoRAJob spec.compute.tpu.machineType."""
    topologies: list[api.Topology] = Field(default_factory=list, max_length=_LIST_MAX)
    """topologies allowed for this machine type; empty allows any."""


class TpuPolicy(_Model):
    """Limits on the TPU slices of the pathways and mcjax backends."""

    allowed: list[TpuAllowance] = Field(default_factory=list, max_length=16)
    """allowed machine types and topologies; empty allows any."""
    max_slices: int | None = Field(default=None, ge=1, le=64)
    """maxSlices is the most slices one LoRAJob may request."""
    max_chips_per_job: int | None = Field(default=None, ge=1, le=1_048_576)
    """maxChipsPerJob is the most TPU chips (slices x chips per slice) one LoRAJob may request."""


class OutputPolicy(_Model):
    """Where runs may write."""

    allowed_prefixes: list[api.StoragePath] = Field(default_factory=list, max_length=32)
    """allowedPrefixes (gs:// URIs or absolute paths) that spec.output.baseOutputDirectory, spec.output.compilationCache
    and spec.export.path must be under (equal to a prefix or below it at a '/' boundary); empty allows any."""


class TrackingPolicy(_Model):
    """Experiment tracking the LoRAJobs must do."""

    required: list[Literal[TRACKERS]] = Field(default_factory=list, max_length=len(TRACKERS))
    """required trackers (mlflow, wandb): a LoRAJob must set spec.tracking.<tracker>, except that a required mlflow is also met by this policy's defaults.mlflow."""


class PolicyDefaults(_Model):
    """Values the operator uses when a LoRAJob leaves them unset (recorded in status, never written to spec)."""

    images: api.ImagesSpec = Field(default_factory=api.ImagesSpec)
    """images used instead of the operator's defaults."""
    cpu_node_pool: str | None = Field(default=None, max_length=api.DNS_LABEL_MAX)
    """cpuNodePool for the Pathways head and the convert/export pods."""
    mlflow: api.MLflowTracking | None = None
    """mlflow is the MLflow tracking server (with its experiment and tags) that LoRAJobs setting no spec.tracking.mlflow report to. Leave its runName unset: each run is then named after its LoRAJob. A server that needs credentials reads them from each LoRAJob's credentials.mlflowToken (or mlflowUsername and mlflowPassword)."""


class LoRAJobPolicySpec(_Model):
    """LoRAJobPolicySpec sets, for the namespaces it selects, the queues, TPUs and output locations LoRAJobs may use and the experiment trackers they must report to."""

    namespace_selector: NamespaceSelector = Field(default_factory=NamespaceSelector)
    """namespaceSelector picks the namespaces this policy governs; empty selects all."""
    queues: QueuePolicy = Field(default_factory=QueuePolicy)
    """queues: default and allowed Kueue LocalQueues."""
    tpu: TpuPolicy = Field(default_factory=TpuPolicy)
    """tpu: allowed machine types, topologies and size limits."""
    outputs: OutputPolicy = Field(default_factory=OutputPolicy)
    """outputs: allowed storage locations."""
    tracking: TrackingPolicy = Field(default_factory=TrackingPolicy)
    """tracking: the experiment trackers required."""
    defaults: PolicyDefaults = Field(default_factory=PolicyDefaults)
    """defaults for images, the CPU node pool and the MLflow server."""


class LoRAJobPolicy(_Model):
    """A named policy as the operator reads it from the API server."""

    model_config = ConfigDict(extra="ignore")

    name: str
    spec: LoRAJobPolicySpec

    @classmethod
    def from_object(cls, obj: Mapping) -> LoRAJobPolicy:
        return cls(name=obj["metadata"]["name"], spec=obj.get("spec") or {})


# --- Namespace selection ---------------------------------------------------------------------------


def _requirement_holds(requirement: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    present = requirement.key in labels
    if requirement.operator == "In":
        return present and labels[requirement.key] in requirement.values
    if requirement.operator == "NotIn":
        return not (present and labels[requirement.key] in requirement.values)
    if requirement.operator == "Exists":
        return present
    return not present


def selects(selector: NamespaceSelector, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics over a namespace's labels."""
    return all(labels.get(key) == value for key, value in selector.match_labels.items()) and all(
        _requirement_holds(requirement, labels) for requirement in selector.match_expressions
    )


_SELECTOR = "params.spec.namespaceSelector"
_NAMESPACE_SELECTED_CEL = (
    f"(!has({_SELECTOR}.matchLabels) || {_SELECTOR}.matchLabels.all(k, k in variables.namespaceLabels"
    f" && variables.namespaceLabels[k] == {_SELECTOR}.matchLabels[k]))"
    f" && (!has({_SELECTOR}.matchExpressions) || {_SELECTOR}.matchExpressions.all(e,"
    " e.operator == 'In' ? (e.key in variables.namespaceLabels && variables.namespaceLabels[e.key] in e.values)"
    " : e.operator == 'NotIn' ? !(e.key in variables.namespaceLabels && variables.namespaceLabels[e.key] in e.values)"
    " : e.operator == 'Exists' ? e.key in variables.namespaceLabels"
    " : !(e.key in variables.namespaceLabels)))"
)


def matching(policies: Iterable[LoRAJobPolicy], namespace_labels: Mapping[str, str]) -> list[LoRAJobPolicy]:
    """The policies that govern a namespace, ordered by name."""
    return sorted(
        (policy for policy in policies if selects(policy.spec.namespace_selector, namespace_labels)),
        key=lambda policy: policy.name,
    )


# --- Rules: one Python predicate and one CEL expression each ------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """One policy check of one LoRAJob: the inputs every rule's Python side reads."""

    policy: LoRAJobPolicy
    spec: api.LoRAJobSpec

    @property
    def rules(self) -> LoRAJobPolicySpec:
        return self.policy.spec

    @property
    def queue(self) -> str:
        """The LoRAJob's queue, or this policy's default when it sets none ('' when neither)."""
        return self.spec.scheduling.queue_name or self.rules.queues.default or ""

    @property
    def tpu(self) -> api.TpuSpec | None:
        return self.spec.compute.tpu

    @property
    def tpu_chips(self) -> int:
        return self.tpu.slices * accelerators.chips_in(self.tpu.topology) if self.tpu else 0


@dataclasses.dataclass(frozen=True)
class Value:
    """A value interpolated into a rule's message: how Python and CEL each turn it into text."""

    py: Callable[[Check], str]
    cel: str


@dataclasses.dataclass(frozen=True)
class Predicate:
    py: Callable[[Check], bool]
    cel: str


@dataclasses.dataclass(frozen=True)
class PolicyRule:
    name: str
    """The policy field the rule enforces, quoted in every violation message."""
    applies: Predicate
    holds: Predicate
    detail: tuple[str | Value, ...]
    """Message parts after the common prefix: literal text and interpolated values."""

    def _parts(self) -> tuple[str | Value, ...]:
        return ('LoRAJobPolicy "', _POLICY_NAME, f'" rule {self.name}: ', *self.detail)

    def message(self, check: Check) -> str:
        return "".join(part if isinstance(part, str) else part.py(check) for part in self._parts())

    def cel_message(self) -> str:
        pieces: list[str] = []
        for literal, group in itertools.groupby(self._parts(), key=lambda part: isinstance(part, str)):
            parts = list(group)
            pieces += [_cel_string("".join(parts))] if literal else [f"({part.cel})" for part in parts]
        return " + ".join(pieces)

    def cel_validation(self) -> str:
        return f"!variables.namespaceSelected || !({self.applies.cel}) || ({self.holds.cel})"


_POLICY_NAME = Value(lambda c: c.policy.name, "params.metadata.name")


def _cel_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _quoted(value: Value) -> tuple[str | Value, ...]:
    return ('"', value, '"')


def _under_prefix(path: str, prefix: str) -> bool:
    """The prefix itself or below it at a '/' boundary (gs://b/team-a does not cover gs://b/team-ab)."""
    return (path + "/").startswith(prefix if prefix.endswith("/") else prefix + "/")


def _under_prefix_cel(path: str) -> str:
    return f"params.spec.outputs.allowedPrefixes.exists(p, ({path} + '/').startsWith(p.endsWith('/') ? p : p + '/'))"


def _tpu_allowance_text(allowance: TpuAllowance) -> str:
    return f"{allowance.machine_type} ({', '.join(allowance.topologies) or 'any topology'})"


def _under_allowed_prefix(field: str, path: Callable[[api.LoRAJobSpec], str | None], present: str = "") -> PolicyRule:
    """outputs.allowedPrefixes for the storage path at `field`, where the LoRAJob sets it (`present`: the CEL test
    that it is set, for an optional field)."""
    cel = "object." + field
    return PolicyRule(
        "outputs.allowedPrefixes",
        Predicate(lambda c: bool(c.rules.outputs.allowed_prefixes) and path(c.spec) is not None,
                  " && ".join(filter(None, ["size(params.spec.outputs.allowedPrefixes) > 0", present]))),
        Predicate(lambda c: any(_under_prefix(path(c.spec), p) for p in c.rules.outputs.allowed_prefixes),
                  _under_prefix_cel(cel)),
        (f"{field} ", *_quoted(Value(lambda c: path(c.spec), cel)), " is not under an allowed prefix: ", _ALLOWED_PREFIXES),
    )


def _tracker_required(tracker: str, default: Predicate | None = None) -> PolicyRule:
    """tracking.required for one tracker: the LoRAJob's spec.tracking sets it, or this policy's `default` stands in."""
    own = Predicate(lambda c: getattr(c.spec.tracking, tracker) is not None,
                    f"has(object.spec.tracking) && has(object.spec.tracking.{tracker})")
    holds = own if default is None else Predicate(lambda c: own.py(c) or default.py(c), f"({own.cel}) || {default.cel}")
    return PolicyRule(
        "tracking.required",
        Predicate(lambda c: tracker in c.rules.tracking.required, f"'{tracker}' in params.spec.tracking.required"),
        holds,
        (f"the runs of this namespace must report to {api.TRACKER_TITLES[tracker]}: set spec.tracking.{tracker}"
         + (" (the policy sets no default server in defaults.mlflow)" if default else ""),),
    )


_HAS_TPU = "has(object.spec.compute.tpu)"
_TPU = "object.spec.compute.tpu"

_ALLOWED_QUEUES = Value(lambda c: ", ".join(c.rules.queues.allowed), "params.spec.queues.allowed.join(', ')")
_ALLOWED_PREFIXES = Value(
    lambda c: ", ".join(c.rules.outputs.allowed_prefixes), "params.spec.outputs.allowedPrefixes.join(', ')"
)

RULES: tuple[PolicyRule, ...] = (
    PolicyRule(
        "queues.allowed",
        Predicate(lambda c: bool(c.rules.queues.allowed), "size(params.spec.queues.allowed) > 0"),
        Predicate(lambda c: c.queue != "", "variables.queue != ''"),
        ("spec.scheduling.queueName is required in this namespace (the policy sets no default queue); use one of: ", _ALLOWED_QUEUES),
    ),
    PolicyRule(
        "queues.allowed",
        Predicate(lambda c: bool(c.rules.queues.allowed) and c.queue != "", "size(params.spec.queues.allowed) > 0 && variables.queue != ''"),
        Predicate(lambda c: c.queue in c.rules.queues.allowed, "variables.queue in params.spec.queues.allowed"),
        ("queue ", *_quoted(Value(lambda c: c.queue, "variables.queue")), " is not allowed in this namespace; use one of: ", _ALLOWED_QUEUES),
    ),
    PolicyRule(
        "tpu.allowed",
        Predicate(lambda c: c.tpu is not None and bool(c.rules.tpu.allowed), f"{_HAS_TPU} && size(params.spec.tpu.allowed) > 0"),
        Predicate(
            lambda c: any(
                a.machine_type == c.tpu.machine_type and (not a.topologies or c.tpu.topology in a.topologies)
                for a in c.rules.tpu.allowed
            ),
            f"params.spec.tpu.allowed.exists(a, a.machineType == {_TPU}.machineType"
            f" && (size(a.topologies) == 0 || {_TPU}.topology in a.topologies))",
        ),
        (
            "TPU ",
            Value(lambda c: f"{c.tpu.machine_type} {c.tpu.topology}", f"{_TPU}.machineType + ' ' + {_TPU}.topology"),
            " (spec.compute.tpu) is not allowed in this namespace; allowed: ",
            Value(
                lambda c: "; ".join(_tpu_allowance_text(a) for a in c.rules.tpu.allowed),
                "params.spec.tpu.allowed.map(a, a.machineType + ' ('"
                " + (size(a.topologies) == 0 ? 'any topology' : a.topologies.join(', ')) + ')').join('; ')",
            ),
        ),
    ),
    PolicyRule(
        "tpu.maxSlices",
        Predicate(lambda c: c.tpu is not None and c.rules.tpu.max_slices is not None, f"{_HAS_TPU} && has(params.spec.tpu.maxSlices)"),
        Predicate(lambda c: c.tpu.slices <= c.rules.tpu.max_slices, f"{_TPU}.slices <= params.spec.tpu.maxSlices"),
        (
            "spec.compute.tpu.slices is ",
            Value(lambda c: str(c.tpu.slices), f"string({_TPU}.slices)"),
            "; at most ",
            Value(lambda c: str(c.rules.tpu.max_slices), "string(params.spec.tpu.maxSlices)"),
            " slices are allowed per LoRAJob in this namespace",
        ),
    ),
    PolicyRule(
        "tpu.maxChipsPerJob",
        Predicate(
            lambda c: c.tpu is not None and c.rules.tpu.max_chips_per_job is not None,
            f"{_HAS_TPU} && has(params.spec.tpu.maxChipsPerJob)",
        ),
        Predicate(lambda c: c.tpu_chips <= c.rules.tpu.max_chips_per_job, "variables.tpuChips <= params.spec.tpu.maxChipsPerJob"),
        (
            "the LoRAJob requests ",
            Value(lambda c: str(c.tpu_chips), "string(variables.tpuChips)"),
            " TPU chips (",
            Value(lambda c: str(c.tpu.slices), f"string({_TPU}.slices)"),
            " x ",
            Value(lambda c: c.tpu.topology, f"{_TPU}.topology"),
            "); at most ",
            Value(lambda c: str(c.rules.tpu.max_chips_per_job), "string(params.spec.tpu.maxChipsPerJob)"),
            " are allowed per LoRAJob in this namespace",
        ),
    ),
    _under_allowed_prefix("spec.output.baseOutputDirectory", lambda spec: spec.output.base_output_directory),
    _under_allowed_prefix("spec.export.path", lambda spec: spec.export.path,
                          "has(object.spec.export) && has(object.spec.export.path)"),
    _under_allowed_prefix("spec.output.compilationCache", lambda spec: spec.output.compilation_cache,
                          "has(object.spec.output.compilationCache)"),
    _tracker_required("mlflow", Predicate(lambda c: c.rules.defaults.mlflow is not None, "has(params.spec.defaults.mlflow)")),
    _tracker_required("wandb"),
)

_ADMISSION_VARIABLES: tuple[tuple[str, str], ...] = (
    (
        "namespaceLabels",
        "has(namespaceObject.metadata.labels) ? namespaceObject.metadata.labels : {}",
    ),
    ("namespaceSelected", _NAMESPACE_SELECTED_CEL),
    (
        "queue",
        "has(object.spec.scheduling) && has(object.spec.scheduling.queueName) ? object.spec.scheduling.queueName"
        " : has(params.spec.queues.default) ? params.spec.queues.default : ''",
    ),
    # Topologies are 2 or 3 dimensions (the CRD's pattern); CEL has no product over a list.
    ("tpuDims", f"{_HAS_TPU} ? {_TPU}.topology.split('x').map(d, int(d)) : [0, 0]"),
    (
        "tpuChips",
        f"{_HAS_TPU} ? {_TPU}.slices * variables.tpuDims[0] * variables.tpuDims[1]"
        " * (size(variables.tpuDims) == 3 ? variables.tpuDims[2] : 1) : 0",
    ),
)


# --- What the operator calls --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PolicyViolation:
    policy: str
    rule: str
    message: str


def violations(policies: Iterable[LoRAJobPolicy], namespace_labels: Mapping[str, str], spec: api.LoRAJobSpec) -> list[PolicyViolation]:
    """Every rule of every policy governing the namespace that the LoRAJob breaks (empty: allowed)."""
    found = []
    for policy in matching(policies, namespace_labels):
        check = Check(policy, spec)
        for rule in RULES:
            if rule.applies.py(check) and not rule.holds.py(check):
                found.append(PolicyViolation(policy.name, rule.name, rule.message(check)))
    return found


@dataclasses.dataclass(frozen=True)
class ResolvedDefaults:
    """What the operator uses where the LoRAJob is silent; None leaves it to the operator's own settings."""

    queue_name: str | None
    images: api.ImagesSpec
    cpu_node_pool: str | None
    mlflow: api.MLflowTracking | None
    policies: tuple[str, ...]
    """Names of the policies that govern the LoRAJob's namespace."""


def _first(values: Iterable[_T | None]) -> _T | None:
    return next((value for value in values if value is not None), None)


def resolve_defaults(policies: Iterable[LoRAJobPolicy], namespace_labels: Mapping[str, str], spec: api.LoRAJobSpec) -> ResolvedDefaults:
    """The LoRAJob's own value, else the first governing policy (by name) that sets one."""
    governing = matching(policies, namespace_labels)
    images = {
        field: _first([getattr(spec.images, field), *(getattr(p.spec.defaults.images, field) for p in governing)])
        for field in api.ImagesSpec.model_fields
    }
    return ResolvedDefaults(
        queue_name=_first([spec.scheduling.queue_name, *(p.spec.queues.default for p in governing)]),
        images=api.ImagesSpec(**images),
        cpu_node_pool=_first([spec.compute.cpu_node_pool, *(p.spec.defaults.cpu_node_pool for p in governing)]),
        mlflow=_first([spec.tracking.mlflow, *(p.spec.defaults.mlflow for p in governing)]),
        policies=tuple(p.name for p in governing),
    )


def admission_policy_rules() -> dict:
    """The `variables` and `validations` of the chart's ValidatingAdmissionPolicy, from RULES."""
    return {
        "variables": [{"name": name, "expression": expression} for name, expression in _ADMISSION_VARIABLES],
        "validations": [
            {
                "expression": rule.cel_validation(),
                "messageExpression": rule.cel_message(),
                "message": f"the LoRAJob breaks rule {rule.name} of a LoRAJobPolicy",
                "reason": "Forbidden",
            }
            for rule in RULES
        ],
    }
