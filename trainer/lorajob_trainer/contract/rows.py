"""What one dataset row must hold to be trained on, without JAX or numpy: the trainer's data pipeline and the
fine-tuning API's upload check (lorajob_operator.openai_api.files) read rows with these same functions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class DataError(ValueError):
    """The dataset, its columns or the chat template cannot be used."""


def to_messages(row: dict[str, Any], columns: Sequence[str]) -> list[dict[str, str]]:
    """Turn one dataset row in any supported column layout into a chat message list."""
    if tuple(columns) == ("messages",):
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise DataError("column 'messages' must hold a list of {role, content} dicts")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt_column, answer_column = columns
    return [
        {"role": "user", "content": str(row[prompt_column])},
        {"role": "assistant", "content": str(row[answer_column])},
    ]


def _turns(value: Any, role: str, column: str) -> list[dict[str, str]]:
    """A column's value as messages: a string is one message of `role`; a list must hold {role, content} dicts."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise DataError(f"column {column!r} must hold a string or a list of {{role, content}} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def to_preference_messages(
    row: dict[str, Any], columns: Sequence[str]
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """(prompt messages, chosen answer messages, rejected answer messages) of one preference row, in either layout of
    contract.records.PREFERENCE_COLUMN_LAYOUTS: [prompt, chosen, rejected] (each a string or messages), or [chosen,
    rejected] as whole conversations that share every message but the last."""
    if tuple(columns) == ("prompt", "chosen", "rejected"):
        return (_turns(row["prompt"], "user", "prompt"), _turns(row["chosen"], "assistant", "chosen"),
                _turns(row["rejected"], "assistant", "rejected"))
    chosen, rejected = (_turns(row[column], "assistant", column) for column in ("chosen", "rejected"))
    if len(chosen) < 2 or chosen[:-1] != rejected[:-1]:
        raise DataError("columns 'chosen' and 'rejected' must be conversations that differ only in their last "
                        "message (the answer)")
    return chosen[:-1], chosen[-1:], rejected[-1:]
