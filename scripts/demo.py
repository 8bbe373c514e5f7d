"""The lorajob demo: a simulated TPU cluster, the operator, and a LoRAJob that really fine-tunes.

    python scripts/demo.py [--out DIR] [--steps N] [--timeout SECONDS]
    python scripts/demo.py --fast          # kwok-only: the tutorial's LoRAJob on fake pods (~10 s)
    python scripts/demo.py --api           # the same fine-tune through the OpenAI fine-tuning API (`lorajob api`)

Starts etcd, kube-apiserver, KCM, kube-scheduler, kwok (fake v6e and CPU nodes), the pod runner,
JobSet and Kueue on loopback (lorajob_devcluster; binaries are built on first use) and runs
`python -m lorajob_operator`. By default it generates a tiny Qwen3 model, tokenizer and dataset
under DIR and applies a LoRAJob over them (DIR/lorajob.yaml): convert, multi-controller training on
2 fake v6e hosts (2 jax.distributed processes) and export run for real, as local processes on the
pod runner's nodes, with exactly the command lines the operator renders. `kubectl get lj -o wide -w`
shows the phase, progress and loss; at the end the demo writes the loss curve and prints where the
PEFT adapter and the curve are, and the evaluation the train step ran after its last step: base model
against adapter on the eval prompts (score, stop rate, samples side by side), which gates the export. The run reports
to a real MLflow tracking server started beside the cluster (DIR/mlflow; spec.tracking.mlflow): the demo prints its
URL and the run's. `--fast` applies examples/qwen3-gsm8k.yaml instead, whose pods kwok plays (nothing is trained).
`--api` starts `lorajob api` beside the operator and runs examples/fine_tuning_api.py, an OpenAI-client script, with
a tenant's token: it uploads the dataset as chat JSONL, creates the job (a LoRAJob) and prints its events until the
fine-tuned model is ready.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE = REPO_ROOT / "examples" / "qwen3-gsm8k.yaml"
NAMESPACE = "demo"
RUN = "tiny-qwen3-demo"
FINAL_PHASES = ("Succeeded", "Failed")
EVALUATED_FORM = r"^(the answer is) \d+\.$"
"""What the demo's evaluation scores: an answer of the trained form, and nothing after it."""
SAMPLES_SHOWN = 3


def _watch_until_final(kubectl: list[str], name: str, timeout: float) -> str:
    """Stream `kubectl get lj -o wide -w` (the user's view) until the LoRAJob reaches a final phase."""
    watch = subprocess.Popen([*kubectl, "get", "lj", name, "-o", "wide", "-w"], stdout=subprocess.PIPE, text=True)
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


