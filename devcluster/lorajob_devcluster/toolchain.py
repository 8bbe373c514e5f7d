"""A Go toolchain for the build: the one on PATH if recent enough, else Go's own toolchain module.

Debian ships Go 1.19, too old for Kubernetes 1.35. The Go module proxy serves every Go release as the
module ``golang.org/toolchain`` (what ``GOTOOLCHAIN`` switching downloads), so a clean CI machine needs
nothing but the proxy.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import urllib.request
import zipfile
from pathlib import Path

from .versions import cache_root

MINIMUM_GO = (1, 25)
BOOTSTRAP_GO = "1.26.8"
DEFAULT_GOPROXY = "https://proxy.golang.org"
_ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class ToolchainError(RuntimeError):
    """No usable Go toolchain could be found or fetched."""


def go_version(go: str) -> tuple[int, int] | None:
    output = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", output)
    return (int(match[1]), int(match[2])) if match else None


def _proxy_url() -> str:
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY", DEFAULT_GOPROXY)):
        if entry.startswith(("https://", "http://")):
            return entry.rstrip("/")
    raise ToolchainError(f"GOPROXY={os.environ.get('GOPROXY')!r} names no proxy to fetch the Go toolchain from")


def _fetch_toolchain(target: Path) -> None:
    arch = _ARCHES.get(platform.machine().lower())
    if arch is None or platform.system() != "Linux":
        raise ToolchainError(f"no Go toolchain on PATH and no bootstrap for {platform.system()}/{platform.machine()}")
    module_version = f"v0.0.1-go{BOOTSTRAP_GO}.linux-{arch}"
    url = f"{_proxy_url()}/golang.org/toolchain/@v/{module_version}.zip"
    archive = target.with_suffix(".zip")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
    except OSError as error:
        raise ToolchainError(f"cannot download the Go toolchain from {url}: {error}") from error
    prefix = f"golang.org/toolchain@{module_version}/"
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    with zipfile.ZipFile(archive) as zipped:
        for member in zipped.infolist():
            if member.is_dir() or not member.filename.startswith(prefix):
                continue
            destination = staging / member.filename[len(prefix) :]
            destination.parent.mkdir(parents=True, exist_ok=True)
            with zipped.open(member) as source, open(destination, "wb") as out:
                shutil.copyfileobj(source, out)
    # Module zips carry no file modes; the Go commands and tools must be executable.
    for executable in [*(staging / "bin").glob("*"), *(staging / "pkg" / "tool").glob("*/*")]:
        executable.chmod(0o755)
    staging.rename(target)
    archive.unlink()


@functools.cache
def go_binary() -> str:
    """Path of a `go` command of at least MINIMUM_GO, fetching Go BOOTSTRAP_GO into the cache if needed."""
    on_path = shutil.which("go")
    if on_path and (go_version(on_path) or (0, 0)) >= MINIMUM_GO:
        return on_path
    target = cache_root() / "toolchain" / f"go{BOOTSTRAP_GO}"
    if not (target / "bin" / "go").exists():
        _fetch_toolchain(target)
    return str(target / "bin" / "go")
