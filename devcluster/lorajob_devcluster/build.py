"""Build the dev-cluster binaries from the Go module proxy, once per version set.

Nothing ships kube-apiserver & co. as a package, so everything is compiled with the
Go toolchain from `toolchain.py` and cached outside the repository under
``~/.cache/lorajob-k8s/<version-set key>/bin``. A component is rebuilt only when its
stamp file is missing or names a different version.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable

from . import toolchain
from .versions import DEFAULT_VERSIONS, VersionSet, bin_dir, build_dir

GO_LDFLAGS_STRIP = "-s -w"
PROGRESS_INTERVAL_SECONDS = 20.0
"""How often a running Go command reports that it is still at work (a Kubernetes build is silent for minutes)."""


class BuildError(RuntimeError):
    """A component could not be built; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Component:
    name: str
    binaries: tuple[str, ...]
    module: str
    version: Callable[[VersionSet], str]
    build: Callable[[BuildContext, Component], None]
    main_package: str = ""  # for components built in a wrapper module


@dataclasses.dataclass(frozen=True)
class BuildContext:
    versions: VersionSet
    bin: Path
    src: Path
    env: dict[str, str]
    log: Callable[[str], None]

    def go(self, *args: str, what: str, cwd: Path | None = None) -> None:
        run_reporting_progress(["go", *args], what=what, log=self.log, cwd=cwd, env=self.env)


def run_reporting_progress(command: list[str], *, what: str, log: Callable[[str], None], cwd: Path | None = None,
                           env: dict[str, str] | None = None, interval: float = PROGRESS_INTERVAL_SECONDS) -> None:
    """Run `command` quietly, logging `what` and the time so far every `interval` s; its output's tail on failure."""
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
        while True:
            try:
                process.wait(timeout=interval)
                break
            except subprocess.TimeoutExpired:
                log(f"  {what}: {_minutes(time.monotonic() - started)} so far")
        if process.returncode != 0:
            output.seek(0)
            raise BuildError(f"{what}: `{' '.join(command)}` failed (exit {process.returncode}):\n{output.read()[-4000:]}")


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def go_environment() -> dict[str, str]:
    """Environment for every `go` call: the chosen toolchain first on PATH, static trimmed binaries."""
    go_bin_dir = os.path.dirname(toolchain.go_binary())
    env = dict(os.environ)
    env.update(
        PATH=f"{go_bin_dir}{os.pathsep}{env.get('PATH', '')}",
        CGO_ENABLED="0",
        GOFLAGS="-trimpath -buildvcs=false",
        GOTOOLCHAIN="local",
    )
    return env


def download_module(module: str, version: str, env: dict[str, str]) -> Path:
    """`go mod download` one pinned module; refuse with a clear message when the proxy does not serve it."""
    result = subprocess.run(
        ["go", "mod", "download", "-json", f"{module}@{version}"], env=env, capture_output=True, text=True
    )
    try:
        info = json.loads(result.stdout)
    except json.JSONDecodeError:
        info = {"Error": result.stderr.strip() or "no output from go mod download"}
    if result.returncode != 0 or "Error" in info:
        raise BuildError(f"pinned module {module}@{version} is not available from the Go proxy: {info.get('Error')}")
    return Path(info["Dir"])


def staging_modules(kubernetes_go_mod: Path) -> list[str]:
    """The k8s.io staging modules that k8s.io/kubernetes requires at the unpublished v0.0.0."""
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+) v0\.0\.0\s*$", kubernetes_go_mod.read_text(), re.M)))


def version_ldflags(versions: VersionSet) -> str:
    """Stamp the version the way hack/lib/version.sh does; Kueue refuses an unstamped apiserver."""
    major, minor, _ = versions.kubernetes.lstrip("v").split(".")
    values = {"gitVersion": versions.kubernetes, "gitMajor": major, "gitMinor": minor, "gitTreeState": "clean"}
    packages = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    return " ".join(f"-X {package}.{name}={value}" for package in packages for name, value in values.items())


KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")


def build_kubernetes(ctx: BuildContext, component: Component) -> None:
    versions = ctx.versions
    kubernetes_dir = download_module(component.module, component.version(versions), ctx.env)
    go_mod = kubernetes_dir / "go.mod"
    replaces = "\n".join(f"\t{m} => {m} {versions.staging_version}" for m in staging_modules(go_mod))
    tools = "\n".join(f"\tk8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS)
    wrapper = ctx.src / "kubernetes"
    write_wrapper_module(
        wrapper,
        f"module local/lorajob-kubernetes\n\ngo {versions.kubernetes_go_line}\n\n"
        f"godebug default=go{versions.kubernetes_go_line.rsplit('.', 1)[0]}\n\n"
        f"tool (\n{tools}\n)\n\nrequire k8s.io/kubernetes {versions.kubernetes}\n\nreplace (\n{replaces}\n)\n",
    )
    ctx.go("mod", "tidy", what="kubernetes: resolving modules", cwd=wrapper)
    ldflags = f"{GO_LDFLAGS_STRIP} {version_ldflags(versions)}"
    packages = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS]
    ctx.go("build", "-ldflags", ldflags, "-o", f"{ctx.bin}/", *packages, cwd=wrapper,
           what=f"kubernetes: compiling {', '.join(KUBE_COMMANDS)}")


