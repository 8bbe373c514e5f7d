"""The pinned version set of every binary the dev cluster runs, and where its build is cached."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class VersionSet:
    kubernetes: str = "v1.35.4"
    etcd: str = "v3.6.16"
    kwok: str = "v0.8.0"
    jobset: str = "v0.11.1"
    kueue: str = "v0.17.0"
    helm: str = "v3.19.5"
    # GODEBUG defaults follow the main module's go line; keep the one Kubernetes itself declares.
    kubernetes_go_line: str = "1.25.0"

    @property
    def staging_version(self) -> str:
        """k8s.io/kubernetes vX.Y.Z publishes its staging modules as v0.Y.Z."""
        major, minor, patch = self.kubernetes.lstrip("v").split(".")
        return f"v0.{minor}.{patch}"

    def key(self) -> str:
        canonical = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]


DEFAULT_VERSIONS = VersionSet()


def cache_root() -> Path:
    return Path(os.environ.get("LORAJOB_K8S_CACHE", Path.home() / ".cache" / "lorajob-k8s"))


def build_dir(versions: VersionSet = DEFAULT_VERSIONS) -> Path:
    return cache_root() / versions.key()


def bin_dir(versions: VersionSet = DEFAULT_VERSIONS) -> Path:
    return build_dir(versions) / "bin"
