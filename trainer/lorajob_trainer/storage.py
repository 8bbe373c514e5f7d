"""Where the convert/export entry points read and write: local paths, gs:// URIs, Hugging Face repos.

The code that reads and writes weights (safetensors memory maps, Orbax managers) works on local
directories, so a gs:// input is copied to local scratch first, and a gs:// output is written to
local scratch and uploaded only once it is complete: a failed run leaves nothing at the URI.
gs:// goes through etils.epath (its fsspec backend needs gcsfs installed).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from etils import epath

from lorajob_trainer.contract.environment import HF_TOKEN_ENV

REMOTE_PREFIX = "gs://"
# Same rule as the LoRAJob API's hubRepo / huggingFace fields.
HF_REPO_ID = re.compile(r"^[A-Za-z0-9][-._A-Za-z0-9]*/[-._A-Za-z0-9]+$")
MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "chat_template*",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
TOKEN_ENV = HF_TOKEN_ENV


class StorageError(ValueError):
    """A location cannot be read or written; the message says which and why."""


def is_remote(location: str | os.PathLike) -> bool:
    return str(location).startswith(REMOTE_PREFIX)


def exists(location: str | os.PathLike) -> bool:
    return epath.Path(location).exists()


def write_text(location: str | os.PathLike, text: str) -> None:
    """Write one small file, a local path or a gs:// URI, its directory made when missing."""
    target = epath.Path(location)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def read_text(location: str | os.PathLike) -> str | None:
    """One small file's text, a local path or a gs:// URI; None when it does not exist."""
    source = epath.Path(location)
    return source.read_text() if source.exists() else None


def join(location: str | os.PathLike, *parts: str) -> str | Path:
    """`location`/parts, kept a URI string for gs:// and a Path otherwise."""
    if is_remote(location):
        return "/".join([str(location).rstrip("/"), *parts])
    return Path(location).joinpath(*parts)


def hf_token() -> str:
    token = os.environ.get(TOKEN_ENV)
    if not token:
        raise StorageError(f"pushing to the Hugging Face Hub needs a token in the {TOKEN_ENV} environment variable")
    return token


def download_hf_repo(repo_id: str, patterns: Sequence[str]) -> Path:
    """Snapshot of the files of Hub repo `repo_id` matching `patterns` (kept in the HF cache)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(repo_id, allow_patterns=list(patterns), token=os.environ.get(TOKEN_ENV) or None)
    except OSError as error:  # the hub's HTTP, not-found and offline errors are all OSErrors
        raise StorageError(
            f"no local path {repo_id!r}, and downloading it from the Hugging Face Hub failed: {error}"
        ) from error
    return Path(snapshot)


def upload_to_hub(folder: Path, repo_id: str) -> None:
    """Push every file under `folder` to the Hub model repo `repo_id` (created private if missing)."""
    from huggingface_hub import HfApi

    api = HfApi(token=hf_token())
    api.create_repo(repo_id, repo_type="model", private=True, exist_ok=True)
    api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model")


def _copy_tree(source: epath.Path, target: Path, patterns: Sequence[str] | None) -> None:
    """Copy `source` to `target`; with `patterns`, only the top-level files whose names match."""
    if not source.is_dir():
        with source.open("rb") as reader, target.open("wb") as writer:
            shutil.copyfileobj(reader, writer)
        return
    target.mkdir(parents=True, exist_ok=True)
    for child in source.iterdir():
        if patterns is None or (not child.is_dir() and any(fnmatch.fnmatch(child.name, p) for p in patterns)):
            _copy_tree(child, target / child.name, None)


def _upload_tree(source: Path, target: epath.Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for child in source.iterdir():
        if child.is_dir():
            _upload_tree(child, target / child.name)
        else:
            with child.open("rb") as reader, (target / child.name).open("wb") as writer:
                shutil.copyfileobj(reader, writer)


@contextlib.contextmanager
def local_input(
    location: str | os.PathLike, *, patterns: Sequence[str] | None = None, hub: bool = False
) -> Iterator[Path]:
    """A local directory holding `location`: a scratch copy of a gs:// URI, with `hub` a Hub snapshot of a
    repo id that is no existing path, else `location` itself (whose reader reports it if missing).
    `patterns` limits what is copied or downloaded to matching file names."""
    if is_remote(location):
        source = epath.Path(location)
        if not source.exists():
            raise StorageError(f"{location} does not exist")
        with tempfile.TemporaryDirectory(prefix="lorajob-in-") as scratch:
            local = Path(scratch) / source.name
            _copy_tree(source, local, patterns)
            yield local
    elif not hub or Path(location).exists():
        yield Path(location)
    elif HF_REPO_ID.match(str(location)):
        yield download_hf_repo(str(location), patterns or ("*",))
    else:
        raise StorageError(f"{location} does not exist: expected a local path, a gs:// URI or a Hugging Face repo id")


@contextlib.contextmanager
def local_output(location: str | os.PathLike) -> Iterator[Path]:
    """A local directory to write `location` into: itself, or scratch uploaded to the gs:// URI on success."""
    if not is_remote(location):
        yield Path(location)
        return
    with tempfile.TemporaryDirectory(prefix="lorajob-out-") as scratch:
        yield Path(scratch)
        _upload_tree(Path(scratch), epath.Path(location))
