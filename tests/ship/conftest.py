"""Fixtures for the shipping tests: the Helm binary (built by the dev-cluster harness) and one
release of the chart installed into the session's real API server."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorajob_devcluster import build
from shipkit import CHART, RELEASE, RELEASE_NAMESPACE, Helm


@pytest.fixture(scope="session")
def helm_binary() -> Path:
    return build.build(("helm",)) / "helm"


@pytest.fixture(scope="session")
def helm(helm_binary) -> Helm:
    return Helm(helm_binary)


@pytest.fixture(scope="session")
def installed_release(helm_binary, kube):
    """The chart installed with its defaults (admission policy and RBAC on, Kueue objects off)."""
    release = Helm(helm_binary, kube.kubeconfig)
    release.run("install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace")
    yield release
    release.run("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", check=False)