def _real_lorajob(out: Path, steps: int, mlflow_url: str) -> tuple[str, Path, object]:
    from lorajob_devcluster import localjob

    assets = localjob.write_assets(out)
    shutil.rmtree(assets.run_directory(RUN), ignore_errors=True)  # a fresh run: convert refuses to overwrite
    manifest = out / "lorajob.yaml"
    body = localjob.lorajob(RUN, assets, steps=steps, checkpoint_period=max(steps // 3, 1))
    # The random base cannot answer "what is a plus b?" with "the answer is <number>."; the adapter learns the form
    # (the sum itself is beyond a 2-layer model trained this briefly): score each answer by that form, and export
    # the adapter only if it beats the base.
    body["spec"]["evaluation"] = {"scorer": "regex", "pattern": EVALUATED_FORM, "maxNewTokens": 16, "examples": 40}
    body["spec"]["export"] = {"requireImprovement": True}
    body["spec"]["tracking"] = {"mlflow": {"trackingUri": mlflow_url, "tags": {"source": "make demo"}}}
    manifest.write_text(yaml.safe_dump(body, sort_keys=False))
    return RUN, manifest, assets


def _report(assets, run: str, out: Path, mlflow) -> None:
    from lorajob_trainer import evaluate, metrics, tracking

    losses = [record["loss"] for record in metrics.read_metrics(assets.metrics(run)) if "loss" in record]
    png = metrics.plot_loss_curve(assets.metrics(run), out / "loss.png")
    print(f"\ntraining loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    record = evaluate.read_record(assets.layout(run).evaluation)
    if record is not None:
        print(f"evaluation ({record.scorer} '{EVALUATED_FORM}' on {record.examples} prompts, {record.seconds:.1f} s): "
              f"base {record.base.score:.0%} -> adapter {record.adapter.score:.0%}; stop rate base "
              f"{record.base.stop_rate:.0%} -> adapter {record.adapter.stop_rate:.0%}")
    print(f"PEFT adapter: {assets.adapter(run)}")
    print(f"loss curve:   {png}")
    print(f"checkpoints:  {assets.layout(run).checkpoints}")
    kept = tracking.read_record(assets.layout(run).tracking).runs.get("mlflow")
    if kept is not None:
        print(f"MLflow run:   {kept.url}\n  (its params, metrics, loss plot, evaluation samples and adapter; after the "
              f"demo: {' '.join(mlflow.command(port=5000))}, then open the run at port 5000)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="kwok-only: fake pods, nothing is trained")
    parser.add_argument("--api", action="store_true", help="fine-tune through the OpenAI fine-tuning API instead")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "out" / "demo", help="model, data and outputs")
    parser.add_argument("--steps", type=int, default=30, help="training steps")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the LoRAJob to finish")
    args = parser.parse_args()

    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        mlflow = None if args.fast or args.api else stack.enter_context(_mlflow_server(args.out.absolute() / "mlflow"))
        final, chain, cluster_ready = _run(args, started, mlflow)
    total = time.monotonic() - started
    print(f"\nLoRAJob {final or 'did not finish'}: apply -> {final or 'timeout'} {chain:.1f} s; "
          f"cluster start {cluster_ready:.1f} s; demo wall time {total:.1f} s (incl. teardown)")
    return 0 if final == "Succeeded" else 1


def _mlflow_server(directory: Path):
    """The MLflow tracking server the demo's LoRAJob reports to (spec.tracking.mlflow), beside the cluster."""
    from lorajob_devcluster.mlflow_server import MlflowServer

    server = MlflowServer(directory)
    print(f"MLflow tracking server: {server.url} (store {directory})", flush=True)
    return server


def _run(args, started: float, mlflow) -> tuple[str, float, float]:
    """The cluster, the operator and the LoRAJob: its final phase, apply -> final and cluster start in seconds."""
    from lorajob_devcluster import ControlPlaneConfig, SimCluster
    from lorajob_operator.local import OperatorProcess

    if args.fast:
        name, manifest, assets = "qwen3-gsm8k", SAMPLE, None
    elif args.api:
        name, manifest, assets = None, None, _api_files(args.out.absolute())
    else:
        name, manifest, assets = _real_lorajob(args.out.absolute(), args.steps, mlflow.url)
        print(f"tiny model, tokenizer and dataset in {args.out} ({time.monotonic() - started:.1f} s)", flush=True)
    plane_config = ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))
    if not args.fast:  # kept after the demo: the pods' logs and directories are under podrunner/
        shutil.rmtree(args.out / "cluster", ignore_errors=True)
        plane_config = dataclasses.replace(plane_config, state_dir=args.out.absolute() / "cluster")
    with SimCluster.start(plane_config=plane_config) as cluster:
        cluster_ready = time.monotonic() - started
        print(f"simulated cluster ready in {cluster_ready:.1f} s (kubeconfig {cluster.kubeconfig})", flush=True)
        cluster.create_namespace_with_queue(NAMESPACE)
        cluster.kubectl("-n", NAMESPACE, "create", "secret", "generic", "hf-token", "--from-literal=HF_TOKEN=hf_demo")
        kubectl = [cluster.plane.binary("kubectl"), f"--kubeconfig={cluster.kubeconfig}", "-n", NAMESPACE]
        log = Path(tempfile.mkdtemp(prefix="lorajob-demo-")) / "operator.log"
        with OperatorProcess(cluster.kubeconfig, [NAMESPACE], log, {"LORAJOB_RECONCILE_RESYNC_SECONDS": "2"}):
            if args.api:
                applied = time.monotonic()
                final = _through_the_api(cluster, assets, args.out.absolute(), args.timeout)
                return final, time.monotonic() - applied, cluster_ready
            applied = time.monotonic()
            subprocess.run([*kubectl, "apply", "-f", str(manifest)], check=True)
            final = _watch_until_final(kubectl, name, args.timeout)
            chain = time.monotonic() - applied
            subprocess.run([*kubectl, "get", "jobsets.jobset.x-k8s.io,workloads.kueue.x-k8s.io"], check=False)
            # The run as `lorajob status` tells it: steps, loss, checkpoints, outputs and events.
            subprocess.run([str(Path(sys.executable).parent / "lorajob"), "status", name, "-n", NAMESPACE,
                            "--samples", str(SAMPLES_SHOWN)],
                           env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}, check=False)
        print(f"operator log: {log}")
        if assets is not None:
            print(f"pod logs and directories: {cluster.state_dir / 'podrunner' / 'pods' / NAMESPACE}")
    if final == "Succeeded" and assets is not None:
        _report(assets, name, args.out.absolute(), mlflow)
    return final, chain, cluster_ready


