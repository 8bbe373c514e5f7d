"""Render the LoRAJob CustomResourceDefinition from the pydantic models in `api.py`.

`python -m lorajob_operator.crd` rewrites crds/; a test fails when the checked-in file is stale.
"""

from __future__ import annotations

import copy
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from lorajob_operator import api, rules

CRD_FILE = f"{api.GROUP}_{api.PLURAL}.yaml"
_DROP_KEYS = {"title"}


def _openapi(schema: dict, defs: dict) -> dict:
    """Turn one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    if "$ref" in schema:
        target = copy.deepcopy(defs[schema["$ref"].split("/")[-1]])
        target.update({k: v for k, v in schema.items() if k != "$ref"})
        return _openapi(target, defs)
    if "anyOf" in schema:  # Optional[X]: optionality is expressed by `required`, not by null
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        assert len(options) == 1, f"unions other than Optional are not structural: {schema}"
        merged = {**options[0], **{k: v for k, v in schema.items() if k not in ("anyOf", "default")}}
        if schema.get("default") is not None:
            merged["default"] = schema["default"]
        return _openapi(merged, defs)

    node: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP_KEYS or key == "$defs":
            continue
        if key == "additionalProperties":  # `false` from extra="forbid" is implied; a schema types a map's values
            if isinstance(value, dict):
                node[key] = _openapi(value, defs)
            continue
        if key == "properties":
            node["properties"] = {name: _openapi(sub, defs) for name, sub in value.items()}
        elif key == "items":
            node["items"] = _openapi(value, defs)
        elif key == "const":
            node["enum"] = [value]
        elif key == "exclusiveMinimum":
            node["minimum"], node["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            node["maximum"], node["exclusiveMaximum"] = value, True
        else:
            node[key] = value
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    return node


def schema_of(model: type[BaseModel]) -> dict:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _openapi(raw, raw.get("$defs", {}))


def add_object_defaults(schema: dict, model: type[BaseModel]) -> None:
    """Fields whose default is a sub-model (or an empty list or map) get `default: {}` (`[]`) so the API
    server fills in their defaults."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        sub = schema["properties"][alias]
        annotation = field.annotation
        if field.default_factory in (list, dict):
            sub["default"] = field.default_factory()
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if field.default_factory is not None:
                sub["default"] = {}
            add_object_defaults(sub, annotation)
        elif typing.get_origin(annotation) is list:
            (item,) = typing.get_args(annotation)
            if isinstance(item, type) and issubclass(item, BaseModel):
                add_object_defaults(sub["items"], item)


def _status_schema() -> dict:
    status = schema_of(api.LoRAJobStatus)
    conditions = status["properties"]["conditions"]
    conditions["x-kubernetes-list-type"] = "map"
    conditions["x-kubernetes-list-map-keys"] = ["type"]
    conditions["items"]["required"] = ["type", "status"]
    return status


def openapi_schema() -> dict:
    spec = schema_of(api.LoRAJobSpec)
    add_object_defaults(spec, api.LoRAJobSpec)
    return {
        "type": "object",
        "description": "LoRAJob fine-tunes a large language model with LoRA: it converts the base checkpoint "
        "when needed, trains on TPU (Pathways or multi-controller JAX) or GPU through Kueue, and exports "
        "the adapter to Hugging Face PEFT format.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Bounding metadata.name (the only restriction a CRD may put on metadata) keeps the root CEL
            # rules, which default the run name to it, within the API server's cost budget.
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": api.DNS_LABEL_MAX}},
            },
            "spec": spec,
            "status": _status_schema(),
        },
        "x-kubernetes-validations": rules.root_rules(),
    }


def crd() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.KIND.lower(),
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": api.PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `python -m lorajob_operator.crd` from operator/lorajob_operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    out_dir = Path(argv[0] if argv else "crds")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / CRD_FILE).write_text(render())
    print(f"wrote {out_dir / CRD_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
