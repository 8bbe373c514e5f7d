"""Harness fixtures: one real control plane per test session, upgraded to the simulated cluster on demand.

* `kube`        etcd + kube-apiserver with every CRD in crds/ Established (tests marked `apiserver`).
* `sim_cluster` the same apiserver plus KCM, kube-scheduler, kwok TPU nodes, JobSet and Kueue
                (tests marked `cluster`).

Binaries are built on first use (cached in ~/.cache/lorajob-k8s), never skipped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The dev extra installs libtpu (the deviceless TPU compiler); JAX must not probe for TPU chips on this machine.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache, outside the repo, shared by the workers and the trainers they start: a warm
# run loads its CPU compiles instead of compiling again (a trainer test file: 47 s cold, 19 s warm).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path.home() / ".cache" / "lorajob-jax-tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
try:
    import lorajob_devcluster  # noqa: F401  (installed with `pip install -e .`)
except ImportError:
    sys.path.insert(0, str(REPO_ROOT / "devcluster"))

from lorajob_devcluster import ControlPlane, ControlPlaneConfig, SimCluster, build  # noqa: E402

CRD_DIR = REPO_ROOT / "crds"


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite store, artifacts it serves) on loopback, one per test worker; a test that
    stops it starts it again."""
    from lorajob_devcluster.mlflow_server import MlflowServer

    with MlflowServer(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


@pytest.fixture(scope="session")
def _control_plane():
    config = ControlPlaneConfig(crd_dirs=(CRD_DIR,), keep_state=bool(os.environ.get("LORAJOB_DEVCLUSTER_KEEP")))
    plane = ControlPlane.start(config)
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def kube(_control_plane) -> ControlPlane:
    return _control_plane


@pytest.fixture(scope="session")
def sim_cluster(_control_plane) -> SimCluster:
    return SimCluster.upgrade(_control_plane)


def pytest_collection_modifyitems(config, items):
    """Tests marked `apiserver` / `cluster` get the matching fixture without asking for it; the binaries
    they need are built here, before any test's timeout starts (a cold build takes tens of minutes)."""
    for item in items:
        if item.get_closest_marker("cluster") and "sim_cluster" not in item.fixturenames:
            item.fixturenames.append("sim_cluster")
        elif item.get_closest_marker("apiserver") and "kube" not in item.fixturenames:
            item.fixturenames.append("kube")
    _slow_modules_first(items)
    if config.option.collectonly:
        return
    if any("sim_cluster" in item.fixturenames for item in items):
        _build_before_tests(config, build.COMPONENT_NAMES)
    elif any("kube" in item.fixturenames for item in items):
        _build_before_tests(config, ("kubernetes", "etcd"))


def _slow_modules_first(items) -> None:
    """Under `--dist loadfile` a module runs whole on one worker, and xdist hands the modules out in collection
    order (`--no-loadscope-reorder`). Modules holding a test marked `slow` go first, the longest first by the
    markers' `minutes` (a module's whole time; a slow test alone counts 1), so that the short ones fill in beside
    them instead of one long module running alone at the end of the suite."""
    minutes: dict[Path, float] = {}
    for item in items:
        for marker in item.iter_markers("slow"):
            minutes[item.path] = max(minutes.get(item.path, 0), marker.kwargs.get("minutes", 1))
    items.sort(key=lambda item: -minutes.get(item.path, 0))


def _build_before_tests(config, components: tuple[str, ...]) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    build.build(components, log=lambda line: reporter.write_line(f"lorajob-devcluster: {line}"))
