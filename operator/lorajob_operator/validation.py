"""Validation of LoRAJob objects: offline against the generated CRD schema, CEL rules included (`validate`), and
the spec the operator and the CLI run from (`parse_spec`: parsed, with the CRD's rules checked again).

It evaluates exactly what the API server evaluates (the OpenAPI schema and `x-kubernetes-validations`
rendered by `crd.openapi_schema()`), so `lorajob validate` and `kubectl apply` agree without a cluster.
Transition rules (those reading `oldSelf`) only run on updates and are skipped here.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

import celpy
import pydantic

from lorajob_operator import api, crd, names, rules, step_commands


@dataclass(frozen=True)
class FieldError:
    field: str
    """Dotted path as the API server prints it (e.g. spec.lora.rank); empty for the object root."""
    kind: str
    """Required value, Unsupported value, Invalid value, Too long, Too many, Too few, unknown field."""
    detail: str

    def __str__(self) -> str:
        return f"{self.field or '<root>'}: {self.kind}: {self.detail}" if self.detail else f"{self.field}: {self.kind}"


@cache
def _schema() -> dict:
    return crd.openapi_schema()


@cache
def _compiled(expression: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(expression))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _value_repr(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)


def apply_defaults(obj: Any, schema: dict) -> Any:
    """Structural defaulting as the API server does it: drop null properties that are not nullable, then
    fill absent properties that have a default."""
    if not isinstance(obj, dict) or schema.get("type") != "object":
        if isinstance(obj, list) and "items" in schema:
            return [apply_defaults(item, schema["items"]) for item in obj]
        return obj
    properties = schema.get("properties", {})
    result = {name: value for name, value in obj.items() if value is not None or properties.get(name, {}).get("nullable")}
    for name, sub in properties.items():
        if name not in result and "default" in sub:
            result[name] = copy.deepcopy(sub["default"])
        if name in result:
            result[name] = apply_defaults(result[name], sub)
    return result


_JSON_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}
_TYPE_NAMES = (*_JSON_TYPES, "integer", "number")
_BLOCKED = "some validation rules were not checked because the object was invalid; correct the existing errors to complete validation"


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":  # the server decodes an integer past int64 as a float
        return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _JSON_TYPES[kind])


def _go_anchors(pattern: str) -> str:
    """The server's regexps are Go's, where `$` matches only at the very end; Python's `$` also matches
    before a final newline (so "a\n" would pass `^a$`). Our patterns use `$` only as that anchor."""
    return re.sub(r"(?<!\\)\$", r"\\Z", pattern)


def _bound_for(value: int | float, bound: int | float) -> int | float:
    """The bound the server compares `value` with: an integer value meets a fractional bound cut to an integer (Go's
    int64(), toward zero), so `0` is not below a maximum of 0.5 there. The CRD keeps fractional bounds out of its
    schema for this reason (CEL rules state them); this keeps the offline verdict the server's for any that remain."""
    return int(bound) if isinstance(value, int) and isinstance(bound, float) else bound


