"""Reading Kubernetes objects: their status conditions and RFC 3339 timestamps."""

from __future__ import annotations

from datetime import datetime, UTC


def parse_time(value: str | None) -> datetime | None:
    """A Kubernetes timestamp (RFC 3339, `Z`), or None."""
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def find_condition(obj: dict, condition_type: str) -> dict | None:
    return next((c for c in obj.get("status", {}).get("conditions") or [] if c.get("type") == condition_type), None)


def is_true(obj: dict, condition_type: str) -> bool:
    condition = find_condition(obj, condition_type)
    return condition is not None and condition.get("status") == "True"
