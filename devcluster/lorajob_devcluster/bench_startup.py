"""Print how long the harness takes to start with warm binaries: apiserver only, then the full cluster.

    python -m lorajob_devcluster.bench_startup [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from . import build
from .controlplane import ControlPlane
from .simcluster import SimCluster


def time_start(full_cluster: bool) -> tuple[float, float]:
    """Seconds to a ready control plane, and (when `full_cluster`) to the upgraded simulated cluster."""
    started = time.monotonic()
    with ControlPlane.start() as plane:
        apiserver_ready = time.monotonic() - started
        if full_cluster:
            SimCluster.upgrade(plane)
        total = time.monotonic() - started
    return apiserver_ready, total


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m lorajob_devcluster.bench_startup")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    build.build()
    apiserver = [time_start(full_cluster=False)[0] for _ in range(args.repeat)]
    full = [time_start(full_cluster=True)[1] for _ in range(args.repeat)]
    for label, samples in (("etcd + kube-apiserver ready", apiserver), ("full simulated cluster ready", full)):
        print(f"{label:<30} median {statistics.median(samples):6.1f} s  (runs: {', '.join(f'{s:.1f}' for s in samples)})")


if __name__ == "__main__":
    main()