def _api_files(out: Path):
    """The tiny model and the demo's question/answer rows as chat JSONL (the fine-tuning API's layout)."""
    import json

    from lorajob_devcluster import localjob

    assets = localjob.write_assets(out)
    for split, name in (("train", "train.jsonl"), ("test", "valid.jsonl")):
        rows = [json.loads(line) for line in (assets.data / f"{split}.jsonl").read_text().splitlines()]
        (out / "api" / name).parent.mkdir(parents=True, exist_ok=True)
        (out / "api" / name).write_text("".join(json.dumps({"messages": [
            {"role": "user", "content": row["question"]}, {"role": "assistant", "content": row["answer"]}]}) + "\n"
            for row in rows))
    return assets


def _through_the_api(cluster, assets, out: Path, timeout: float) -> str:
    """`lorajob api` serving the demo namespace, and the OpenAI-client script run as a tenant holding the API's caller
    rules there: Succeeded when the script's job succeeded."""
    from lorajob_devcluster import localjob
    from lorajob_operator.local import ApiServerProcess
    from lorajob_operator.openai_api import CALLER_RULES

    config = {"storage": str(out / "api" / "storage"), "namespaces": [NAMESPACE],
              "models": {localjob.MODEL_NAME: localjob.fine_tuning_offer(assets)}}
    token = cluster.plane.service_account_token(NAMESPACE, "demo-user", CALLER_RULES)
    with ApiServerProcess(cluster.kubeconfig, config, out / "api") as server:
        print(f"fine-tuning API: {server.url}/v1 (log {server.log_path})", flush=True)
        environment = {**os.environ, "OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": token,
                       "OPENAI_PROJECT_ID": NAMESPACE}
        script = [sys.executable, str(REPO_ROOT / "examples" / "fine_tuning_api.py"), str(out / "api" / "train.jsonl"),
                  "--validation", str(out / "api" / "valid.jsonl"), "--model", localjob.MODEL_NAME, "--suffix", "demo",
                  "--epochs", "1", "--poll", "2"]
        print("$ OPENAI_BASE_URL=... OPENAI_API_KEY=<token> OPENAI_PROJECT_ID=demo python "
              + " ".join(script[1:]).replace(str(REPO_ROOT) + "/", ""), flush=True)
        done = subprocess.run(script, env=environment, timeout=timeout, check=False)
    return "Succeeded" if done.returncode == 0 else "Failed"


if __name__ == "__main__":
    sys.exit(main())
