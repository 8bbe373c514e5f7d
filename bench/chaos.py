"""Control-plane chaos at scale, on a fresh simulated cluster.

    python bench/chaos.py [--jobs 60] [--replicas 2] [--operator-kills 6] [--component-restarts 1] [--gap 1 8] [--seed N]

Creates `--jobs` full-chain LoRAJobs (convert -> train -> export) and, at seeded random moments, SIGKILLs
the operator's leader `--operator-kills` times (with `--replicas 1`: the only operator, then a new process)
and SIGKILLs and restarts
kube-apiserver, JobSet and Kueue `--component-restarts` times each, each fault a random `--gap` seconds
after the previous one is over. Then checks what
tests/e2e/chaos.py checks (every LoRAJob Succeeded; one JobSet per step and attempt, from a watch of
every JobSet ever created; no orphaned child; no completed step run again; consistent status) and
prints each fault with
  down:     the kill until the component serves again (the operator: a standby holds the Lease, or with
            one replica a new process runs),
  resumed:  the kill until the first LoRAJob phase transition after that (progress again).
A failure prints the seed; `--seed` runs the same fault plan again.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

from chaos import RESTARTABLE, run  # noqa: E402
from lorajobs import HF_SECRET  # noqa: E402

NAMESPACE = "chaos"


def _figures(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"median {statistics.median(values):.1f} s  max {max(values):.1f} s  (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--replicas", type=int, default=2, help="operator replicas (one Lease; the leader is killed)")
    parser.add_argument("--operator-kills", type=int, default=6)
    parser.add_argument("--component-restarts", type=int, default=1, help="restarts of each of " + ", ".join(RESTARTABLE))
    parser.add_argument("--gap", type=float, nargs=2, default=(1.0, 8.0), metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for every LoRAJob to finish after the last fault")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    print(f"chaos seed {seed}: {args.jobs} LoRAJobs, {args.replicas} operator replica(s), {args.operator_kills} leader kills, "
          f"{args.component_restarts} restart(s) each of {', '.join(RESTARTABLE)}; operator defaults", flush=True)

    from lorajob_devcluster import ControlPlaneConfig, SimCluster
    from lorajob_operator.local import OperatorProcess, OperatorReplicas

    started = time.monotonic()
    with SimCluster.start(plane_config=ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))) as cluster:
        print(f"simulated cluster up in {time.monotonic() - started:.1f} s", flush=True)
        cluster.create_namespace_with_queue(NAMESPACE)
        cluster.kubectl("-n", NAMESPACE, "create", "secret", "generic", HF_SECRET, "--from-literal=HF_TOKEN=hf_bench")
        logs = Path(tempfile.mkdtemp(prefix="lorajob-chaos-"))
        operators = (OperatorReplicas(cluster.kubeconfig, [NAMESPACE], logs, count=args.replicas) if args.replicas > 1
                     else OperatorProcess(cluster.kubeconfig, [NAMESPACE], logs / "operator.log"))
        with operators as operator:
            outcome = run(cluster, NAMESPACE, operator, seed, args.jobs, args.operator_kills, args.timeout,
                          restarts=RESTARTABLE * args.component_restarts, gap=tuple(args.gap))
    print(f"operator logs: {logs}")
    jobsets = {obj["metadata"]["uid"] for _, obj in outcome.record.versions("jobsets")}
    print(f"all {len(outcome.names)} LoRAJobs Succeeded, nothing broken; {len(outcome.injected)} faults injected; "
          f"{len(jobsets)} JobSets ever created; watch relists {outcome.record.relists}; "
          f"run {outcome.finished_at - outcome.started_at:.1f} s")
    print(f"{'#':>3} {'fault':<15} {'unfinished':>10} {'down':>7} {'resumed':>8}")
    resumed: dict[str, list[float]] = {}
    down: dict[str, list[float]] = {}
    for index, item in enumerate(outcome.injected, 1):
        back = outcome.progress_resumed(item)
        down.setdefault(item.fault.target, []).append(item.ready - item.at)
        if back is not None:
            resumed.setdefault(item.fault.target, []).append(back)
        shown = f"{back:7.1f}s" if back is not None else "     n/a"
        print(f"{index:>3} {item.fault.target:<15} {item.unfinished:>10} {item.ready - item.at:6.1f}s {shown}")
    for target in sorted(down):
        print(f"{target:<15} down {_figures(down[target])};  resumed {_figures(resumed.get(target, []))}")


if __name__ == "__main__":
    main()
