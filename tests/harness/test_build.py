"""The build refuses unserved pins clearly and derives the staging-module list from Kubernetes itself."""

from __future__ import annotations

import sys

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


def test_a_long_build_step_reports_what_it_compiles_and_the_time_so_far():
    lines: list[str] = []
    build.run_reporting_progress([sys.executable, "-c", "import time; print('go noise'); time.sleep(0.5)"],
                                 what="kueue: compiling cmd/kueue", log=lines.append, interval=0.1)
    assert len(lines) >= 3, lines
    assert all(line.startswith("  kueue: compiling cmd/kueue: 0m00s so far") for line in lines), lines
    assert not any("go noise" in line for line in lines)


def test_a_failed_build_step_shows_the_tail_of_its_output():
    code = "import sys; print('\\n'.join(f'line {i}' for i in range(5000))); print('undefined: Foo'); sys.exit(2)"
    with pytest.raises(build.BuildError, match=r"(?s)kwok: compiling.*exit 2.*undefined: Foo") as raised:
        build.run_reporting_progress([sys.executable, "-c", code], what="kwok: compiling", log=print, interval=5)
    assert "line 0\n" not in str(raised.value)
