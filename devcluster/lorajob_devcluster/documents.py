"""Reading Kubernetes YAML fast (libyaml when present: Kueue's Workload CRD alone is 1.4 MB)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_LOADER) if doc]


def load_document(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_LOADER)


def as_kubectl_input(documents: list[dict]) -> str:
    """One JSON v1 List: kubectl reads it much faster than multi-document YAML."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": documents})
