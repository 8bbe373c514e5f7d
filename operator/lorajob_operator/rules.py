"""Rules shared by the CRD (as CEL), the offline `lorajob validate`, and the operator (as Python): the steps a
LoRAJob runs, the run-name rule, immutability.

Each rule is written once here: the Python function the operator calls and the CEL expression the
API server evaluates are produced side by side from the same constants (the names and their length limits are
names.py's), and a test checks that they agree on every example.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from lorajob_operator.names import (
    CHILD_SUFFIX, DNS_LABEL_PATTERN, LABEL_VALUE_MAX, PATHWAYS_HEAD, PATHWAYS_NAME_MAX, WORKLOAD_NAME_MAX,
)

# --- Steps -----------------------------------------------------------------------------------------

PHASE_WHILE_RUNNING = {"check": "Checking", "convert": "Converting", "train": "Training", "export": "Exporting"}
"""The steps of a LoRAJob in the order they run, each with the status.phase a LoRAJob shows while it runs."""
PHASES = tuple(PHASE_WHILE_RUNNING)
CPU_FIRST_STEPS = ("check", "convert")
"""One of them runs first in every chain, on a CPU: the data and fit checks (then, for convert, the conversion)."""


# --- Conditions on the spec, in Python and CEL ---------------------------------------------------

@dataclass(frozen=True)
class SpecCondition:
    """A predicate on the LoRAJob spec, expressed once for Python and once for CEL (root `self`)."""

    cel: str
    holds: Callable[[Any], bool]  # takes an api.LoRAJobSpec


def _needs_convert(spec) -> bool:
    restore = spec.lora.restore_from
    return spec.model.hugging_face is not None or (restore is not None and restore.hugging_face is not None)


NEEDS_CONVERT = SpecCondition(
    "(has(self.spec.model.huggingFace) || (has(self.spec.lora) && has(self.spec.lora.restoreFrom)"
    " && has(self.spec.lora.restoreFrom.huggingFace)))",
    _needs_convert,
)
NEEDS_CHECK = SpecCondition(f"!{NEEDS_CONVERT.cel}", lambda spec: not NEEDS_CONVERT.holds(spec))
"""A chain without a convert step checks in a CPU step of its own."""
NEEDS_EXPORT = SpecCondition(
    "(!has(self.spec.export) || !has(self.spec.export.enabled) || self.spec.export.enabled)",
    lambda spec: spec.export.enabled,
)
USES_PATHWAYS = SpecCondition(
    "(!has(self.spec.compute.backend) || self.spec.compute.backend == 'pathways')",
    lambda spec: spec.compute.backend.value == "pathways",
)


def phases(spec) -> list[str]:
    """The steps this LoRAJob runs, in order."""
    return [
        phase
        for phase, needed in (
            ("check", NEEDS_CHECK.holds(spec)),
            ("convert", NEEDS_CONVERT.holds(spec)),
            ("train", True),
            ("export", NEEDS_EXPORT.holds(spec)),
        )
        if needed
    ]


# --- The run-name length rule ---------------------------------------------------------------------

@dataclass(frozen=True)
class NameLimit:
    limit: int
    why: str
    applies: SpecCondition | None


NAME_LIMITS: tuple[NameLimit, ...] = tuple(
    sorted(
        (
            NameLimit(
                WORKLOAD_NAME_MAX - len(CHILD_SUFFIX["convert"]),
                f"the convert step's JobSet is named <run name>{CHILD_SUFFIX['convert']} and JobSet names "
                f"must fit the {WORKLOAD_NAME_MAX}-character workload-name limit",
                NEEDS_CONVERT,
            ),
            NameLimit(
                PATHWAYS_NAME_MAX,
                f"with the pathways backend the JobSet coordinator label "
                f"<run name>-{PATHWAYS_HEAD}-0-0.<run name> must fit in {LABEL_VALUE_MAX} characters",
                USES_PATHWAYS,
            ),
            NameLimit(
                WORKLOAD_NAME_MAX - len(CHILD_SUFFIX["export"]),
                f"the export step's JobSet is named <run name>{CHILD_SUFFIX['export']} and JobSet names "
                f"must fit the {WORKLOAD_NAME_MAX}-character workload-name limit",
                NEEDS_EXPORT,
            ),
            NameLimit(
                WORKLOAD_NAME_MAX - len(CHILD_SUFFIX["check"]),
                f"the check step's JobSet is named <run name>{CHILD_SUFFIX['check']} and JobSet names "
                f"must fit the {WORKLOAD_NAME_MAX}-character workload-name limit",
                NEEDS_CHECK,
            ),
            NameLimit(
                WORKLOAD_NAME_MAX,
                "GKE and Kueue build workload names from it with prefixes and hashes that must fit "
                "63 characters",
                None,
            ),
        ),
        key=lambda rule: rule.limit,
    )
)


def run_name_limit(spec) -> NameLimit:
    """The tightest name-length limit that applies to this spec."""
    return next(rule for rule in NAME_LIMITS if rule.applies is None or rule.applies.holds(spec))


_RUN_NAME_CEL = "(has(self.spec.runName) ? self.spec.runName : self.metadata.name)"


def _limit_explanation(rule: NameLimit) -> str:
    return f"at most {rule.limit} characters are allowed here because {rule.why}"


def _limit_cel(value_of: Callable[[NameLimit], str]) -> str:
    """CEL choosing `value_of(rule)` for the first (tightest) applicable NameLimit."""
    expression = ""
    for rule in reversed(NAME_LIMITS):
        value = value_of(rule)
        expression = value if rule.applies is None else f"({rule.applies.cel} ? {value} : {expression})"
    return expression


_NOT_A_DNS_LABEL = (
    "the run name (spec.runName, or metadata.name when unset) must be a DNS label: "
    "lower-case letters, digits and '-', starting with a letter and ending with a letter or digit"
)


def _too_long_message(run_name: str, explanation: str) -> str:
    return f'the run name "{run_name}" is too long: {explanation}. Set a shorter spec.runName.'


def root_rules() -> list[dict]:
    """CEL rules on the LoRAJob object root (where metadata.name is visible)."""
    # Each branch of the message is a literal: CEL's cost estimator treats string(int) as unbounded.
    too_long = _too_long_message("' + " + _RUN_NAME_CEL + " + '", "' + " + _limit_cel(lambda r: '"' + _limit_explanation(r) + '"') + " + '")
    return [
        {"rule": f"{_RUN_NAME_CEL}.matches('{DNS_LABEL_PATTERN}')", "message": _NOT_A_DNS_LABEL},
        {
            "rule": f"size({_RUN_NAME_CEL}) <= {_limit_cel(lambda r: str(r.limit))}",
            "message": "the run name (spec.runName, or metadata.name when unset) is too long for the "
            "workload-name limits; shorten it or set a shorter spec.runName",
            "messageExpression": "'" + too_long + "'",
        },
    ]


def run_name_errors(run_name: str, spec) -> list[str]:
    """The same run-name rules in Python, for the CLI and the operator."""
    errors = []
    if not re.fullmatch(DNS_LABEL_PATTERN, run_name):  # not re.match: its `$` also matches before a final newline
        errors.append(_NOT_A_DNS_LABEL)
    rule = run_name_limit(spec)
    if len(run_name) > rule.limit:
        errors.append(_too_long_message(run_name, _limit_explanation(rule)))
    return errors


# --- Immutability ---------------------------------------------------------------------------------

MUTABLE_FIELDS = ("suspend", "scheduling.ttlSecondsAfterFinished", "scheduling.activeDeadlineSeconds")
"""What may change on a created LoRAJob: pausing, and lifetime policy that does not change what runs."""

_IMMUTABLE_SPEC_FIELDS = (
    "runName", "model", "credentials", "dataset", "method", "preference", "training", "lora", "compute", "output",
    "export", "tracking", "images",
)
_IMMUTABLE_SCHEDULING_FIELDS = ("queueName", "priorityClass", "retryLimit")


def _unchanged(path: str) -> str:
    *parents, leaf = path.split(".")
    new = ".".join(["self", *parents])
    old = ".".join(["oldSelf", *parents])
    return f"has({new}.{leaf}) == has({old}.{leaf}) && (!has({new}.{leaf}) || {new}.{leaf} == {old}.{leaf})"


def immutability_rules() -> list[dict]:
    """Transition rules on spec: everything but MUTABLE_FIELDS is fixed after creation."""
    mutable = ", ".join(f"spec.{field}" for field in MUTABLE_FIELDS)
    rules = []
    for path in (*_IMMUTABLE_SPEC_FIELDS, *(f"scheduling.{f}" for f in _IMMUTABLE_SCHEDULING_FIELDS)):
        guard = "!has(self.scheduling) || !has(oldSelf.scheduling) || " if path.startswith("scheduling.") else ""
        rules.append(
            {
                "rule": guard + "(" + _unchanged(path) + ")",
                "message": f"spec.{path} is immutable: a running fine-tune cannot change under itself. "
                f"Only {mutable} can be changed; create a new LoRAJob for other changes.",
                "fieldPath": "." + path,
            }
        )
    return rules
