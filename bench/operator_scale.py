"""The operator's API cost, burst speed, full-chain throughput and memory at N LoRAJobs, on the simulated cluster.

    python bench/operator_scale.py [--jobs 100 500 1000] [--idle-seconds 60]

For each N, on a fresh simulated cluster whose pods complete at once (kwok, no delays) and with room for
many single-host trainings at a time (BENCH_POOLS):
- cold first: one warm-up LoRAJob's create -> first JobSet (the cluster's first JobSet create and the operator's
  first pass: one-off costs the direct creates below never pay); it is deleted before the burst;
- burst: N LoRAJobs created at once (16 client threads; "LoRAJobs created": until the last create returned); the time
  until each one's first JobSet exists (p50, p99, last),
  against one client creating N JobSets directly in another namespace of the same cluster (ratio: last
  first JobSet / direct), and the operator's requests per LoRAJob until the last first JobSet exists
  (watches included; by verb in the JSON line);
- idle, suspended: the N LoRAJobs suspended, then the requests the operator sends over `--idle-seconds`
  (its own client counters, /metrics), and kube-apiserver's `apiserver_request_total` over the same
  window minus one with the operator stopped (the method of the figures before the watch caches);
- full chain: the N LoRAJobs resumed, the time until all are Succeeded, the operator's requests per LoRAJob,
  and the step hand-off (a step's JobSet Completed -> the next step's JobSet created: the operator's share);
- idle, finished: the operator's requests over `--idle-seconds` with all N Succeeded (and, for both idle
  windows, the share of one CPU core the operator used: its resync re-decides every LoRAJob);
- memory: the operator's peak RSS (VmHWM) and its RSS growth per LoRAJob (VmRSS at the end minus before the burst).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from operator_latency import NAMESPACE, REPO_ROOT, FirstJobSetWatch, _lorajob, direct_jobset

DIRECT_NAMESPACE = "bench-direct"
CLIENT_THREADS = 16
CHAIN_TIMEOUT_SECONDS = 3600


def _bench_pools():
    from lorajob_devcluster import topology

    return (
        dataclasses.replace(topology.CPU_NP, node_count=16),  # 128 convert/export pods at a time
        dataclasses.replace(topology.TPU_V6E_2X2, node_count=32),  # 32 single-host trainings at a time
    )


def _chain_lorajob(name: str) -> dict:
    """The tutorial sample on one single-host v6e 2x2 (mcjax): convert, train and export one pod each."""
    body = _lorajob(name)
    body["spec"]["compute"] = {"backend": "mcjax", "tpu": {"machineType": "ct6e-standard-4t", "topology": "2x2"}}
    return body


def _request_total(cluster) -> float:
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("apiserver_request_total{"))


def _operator_requests(operator) -> float:
    return sum(operator.requests_by_verb().values())


def _cpu_seconds(operator) -> float:
    fields = Path(f"/proc/{operator._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _idle(cluster, operator, seconds: float) -> tuple[float, float | None, float | None]:
    """Over `seconds`: kube-apiserver's requests per minute, the operator's own (None: no operator) and the
    share of one CPU core the operator used."""
    server = _request_total(cluster)
    ours, cpu = (_operator_requests(operator), _cpu_seconds(operator)) if operator else (None, None)
    time.sleep(seconds)
    server_rate = (_request_total(cluster) - server) * 60 / seconds
    if operator is None:
        return server_rate, None, None
    return server_rate, (_operator_requests(operator) - ours) * 60 / seconds, (_cpu_seconds(operator) - cpu) / seconds


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(fraction * (len(ordered) - 1))))]


def _names(jobs: int) -> list[str]:
    return [f"bench-{index:04d}" for index in range(jobs)]


def _burst(custom, watch: FirstJobSetWatch, jobs: int) -> tuple[list[float], float, float]:
    """Each LoRAJob's create -> first JobSet, the seconds until the last first JobSet and until the last create."""
    created: dict[str, float] = {}

    def create(name: str) -> None:
        custom.create_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", _chain_lorajob(name))
        created[name] = time.monotonic()

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(create, _names(jobs)))
    seen = {name: watch.wait_for(f"{name}-convert", timeout=600) for name in created}
    return [seen[name] - created[name] for name in created], max(seen.values()) - start, max(created.values()) - start


def _warm_up(custom, watch: FirstJobSetWatch) -> float:
    """Create -> first JobSet of one LoRAJob, deleted again before the burst: the one-off costs of the cluster's
    first JobSet and of the operator's first pass (celpy compiling the CRD's rules) are paid here, not inside
    the burst, as the direct creates that follow the burst never pay them either."""
    from lorajob_devcluster import wait_for

    name = "warm-up"
    start = time.monotonic()
    custom.create_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", _chain_lorajob(name))
    seconds = watch.wait_for(f"{name}-convert", timeout=120) - start
    custom.delete_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", name, propagation_policy="Foreground")
    wait_for(lambda: not custom.list_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs")["items"],
             120, "the warm-up LoRAJob to be deleted", interval=0.2)
    return seconds


