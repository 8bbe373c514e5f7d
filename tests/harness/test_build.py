"""The build refuses unserved pins clearly and derives the staging-module list from Kubernetes itself."""

from __future__ import annotations

import pytest

from lorajob_devcluster import build
from lorajob_devcluster.versions import VersionSet


def test_a_pin_the_proxy_does_not_serve_fails_with_module_and_version():
    with pytest.raises(build.BuildError, match=r"sigs\.k8s\.io/kueue@v0\.0\.1-never.*not available"):
        build.download_module("sigs.k8s.io/kueue", "v0.0.1-never", build.go_environment())


def test_staging_modules_come_from_the_kubernetes_go_mod():
    kubernetes_dir = build.component_module_dir("kubernetes")
    modules = build.staging_modules(kubernetes_dir / "go.mod")
    assert {"k8s.io/api", "k8s.io/client-go", "k8s.io/apiserver", "k8s.io/kubectl"} <= set(modules)
    assert "k8s.io/utils" not in modules  # pinned to a pseudo-version, not a staging module


def test_version_stamp_sets_both_version_packages():
    flags = build.version_ldflags(VersionSet(kubernetes="v1.35.4"))
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        assert f"-X {package}.gitVersion=v1.35.4" in flags
        assert f"-X {package}.gitMinor=35" in flags


def test_version_sets_have_distinct_cache_keys():
    assert VersionSet().key() != VersionSet(kueue="v0.17.1").key()
