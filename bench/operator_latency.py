"""Time from creating a LoRAJob to its first JobSet existing, on the simulated cluster.

    python bench/operator_latency.py [--jobs 20]

Starts the simulated cluster and the operator (as `python -m lorajob_operator`), then creates the
LoRAJobs one at a time: each is created only after the previous one's first JobSet was seen, so the
figure is the operator's reaction time, not a queue. A JobSet watch records when each first JobSet
appears. Prints the median, min, p90 and max, and the same for one client creating JobSets of the same
shape directly, one at a time, in the same run: the API server's share (webhooks included), which the
operator cannot go below.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "examples" / "qwen3-gsm8k.yaml"
NAMESPACE = "bench"


class FirstJobSetWatch:
    """Records the monotonic time each JobSet name is first seen (ADDED) in the namespace."""

    def __init__(self, api_client):
        from kubernetes import client, watch

        self._api = client.CustomObjectsApi(api_client)
        self._watch = watch.Watch()
        self.seen: dict[str, float] = {}
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        stream = self._watch.stream(
            self._api.list_namespaced_custom_object, "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets",
            timeout_seconds=3600,
        )
        try:
            for event in stream:
                name = event["object"]["metadata"]["name"]
                with self._changed:
                    self.seen.setdefault(name, time.monotonic())
                    self._changed.notify_all()
        except Exception:
            if not self._stopped:
                raise

    def wait_for(self, name: str, timeout: float) -> float:
        with self._changed:
            if not self._changed.wait_for(lambda: name in self.seen, timeout):
                raise TimeoutError(f"JobSet {name} did not appear within {timeout} s")
            return self.seen[name]

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


def direct_jobset(template: dict, namespace: str, name: str) -> dict:
    """A JobSet shaped like the operator's `template`, as one client would create it (Kueue's labels only)."""
    labels = {key: value for key, value in template["metadata"].get("labels", {}).items() if key.startswith("kueue")}
    return {"apiVersion": template["apiVersion"], "kind": "JobSet", "spec": template["spec"],
            "metadata": {"name": name, "namespace": namespace, "labels": labels}}


def _lorajob(name: str) -> dict:
    body = copy.deepcopy(yaml.safe_load(SAMPLE.read_text()))
    body["metadata"] = {"name": name, "namespace": NAMESPACE}
    return body


def measure(cluster, jobs: int) -> list[float]:
    from kubernetes import client

    api_client = cluster.api_client()
    custom = client.CustomObjectsApi(api_client)
    watch = FirstJobSetWatch(api_client)
    watch.start()
    time.sleep(1.0)  # let the watch connect before the first create
    latencies = []
    for index in range(jobs):
        name = f"bench-{index:02d}"
        created = time.monotonic()
        custom.create_namespaced_custom_object("lorajob.dev", "v1alpha1", NAMESPACE, "lorajobs", _lorajob(name))
        latencies.append(watch.wait_for(f"{name}-convert", timeout=60) - created)
    watch.stop()
    return latencies


def measure_direct(cluster, jobs: int) -> list[float]:
    """Seconds each of `jobs` JobSets shaped like the first LoRAJob's takes to create, one at a time: the floor
    of the figure above (the operator's own share is the difference)."""
    from kubernetes import client

    custom = client.CustomObjectsApi(cluster.api_client())
    template = custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", "bench-00-convert")
    latencies = []
    for index in range(jobs):
        started = time.monotonic()
        custom.create_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", NAMESPACE, "jobsets", direct_jobset(template, NAMESPACE, f"direct-{index:02d}"))
        latencies.append(time.monotonic() - started)
    return latencies


def _summary(latencies: list[float]) -> str:
    ms = sorted(1000 * value for value in latencies)
    p90 = ms[min(len(ms) - 1, int(round(0.9 * (len(ms) - 1))))]
    return f"median {statistics.median(ms):.0f} ms   min {ms[0]:.0f} ms   p90 {p90:.0f} ms   max {ms[-1]:.0f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--verbose", action="store_true", help="debug-level operator log (printed path)")
    args = parser.parse_args()

    from lorajob_devcluster import ControlPlaneConfig, SimCluster
    from lorajob_operator.local import OperatorProcess

    with SimCluster.start(plane_config=ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))) as cluster:
        cluster.create_namespace_with_queue(NAMESPACE)
        cluster.kubectl("-n", NAMESPACE, "create", "secret", "generic", "hf-token", "--from-literal=HF_TOKEN=hf_bench")
        log = Path(tempfile.mkdtemp(prefix="lorajob-bench-")) / "operator.log"
        with OperatorProcess(cluster.kubeconfig, [NAMESPACE], log, verbose=args.verbose):
            latencies = measure(cluster, args.jobs)
        direct = measure_direct(cluster, args.jobs)
        print(f"operator log: {log}")
    print(f"create LoRAJob -> first JobSet exists, {len(latencies)} jobs (operator defaults, resync 10 s):")
    print(f"  {_summary(latencies)}")
    print("one client creating the same JobSet directly, one at a time (same run; the floor of the figure above):")
    print(f"  {_summary(direct)}")


if __name__ == "__main__":
    main()