def _direct_jobsets(cluster, custom, template: dict, jobs: int) -> float:
    """Seconds one client needs to create `jobs` JobSets shaped like the operator's first one (`template`)."""
    cluster.create_namespace_with_queue(DIRECT_NAMESPACE)

    def create(index: int) -> None:
        body = direct_jobset(template, DIRECT_NAMESPACE, f"direct-{index:04d}")
        custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", DIRECT_NAMESPACE, "jobsets", body)

    start = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(create, range(jobs)))
    return time.monotonic() - start


def _set_suspend(custom, jobs: int, suspend: bool) -> None:
    def patch(name: str) -> None:
        custom.patch_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", name, {"spec": {"suspend": suspend}})

    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(patch, _names(jobs)))


def _wait_all(custom, phase: str, jobs: int, timeout: float, no_jobsets: bool = False) -> float:
    """Seconds until all `jobs` LoRAJobs are in `phase` (and, with `no_jobsets`, no JobSet is left)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    start, done = time.monotonic(), 0
    while time.monotonic() - start < timeout:
        try:
            items = custom.list_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs")["items"]
            done = sum(1 for item in items if item.get("status", {}).get("phase") == phase)
            if done == jobs and not (no_jobsets and custom.list_namespaced_custom_object(
                    "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", limit=1)["items"]):
                return time.monotonic() - start
        except (HTTPError, ApiException) as error:  # a list of N LoRAJobs cut short (or timed out, 504) by a loaded API server: look again
            if isinstance(error, ApiException) and error.status < 500:
                raise
            print(f"listing LoRAJobs failed ({str(error).splitlines()[0]}); retrying", file=sys.stderr)
        time.sleep(1.0)
    raise TimeoutError(f"only {done} of {jobs} LoRAJobs reached {phase} within {timeout:.0f} s")


def _handoffs(custom) -> list[float]:
    """Seconds from each step's JobSet Completed to the next step's JobSet created (1 s resolution: the API's
    timestamps): the operator's own share of the chain time."""
    from datetime import datetime

    from lorajob_operator import names

    def parse(value: str) -> datetime:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))

    by_run: dict[str, dict[str, dict]] = {}
    for jobset in custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets")["items"]:
        labels = jobset["metadata"]["labels"]
        by_run.setdefault(labels[names.LABEL_RUN], {})[labels[names.LABEL_PHASE]] = jobset
    gaps = []
    for steps in by_run.values():
        for done, following in (("convert", "train"), ("train", "export")):
            if done in steps and following in steps:
                completed = next(c for c in steps[done]["status"]["conditions"] if c["type"] == "Completed")
                created = steps[following]["metadata"]["creationTimestamp"]
                gaps.append((parse(created) - parse(completed["lastTransitionTime"])).total_seconds())
    return gaps


def _memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


CHAIN_KEYS = ("chain", "chain_requests", "handoff_p50", "handoff_max", "ours_finished", "cpu_finished")


