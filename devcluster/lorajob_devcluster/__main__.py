"""`python -m lorajob_devcluster build | up | run-pods`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from . import build, podrunner, toolchain
from .controlplane import ControlPlaneConfig, KubectlError
from .process import ComponentFailed
from .simcluster import SimCluster, SimClusterError
from .versions import DEFAULT_VERSIONS, bin_dir

STARTUP_ERRORS = (
    build.BuildError,
    toolchain.ToolchainError,
    ComponentFailed,
    SimClusterError,
    KubectlError,
    TimeoutError,
    ValueError,
)


def command_build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        path = build.build(tuple(args.components) or build.COMPONENT_NAMES)
    except STARTUP_ERRORS as error:
        print(f"build failed: {error}", file=sys.stderr)
        return 1
    print(f"binaries in {path} (checked in {time.monotonic() - started:.1f} s)")
    for name, stamp in build.build_report(DEFAULT_VERSIONS).items():
        print(f"  {name:<11} {stamp['version']:<9} cold build {stamp['cold_build_seconds']:>7.1f} s")
    return 0


def command_up(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    plane_config = ControlPlaneConfig(state_dir=args.state_dir, crd_dirs=tuple(args.crds))
    started = time.monotonic()
    try:
        with SimCluster.start(plane_config=plane_config) as cluster:
            print(f"simulated cluster up in {time.monotonic() - started:.1f} s")
            print(f"kubeconfig: {cluster.kubeconfig}")
            print(f"export KUBECONFIG={cluster.kubeconfig}", flush=True)
            print(f"kubectl: {bin_dir() / 'kubectl'}  (Ctrl-C to stop)", flush=True)
            stop.wait()
            print("stopping ...", flush=True)
    except STARTUP_ERRORS as error:
        print(f"up failed: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lorajob_devcluster")
    commands = parser.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser("build", help="build (or find cached) binaries")
    build_parser.add_argument("components", nargs="*", metavar="COMPONENT", help=f"default: all of {', '.join(build.COMPONENT_NAMES)}")
    build_parser.set_defaults(run=command_build)
    up_parser = commands.add_parser("up", help="run the simulated cluster in the foreground")
    up_parser.add_argument("--state-dir", type=Path, default=None, help="kept after exit; default: fresh tmpfs dir")
    up_parser.add_argument("--crds", type=Path, action="append", default=[], help="directory of CRD YAMLs to apply")
    up_parser.set_defaults(run=command_up)
    pods_parser = commands.add_parser("run-pods", help="run the pods of the given nodes as local processes (started by `up`)")
    podrunner.add_arguments(pods_parser)
    pods_parser.set_defaults(run=podrunner.serve)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
