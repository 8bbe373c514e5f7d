"""The lorajob demo: a simulated TPU cluster, the operator, and the tutorial's LoRAJob run to Succeeded.

    python scripts/demo.py [--timeout SECONDS]

Starts etcd, kube-apiserver, KCM, kube-scheduler, kwok (fake v6e and CPU nodes), JobSet and Kueue on
loopback (lorajob_devcluster; binaries are built on first use), runs `python -m lorajob_operator`,
applies examples/qwen3-gsm8k.yaml and prints `kubectl get lj -w` until the LoRAJob finishes, then
its steps' JobSets and events, and tears everything down.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "examples" / "qwen3-gsm8k.yaml"
NAMESPACE = "demo"
FINAL_PHASES = ("Succeeded", "Failed")


def _watch_until_final(kubectl: list[str], name: str, timeout: float) -> str:
    """Stream `kubectl get lj -w` (the user's view) until the LoRAJob reaches a final phase."""
    watch = subprocess.Popen([*kubectl, "get", "lj", name, "-w"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout
    final = ""
    try:
        for line in watch.stdout:
            print(line, end="", flush=True)
            final = next((phase for phase in FINAL_PHASES if f" {phase} " in f" {line} "), "")
            if final or time.monotonic() > deadline:
                break
    finally:
        watch.terminate()
        watch.wait()
    return final


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the LoRAJob to finish")
    args = parser.parse_args()

    from lorajob_devcluster import ControlPlaneConfig, SimCluster
    from lorajob_operator.local import OperatorProcess

    started = time.monotonic()
    with SimCluster.start(plane_config=ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))) as cluster:
        cluster_ready = time.monotonic() - started
        print(f"simulated cluster ready in {cluster_ready:.1f} s (kubeconfig {cluster.kubeconfig})", flush=True)
        cluster.create_namespace_with_queue(NAMESPACE)
        cluster.kubectl("-n", NAMESPACE, "create", "secret", "generic", "hf-token", "--from-literal=HF_TOKEN=hf_demo")
        kubectl = [cluster.plane.binary("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", NAMESPACE]
        log = Path(tempfile.mkdtemp(prefix="lorajob-demo-")) / "operator.log"
        with OperatorProcess(cluster.kubeconfig, [NAMESPACE], log, {"LORAJOB_RECONCILE_RESYNC_SECONDS": "2"}):
            applied = time.monotonic()
            subprocess.run([*kubectl, "apply", "-f", str(SAMPLE)], check=True)
            final = _watch_until_final(kubectl, "qwen3-gsm8k", args.timeout)
            chain = time.monotonic() - applied
            subprocess.run([*kubectl, "get", "jobsets.jobset.x-k8s.io,workloads.kueue.x-k8s.io"], check=False)
            subprocess.run([*kubectl, "get", "events", "--field-selector", "involvedObject.kind=LoRAJob",
                            "--sort-by=.lastTimestamp"], check=False)
        print(f"operator log: {log}")
    total = time.monotonic() - started
    print(f"\nLoRAJob {final or 'did not finish'}: apply -> {final or 'timeout'} {chain:.1f} s; "
          f"cluster start {cluster_ready:.1f} s; demo wall time {total:.1f} s (incl. teardown)")
    return 0 if final == "Succeeded" else 1


if __name__ == "__main__":
    sys.exit(main())