def run(jobs: int, idle_seconds: float, chain: bool, settings: dict[str, str]) -> dict:
    from kubernetes import client

    from lorajob_devcluster import ControlPlaneConfig, PodTiming, SimCluster, SimClusterConfig
    from lorajob_devcluster.process import free_loopback_port
    from lorajob_operator.local import OperatorProcess

    config = SimClusterConfig(node_pools=_bench_pools(), pod_timing=PodTiming(
        start_delay_ms=0, complete_delay_ms=0, complete_jitter_ms=0, delete_delay_ms=0))
    with SimCluster.start(config, plane_config=ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))) as cluster:
        cluster.create_namespace_with_queue(NAMESPACE)
        cluster.kubectl("-n", NAMESPACE, "create", "secret", "generic", "hf-token", "--from-literal=HF_TOKEN=hf_bench")
        api_client = cluster.api_client()
        custom = client.CustomObjectsApi(api_client)
        log = Path(tempfile.mkdtemp(prefix="lorajob-scale-")) / "operator.log"
        settings = {"LORAJOB_METRICS_PORT": str(free_loopback_port()), **settings}
        operator = OperatorProcess(cluster.kubeconfig, [NAMESPACE], log, settings).start()
        pid = operator._process.pid
        try:
            rss_before = _memory_kib(pid)["VmRSS"]
            watch = FirstJobSetWatch(api_client)
            watch.start()
            time.sleep(1.0)  # let the watch connect before the first create
            cold_first = _warm_up(custom, watch)
            before_burst = operator.requests_by_verb()
            latencies, burst_seconds, create_seconds = _burst(custom, watch, jobs)
            burst_requests = {verb: (count - before_burst.get(verb, 0)) / jobs
                              for verb, count in operator.requests_by_verb().items()}
            watch.stop()
            print(json.dumps({"jobs": jobs, "p50": statistics.median(latencies), "p99": _percentile(latencies, 0.99),
                              "created": create_seconds, "burst": burst_seconds, "burst_requests_by_verb": burst_requests}),
                  file=sys.stderr, flush=True)  # the burst's figures, should a later phase fail
            template = custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets",
                                                           "bench-0000-convert")
            _set_suspend(custom, jobs, True)
            _wait_all(custom, "Suspended", jobs, 600, no_jobsets=True)
            server_suspended, ours_suspended, cpu_suspended = _idle(cluster, operator, idle_seconds)
            chained = {}
            if chain:
                requests_before_chain = _operator_requests(operator)
                _set_suspend(custom, jobs, False)
                chained["chain"] = _wait_all(custom, "Succeeded", jobs, CHAIN_TIMEOUT_SECONDS)
                chained["chain_requests"] = (_operator_requests(operator) - requests_before_chain) / jobs
                handoffs = _handoffs(custom)
                chained |= {"handoff_p50": statistics.median(handoffs), "handoff_max": max(handoffs)}
                _, ours_finished, chained["cpu_finished"] = _idle(cluster, operator, idle_seconds)
                chained["ours_finished"] = ours_finished / jobs
            memory = _memory_kib(pid)
        finally:
            operator.stop()
        server_without, _, _ = _idle(cluster, None, idle_seconds)
        direct_seconds = _direct_jobsets(cluster, custom, template, jobs)
    return {
        "jobs": jobs, "cold_first": cold_first, "p50": statistics.median(latencies), "p99": _percentile(latencies, 0.99),
        "created": create_seconds, "burst": burst_seconds, "direct": direct_seconds, "ratio": burst_seconds / direct_seconds,
        "burst_requests": sum(burst_requests.values()),
        "burst_requests_by_verb": {verb: round(count, 2) for verb, count in burst_requests.items() if count},
        "server_idle": (server_suspended - server_without) / jobs, "ours_suspended": ours_suspended / jobs,
        "cpu_suspended": cpu_suspended, **dict.fromkeys(CHAIN_KEYS), **chained,
        "peak_rss": memory["VmHWM"] / 1024, "rss_per_job": (memory["VmRSS"] - rss_before) / jobs, "log": str(log),
    }


COLUMNS = (
    ("N", "jobs", "{:>6}"), ("cold first s", "cold_first", "{:>12.2f}"), ("p50 s", "p50", "{:>7.2f}"), ("p99 s", "p99", "{:>7.2f}"),
    ("LoRAJobs created s", "created", "{:>18.1f}"), ("all first JobSets s", "burst", "{:>19.1f}"), ("direct s", "direct", "{:>9.1f}"), ("ratio", "ratio", "{:>5.2f}"),
    ("burst req/job", "burst_requests", "{:>13.1f}"),
    ("idle susp. req/job/min (server diff)", "server_idle", "{:>36.3f}"),
    ("idle susp. (own)", "ours_suspended", "{:>16.4f}"), ("idle done (own)", "ours_finished", "{:>15.4f}"),
    ("idle CPU susp.", "cpu_suspended", "{:>14.1%}"), ("idle CPU done", "cpu_finished", "{:>13.1%}"),
    ("chain s", "chain", "{:>8.1f}"), ("chain req/job", "chain_requests", "{:>13.1f}"),
    ("step hand-off p50 s", "handoff_p50", "{:>19.0f}"), ("max s", "handoff_max", "{:>5.0f}"),
    ("peak RSS MiB", "peak_rss", "{:>12.0f}"), ("RSS KiB/job", "rss_per_job", "{:>11.1f}"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--chain-up-to", type=int, default=None,
                        help="run the full chain only for N up to this (on 2 CPU cores the simulated controllers take minutes per 100)")
    parser.add_argument("--setting", action="append", default=[], metavar="LORAJOB_X=VALUE",
                        help="an operator setting (settings.py), e.g. LORAJOB_RECONCILE_WORKERS=32 (repeatable)")
    args = parser.parse_args()
    settings = dict(setting.split("=", 1) for setting in args.setting)
    rows = []
    for jobs in args.jobs:
        rows.append(run(jobs, args.idle_seconds, args.chain_up_to is None or jobs <= args.chain_up_to, settings))
        print(json.dumps(rows[-1]), flush=True)
    print(" ".join(title for title, _, _ in COLUMNS))
    for row in rows:
        print(" ".join(_cell(title, fmt, row[key]) for title, key, fmt in COLUMNS))


def _cell(title: str, fmt: str, value) -> str:
    return "-".rjust(len(title)) if value is None else fmt.format(value).rjust(len(title))


if __name__ == "__main__":
    main()