def _check_schema(value: Any, schema: dict, path: str, errors: list[FieldError]) -> None:
    """OpenAPI checks; nothing below a value of the wrong type is checked."""
    kind = schema.get("type")
    if kind and not _type_ok(value, kind):
        errors.append(FieldError(path, "Invalid value", f'"{type(value).__name__}": {path} in body must be of type {kind}'))
        return
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(json.dumps(v) for v in schema["enum"])
        errors.append(FieldError(path, "Unsupported value", f"{_value_repr(value)}: supported values: {supported}"))
    if kind in ("integer", "number"):
        if "minimum" in schema:
            exclusive, bound = schema.get("exclusiveMinimum", False), _bound_for(value, schema["minimum"])
            if value < bound or (exclusive and value == bound):
                relation = "greater than" if exclusive else "greater than or equal to"
                errors.append(FieldError(path, "Invalid value", f"{value}: {path} in body should be {relation} {bound}"))
        if "maximum" in schema:
            exclusive, bound = schema.get("exclusiveMaximum", False), _bound_for(value, schema["maximum"])
            if value > bound or (exclusive and value == bound):
                relation = "less than" if exclusive else "less than or equal to"
                errors.append(FieldError(path, "Invalid value", f"{value}: {path} in body should be {relation} {bound}"))
    if kind == "string":
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            errors.append(FieldError(path, "Too long", f"may not be more than {schema['maxLength']} bytes"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            errors.append(FieldError(path, "Invalid value", f"{json.dumps(value)}: {path} in body should be at least {schema['minLength']} chars long"))
        if "pattern" in schema and not re.search(_go_anchors(schema["pattern"]), value):
            errors.append(FieldError(path, "Invalid value", f"{json.dumps(value)}: {path} in body should match '{schema['pattern']}'"))
    if kind == "array":
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(FieldError(path, "Too many", f"{len(value)}: must have at most {schema['maxItems']} items"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(FieldError(path, "Invalid value", f"{len(value)}: {path} in body should have at least {schema['minItems']} items"))
        for index, item in enumerate(value):
            _check_schema(item, schema.get("items", {}), f"{path}[{index}]", errors)
    if kind == "object" and "maxProperties" in schema and len(value) > schema["maxProperties"]:
        errors.append(FieldError(path, "Too many", f"{len(value)}: must have at most {schema['maxProperties']} items"))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):  # a map: its values' schema
        for name, item in value.items():
            _check_schema(item, schema["additionalProperties"], _join(path, name), errors)
    if kind == "object" and "properties" in schema:
        for name in schema.get("required", []):
            if name not in value:
                errors.append(FieldError(_join(path, name), "Required value", ""))
        for name, item in value.items():
            if name in schema["properties"]:
                _check_schema(item, schema["properties"][name], _join(path, name), errors)
            elif path and path != "metadata":  # metadata is ObjectMeta; elsewhere strict decoding rejects unknown fields
                errors.append(FieldError(_join(path, name), "unknown field", "field not declared in schema"))


def as_cel_sees(value: Any, schema: dict) -> Any:
    """`value` with the integers of `number` fields as floats: the API server hands CEL a number field as a double
    whatever its JSON spelling (`labelSmoothing: 0` is 0.0), where celpy would keep an int that compares with no
    double."""
    kind = schema.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == "object" and isinstance(value, dict):
        properties = schema.get("properties", {})
        return {name: as_cel_sees(item, properties[name]) if name in properties else item for name, item in value.items()}
    if kind == "array" and isinstance(value, list) and "items" in schema:
        return [as_cel_sees(item, schema["items"]) for item in value]
    return value


def _check_rules(value: Any, schema: dict, path: str, errors: list[FieldError]) -> None:
    """Evaluate CEL rules bottom-up, as the API server does, on values that passed the schema checks."""
    kind = schema.get("type")
    if kind == "object" and isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                _check_rules(value[name], sub, _join(path, name), errors)
    for rule in schema.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        activation = {"self": celpy.json_to_cel(value)}
        field = path + rule.get("fieldPath", "") if path else rule.get("fieldPath", "").lstrip(".")
        try:
            if _compiled(rule["rule"]).evaluate(activation):
                continue
        except celpy.CELEvalError as error:  # e.g. a field the rule reads is missing: the server reports it so
            errors.append(FieldError(field, "Invalid value", f'"object": {error.args[0]} evaluating rule: {rule["rule"]}'))
            continue
        message = rule.get("message", f"failed rule: {rule['rule']}")
        if "messageExpression" in rule:
            message = str(_compiled(rule["messageExpression"]).evaluate(activation))
        errors.append(FieldError(field, "Invalid value", f'"object": {message}'))


_RULES_LOCK = threading.Lock()


def spec_rule_errors(spec: dict) -> tuple[str, ...]:
    """What the CRD's CEL rules under `spec` say of a spec that already parsed (its types are right): the
    operator checks them again, so that an object that bypassed or predates the CRD's rules never runs."""
    key = json.dumps(spec, sort_keys=True)
    with _RULES_LOCK:  # one evaluation per spec: the operator's workers would otherwise all compile the rules at once
        return _spec_rule_errors(key)


@lru_cache(maxsize=4096)
def _spec_rule_errors(spec_json: str) -> tuple[str, ...]:
    # Cached by content: celpy interprets each of the ~30 rules in about 0.5 ms, and a reconcile parses its spec on every pass.
    schema = _schema()["properties"]["spec"]
    errors: list[FieldError] = []
    _check_rules(as_cel_sees(apply_defaults(json.loads(spec_json), schema), schema), schema, "spec", errors)
    return tuple(str(error) for error in errors)


def validate(obj: dict) -> list[FieldError]:
    """All errors the API server would report when creating `obj` (empty list: accepted)."""
    errors: list[FieldError] = []
    if obj.get("apiVersion") != f"{api.GROUP}/{api.VERSION}" or obj.get("kind") != api.KIND:
        return [FieldError("", "Invalid value", f"not a {api.KIND} of {api.GROUP}/{api.VERSION}")]
    schema = _schema()
    name = (obj.get("metadata") or {}).get("name")
    if isinstance(name, str) and not re.fullmatch(names.OBJECT_NAME_PATTERN, name):
        errors.append(FieldError("metadata.name", "Invalid value", f'"{name}": a lowercase RFC 1123 subdomain must consist of '
                                 "lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"))
    defaulted = apply_defaults(obj, schema)
    _check_schema(defaulted, schema, "", errors)
    if any(error.detail.endswith(tuple(f"must be of type {t}" for t in _TYPE_NAMES)) for error in errors):
        # Like the API server: a value of the wrong type blocks the CEL rules.
        errors.append(FieldError("", "Internal error", _BLOCKED))
        return errors
    _check_rules(as_cel_sees(defaulted, schema), schema, "", errors)
    return errors


def parse_spec(body: dict) -> tuple[api.LoRAJobSpec | None, tuple[str, ...]]:
    """The spec of a LoRAJob object, or why it cannot be used (the CRD's rules, checked again)."""
    try:
        spec = api.LoRAJobSpec.model_validate(body.get("spec") or {})
    except pydantic.ValidationError as error:
        return None, tuple(
            f"spec.{'.'.join(str(p) for p in item['loc'])}: {item['msg']}" for item in error.errors()
        )
    run = names.run_name(spec, body["metadata"]["name"])
    errors = [*spec_rule_errors(body["spec"]), *rules.run_name_errors(run, spec)]
    errors += step_commands.train_config_errors(spec, run)
    return (None, tuple(errors)) if errors else (spec, ())
