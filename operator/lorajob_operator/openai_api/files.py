"""Uploaded training files: the per-line check of an upload (the trainer's own row rules) and where files live.

An upload is JSONL in one of the fine-tuning API's layouts, the same on every line:
* chat:              {"messages": [{"role", "content"}, ...]} with at least one assistant message;
* prompt_completion: {"prompt": "...", "completion": "..."};
* preference:        {"input": {"messages": [...]}, "preferred_output": [assistant message],
                      "non_preferred_output": [assistant message]}.
Each line is stored already rewritten into the trainer's columns (lorajob_trainer.contract.rows reads it back
exactly as the trainer will), so a job's dataset is a copy of its files.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
import secrets
import string
import time
from typing import IO, Any

import fsspec

from lorajob_trainer.contract.rows import DataError, to_messages, to_preference_messages

ID_ALPHABET = string.ascii_lowercase + string.digits
PURPOSE = "fine-tune"


def new_id(prefix: str, length: int) -> str:
    return prefix + "".join(secrets.choice(ID_ALPHABET) for _ in range(length))


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    keys: frozenset[str]
    """The keys every line holds, no more and no fewer."""
    columns: tuple[str, ...]
    """The trainer's columns the line is rewritten into (LoRAJob spec.dataset.columns)."""
    methods: tuple[str, ...]
    """The API's method types that train on it."""


LAYOUTS = (
    Layout("chat", frozenset({"messages"}), ("messages",), ("supervised",)),
    Layout("prompt_completion", frozenset({"prompt", "completion"}), ("prompt", "completion"), ("supervised",)),
    Layout("preference", frozenset({"input", "preferred_output", "non_preferred_output"}),
           ("prompt", "chosen", "rejected"), ("dpo",)),
)
LAYOUT_BY_NAME = {layout.name: layout for layout in LAYOUTS}


class LineError(ValueError):
    pass


def layout_of(row: Any) -> Layout:
    """The layout whose keys the line holds."""
    if not isinstance(row, dict):
        raise LineError("must be a JSON object")
    for layout in LAYOUTS:
        if set(row) == layout.keys:
            return layout
    expected = "; ".join(str(sorted(layout.keys)) for layout in LAYOUTS)
    raise LineError(f"keys {sorted(row)} match no layout: each line holds exactly one of {expected}")


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise LineError(f"{where} must be a non-empty list of messages")
    for number, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise LineError(f"{where}[{number}] must be an object with a role")
        extra = set(message) - {"role", "content"}
        if extra:
            raise LineError(f"{where}[{number}] holds {sorted(extra)}: only role and content are trained on "
                            "(tool calls, names and weights have no LoRAJob meaning)")
        if not isinstance(message.get("content"), str):
            raise LineError(f"{where}[{number}].content must be a string (text only)")
    return value


def trainer_row(layout: Layout, row: dict[str, Any]) -> dict[str, Any]:
    """The line (of `layout`) in the trainer's columns; LineError says what is wrong with it."""
    if layout.name == "chat":
        converted = {"messages": _messages(row["messages"], "messages")}
        if not any(m["role"] == "assistant" and m["content"] for m in converted["messages"]):
            raise LineError("messages hold no assistant message with content: there is nothing to train on")
    elif layout.name == "prompt_completion":
        if not isinstance(row["prompt"], str) or not isinstance(row["completion"], str) or not row["completion"]:
            raise LineError("prompt must be a string and completion a non-empty string")
        converted = dict(row)
    else:
        if not isinstance(row["input"], dict) or set(row["input"]) != {"messages"}:
            raise LineError("input must be an object holding only messages")
        converted = {"prompt": _messages(row["input"]["messages"], "input.messages"),
                     "chosen": _messages(row["preferred_output"], "preferred_output"),
                     "rejected": _messages(row["non_preferred_output"], "non_preferred_output")}
    try:
        if layout.name == "preference":
            to_preference_messages(converted, layout.columns)
        else:
            to_messages(converted, layout.columns)
    except DataError as error:
        raise LineError(str(error)) from None
    return converted


class UploadRefused(ValueError):
    """The upload is not a usable training file; the message says why (with its first bad lines)."""


