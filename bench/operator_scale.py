"""The operator's API cost and burst speed at N LoRAJobs, on the simulated cluster.

    python bench/operator_scale.py [--jobs 100 500 1000] [--idle-seconds 60]

For each N, on a fresh simulated cluster:
- burst: N LoRAJobs created at once; the time until each one's first JobSet exists (p50, p99, last),
  against one client creating N JobSets directly in another namespace of the same cluster;
- idle: the same N LoRAJobs suspended, then kube-apiserver's `apiserver_request_total` sampled over
  `--idle-seconds`, minus the same window with the operator stopped: requests per LoRAJob per minute;
- the operator's peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_latency import NAMESPACE, REPO_ROOT, FirstJobSetWatch, _lorajob  # noqa: E402

DIRECT_NAMESPACE = "bench-direct"
CLIENT_THREADS = 16


def _request_total(cluster) -> float:
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("apiserver_request_total{"))


def _requests_per_minute(cluster, seconds: float) -> float:
    before = _request_total(cluster)
    time.sleep(seconds)
    return (_request_total(cluster) - before) * 60 / seconds


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def _burst(custom, watch: FirstJobSetWatch, jobs: int) -> tuple[list[float], float]:
    names = [f"bench-{index:04d}" for index in range(jobs)]
    created: dict[str, float] = {}

    def create(name: str) -> None:
        custom.create_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", _lorajob(name))
        created[name] = time.monotonic()

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(create, names))
    seen = {name: watch.wait_for(f"{name}-convert", timeout=600) for name in names}
    return [seen[name] - created[name] for name in names], max(seen.values()) - start


def _direct_jobsets(cluster, custom, template: dict, jobs: int) -> float:
    """Seconds one client needs to create `jobs` JobSets shaped like the operator's first one (`template`)."""
    cluster.create_namespace_with_queue(DIRECT_NAMESPACE)

    def create(index: int) -> None:
        body = {"apiVersion": template["apiVersion"], "kind": "JobSet", "spec": template["spec"],
                "metadata": {"name": f"direct-{index:04d}", "namespace": DIRECT_NAMESPACE,
                             "labels": {key: value for key, value in template["metadata"].get("labels", {}).items()
                                        if key.startswith("kueue")}}}
        custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", DIRECT_NAMESPACE, "jobsets", body)

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(create, range(jobs)))
    return time.monotonic() - start


def _suspend_all(custom, jobs: int) -> None:
    def suspend(index: int) -> None:
        custom.patch_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", f"bench-{index:04d}",
                                              {"spec": {"suspend": True}})

    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(suspend, range(jobs)))


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def run(jobs: int, idle_seconds: float) -> dict:
    from kubernetes import client

    from lorajob_devcluster import ControlPlaneConfig, SimCluster
    from lorajob_operator.local import OperatorProcess

    with SimCluster.start(plane_config=ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))) as cluster:
        cluster.create_namespace_with_queue(NAMESPACE)
        cluster.kubectl("-n", NAMESPACE, "create", "secret", "generic", "hf-token", "--from-literal=HF_TOKEN=hf_bench")
        api_client = cluster.api_client()
        custom = client.CustomObjectsApi(api_client)
        log = Path(tempfile.mkdtemp(prefix="lorajob-scale-")) / "operator.log"
        operator = OperatorProcess(cluster.kubeconfig, [NAMESPACE], log).start()
        try:
            watch = FirstJobSetWatch(api_client)
            watch.start()
            time.sleep(1.0)  # let the watch connect before the first create
            latencies, burst_seconds = _burst(custom, watch, jobs)
            watch.stop()
            template = custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets",
                                                           "bench-0000-convert")
            _suspend_all(custom, jobs)
            time.sleep(15)  # let the suspends settle (JobSets deleted, status written)
            with_operator = _requests_per_minute(cluster, idle_seconds)
            rss = _peak_rss_mib(operator._process.pid)
        finally:
            operator.stop()
        without_operator = _requests_per_minute(cluster, idle_seconds)
        direct_seconds = _direct_jobsets(cluster, custom, template, jobs)
    return {
        "jobs": jobs, "p50": statistics.median(latencies), "p99": _percentile(latencies, 0.99),
        "burst": burst_seconds, "direct": direct_seconds,
        "idle_per_job_min": (with_operator - without_operator) / jobs, "rss": rss, "log": log,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args()
    rows = [run(jobs, args.idle_seconds) for jobs in args.jobs]
    print(f"{'N':>6} {'p50 s':>7} {'p99 s':>7} {'all JobSets s':>14} {'direct s':>9} {'idle req/job/min':>17} {'peak RSS MiB':>13}")
    for row in rows:
        print(f"{row['jobs']:>6} {row['p50']:>7.2f} {row['p99']:>7.2f} {row['burst']:>14.1f} {row['direct']:>9.1f}"
              f" {row['idle_per_job_min']:>17.2f} {row['rss']:>13.0f}")
    for row in rows:
        print(f"operator log (N={row['jobs']}): {row['log']}")


if __name__ == "__main__":
    main()