def write_wrapper_module(directory: Path, go_mod: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "go.mod").write_text(go_mod)
    (directory / "go.sum").unlink(missing_ok=True)


def build_in_wrapper_module(ctx: BuildContext, component: Component) -> None:
    """Build the component's main package inside a one-line wrapper module.

    Not `go install pkg@version`: that also fetches the module's version list (for deprecation notices),
    which the proxy refuses for some modules (403 for sigs.k8s.io/jobset), and it rejects modules whose
    go.mod has replace lines (etcd). Each wrapper is separate, so no component changes another's deps.
    """
    version = component.version(ctx.versions)
    download_module(component.module, version, ctx.env)
    (binary,) = component.binaries
    wrapper = ctx.src / binary
    # `go mod tidy` raises the go line to what the module needs.
    write_wrapper_module(
        wrapper, f"module local/lorajob-{binary}\n\ngo 1.24.0\n\ntool {component.main_package}\n\nrequire {component.module} {version}\n"
    )
    ctx.go("mod", "tidy", what=f"{component.name}: resolving modules", cwd=wrapper)
    ctx.go("build", "-ldflags", GO_LDFLAGS_STRIP, "-o", str(ctx.bin / binary), component.main_package, cwd=wrapper,
           what=f"{component.name}: compiling {component.main_package}")


COMPONENTS: tuple[Component, ...] = (
    Component("kubernetes", KUBE_COMMANDS, "k8s.io/kubernetes", lambda v: v.kubernetes, build_kubernetes),
    Component("etcd", ("etcd",), "go.etcd.io/etcd/server/v3", lambda v: v.etcd, build_in_wrapper_module, "go.etcd.io/etcd/server/v3"),
    Component("kwok", ("kwok",), "sigs.k8s.io/kwok", lambda v: v.kwok, build_in_wrapper_module, "sigs.k8s.io/kwok/cmd/kwok"),
    Component("jobset", ("jobset",), "sigs.k8s.io/jobset", lambda v: v.jobset, build_in_wrapper_module, "sigs.k8s.io/jobset"),
    Component("kueue", ("kueue",), "sigs.k8s.io/kueue", lambda v: v.kueue, build_in_wrapper_module, "sigs.k8s.io/kueue/cmd/kueue"),
    Component("helm", ("helm",), "helm.sh/helm/v3", lambda v: v.helm, build_in_wrapper_module, "helm.sh/helm/v3/cmd/helm"),
)
COMPONENT_NAMES = tuple(c.name for c in COMPONENTS)


def component_module_dir(name: str, versions: VersionSet = DEFAULT_VERSIONS) -> Path:
    """Where a component's Go module download is (its CRD, webhook and Stage YAMLs are read from there)."""
    component = next(c for c in COMPONENTS if c.name == name)
    return download_module(component.module, component.version(versions), go_environment())


def stamp_path(bin_path: Path, component: Component) -> Path:
    return bin_path / f".{component.name}.built.json"


def is_built(bin_path: Path, component: Component, versions: VersionSet) -> bool:
    stamp = stamp_path(bin_path, component)
    if not stamp.exists() or not all((bin_path / b).exists() for b in component.binaries):
        return False
    return json.loads(stamp.read_text()).get("version") == component.version(versions)


def build(
    components: tuple[str, ...] = COMPONENT_NAMES,
    versions: VersionSet = DEFAULT_VERSIONS,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> Path:
    """Build the named components unless cached; return the bin directory. Safe to call concurrently."""
    unknown = set(components) - set(COMPONENT_NAMES)
    if unknown:
        raise BuildError(f"unknown components {sorted(unknown)}; known: {list(COMPONENT_NAMES)}")
    root, bin_path = build_dir(versions), bin_dir(versions)
    wanted = [c for c in COMPONENTS if c.name in components]
    if all(is_built(bin_path, c, versions) for c in wanted):
        return bin_path
    bin_path.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ctx = BuildContext(versions, bin_path, root / "src", go_environment(), log)
        build_started = time.monotonic()
        for component in wanted:
            if is_built(bin_path, component, versions):
                continue
            log(f"building {component.name} {component.version(versions)} ...")
            started = time.monotonic()
            component.build(ctx, component)
            seconds = round(time.monotonic() - started, 1)
            stamp = {"version": component.version(versions), "cold_build_seconds": seconds}
            stamp_path(bin_path, component).write_text(json.dumps(stamp))
            log(f"built {component.name} in {seconds} s")
        log(f"control plane built in {_minutes(time.monotonic() - build_started)}; binaries cached in {bin_path}")
    return bin_path


def build_report(versions: VersionSet = DEFAULT_VERSIONS) -> dict[str, dict]:
    """Version and recorded cold build time of each built component."""
    bin_path = bin_dir(versions)
    return {
        c.name: json.loads(stamp_path(bin_path, c).read_text())
        for c in COMPONENTS
        if stamp_path(bin_path, c).exists()
    }