class UploadCheck:
    """Checks an upload as it streams in and writes the trainer's rows to `sink`."""

    def __init__(self, sink: IO[bytes], *, max_bytes: int, max_lines: int, errors_listed: int):
        self.sink, self.max_bytes, self.max_lines, self.errors_listed = sink, max_bytes, max_lines, errors_listed
        self.layout: Layout | None = None
        self.bytes = self.lines = 0
        self.errors: list[str] = []
        self.bad_lines = 0
        self._rest = b""

    def feed(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if self.bytes > self.max_bytes:
            raise UploadRefused(f"the file is larger than this API's limit of {self.max_bytes} bytes")
        *complete, self._rest = (self._rest + chunk).split(b"\n")
        for line in complete:
            self._line(line)

    def finish(self) -> None:
        if self._rest.strip():
            self._line(self._rest)
        if self.bad_lines:
            more = f" (and {self.bad_lines - len(self.errors)} more)" if self.bad_lines > len(self.errors) else ""
            raise UploadRefused(f"{self.bad_lines} of {self.lines} lines cannot be trained on{more}: "
                                + "; ".join(self.errors))
        if not self.lines:
            raise UploadRefused("the file holds no lines: give one JSON object per line")

    def _line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        self.lines += 1
        if self.lines > self.max_lines:
            raise UploadRefused(f"the file holds more than this API's limit of {self.max_lines} lines")
        try:
            try:
                row = json.loads(raw)
            except ValueError as error:
                raise LineError(f"not JSON ({error})") from None
            layout = layout_of(row)
            if self.layout is None:
                self.layout = layout
            elif layout is not self.layout:
                raise LineError(f"layout {layout.name}, but the lines before it are {self.layout.name}")
            converted = trainer_row(layout, row)
        except LineError as error:
            self.bad_lines += 1
            if len(self.errors) < self.errors_listed:
                self.errors.append(f"line {self.lines}: {error}")
            return
        self.sink.write(json.dumps(converted, ensure_ascii=False).encode() + b"\n")


@dataclasses.dataclass(frozen=True)
class StoredFile:
    id: str
    filename: str
    bytes: int
    created_at: int
    layout: str
    lines: int

    def to_api(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": PURPOSE, "status": "processed", "status_details": None,
                "expires_at": None, "lines": self.lines, "layout": self.layout}


class FileStore:
    """Files under `<root>/<namespace>/files/`: `<id>.jsonl` (the trainer's rows) and `<id>.json` (what the API
    says of it). `root` is a local directory or any fsspec URL (gs:// with gcsfs installed)."""

    def __init__(self, root: str):
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.scheme = "" if "://" not in root else root.split("://", 1)[0] + "://"

    def _folder(self, namespace: str) -> str:
        return posixpath.join(self.root, namespace, "files")

    def url(self, path: str) -> str:
        """The path as the trainer pods are given it."""
        return self.scheme + path

    def data_path(self, namespace: str, file_id: str) -> str:
        return posixpath.join(self._folder(namespace), f"{file_id}.jsonl")

    def put(self, namespace: str, spooled: str, filename: str, check: UploadCheck) -> StoredFile:
        stored = StoredFile(new_id("file-", 24), filename, check.bytes, int(time.time()), check.layout.name, check.lines)
        folder = self._folder(namespace)
        self.fs.makedirs(folder, exist_ok=True)
        self.fs.put_file(spooled, self.data_path(namespace, stored.id))
        with self.fs.open(posixpath.join(folder, f"{stored.id}.json"), "w") as out:
            json.dump(dataclasses.asdict(stored), out)
        return stored

    def get(self, namespace: str, file_id: str) -> StoredFile | None:
        if re.fullmatch(r"file-[a-z0-9]{1,64}", file_id) is None:  # never a path outside the namespace's folder
            return None
        try:
            with self.fs.open(posixpath.join(self._folder(namespace), f"{file_id}.json")) as stream:
                return StoredFile(**json.load(stream))
        except FileNotFoundError:
            return None

    def _described(self, namespace: str) -> list[str]:
        """The paths of the namespace's files' descriptions (`<id>.json`)."""
        return self.fs.glob(posixpath.join(self._folder(namespace), "file-*.json"))

    def count(self, namespace: str) -> int:
        return len(self._described(namespace))

    def list(self, namespace: str) -> list[StoredFile]:
        """Newest first."""
        files = [self.get(namespace, posixpath.basename(path)[: -len(".json")]) for path in self._described(namespace)]
        return sorted((f for f in files if f), key=lambda f: (f.created_at, f.id), reverse=True)

    def delete(self, namespace: str, file_id: str) -> None:
        folder = self._folder(namespace)
        self.fs.rm([posixpath.join(folder, f"{file_id}.json"), self.data_path(namespace, file_id)])

    def copy_to(self, namespace: str, file_id: str, destination: str) -> None:
        """The file's rows to `destination` (a job's dataset folder reads them from there)."""
        self.fs.makedirs(posixpath.dirname(destination), exist_ok=True)
        self.fs.copy(self.data_path(namespace, file_id), destination)

    def job_folder(self, namespace: str, job_id: str) -> str:
        return posixpath.join(self.root, namespace, "jobs", job_id)

    def remove_job_folder(self, folder: str) -> None:
        """A job's folder whose LoRAJob was never created."""
        if self.fs.exists(folder):
            self.fs.rm(folder, recursive=True)


def paginate(items: list[Any], after: str | None, limit: int, key=lambda item: item["id"]) -> tuple[list[Any], bool]:
    """The page after the item whose id is `after` (from the start when None), and whether more follow."""
    start = 0
    if after is not None:
        start = next((index + 1 for index, item in enumerate(items) if key(item) == after), len(items))
    page = items[start:start + limit]
    return page, start + limit < len(items)

