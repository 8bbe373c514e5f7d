"""Request latencies of the fine-tuning API (`lorajob api`), against the API server's own floor, in one run.

    python bench/api_latency.py [--jobs 20] [--upload-mb 20]

Starts a real control plane (etcd and kube-apiserver with the CRDs; no controllers: nothing needs to run), a tenant
(a ServiceAccount with a Role on LoRAJobs in its namespace, and its token) and the API server, then with the official
`openai` client:
* create:   `fine_tuning.jobs.create` until it returns, when its LoRAJob exists (checked); the floor is one client
            creating the same LoRAJob directly;
* status:   a status change (phase Training, written as the operator writes it) until `jobs.retrieve` shows
            `running`; the floor is one GET of the LoRAJob;
* retrieve, list_events, list: one call each;
* upload:   a chat JSONL file of --upload-mb, checked line by line as it streams in (MB/s).
Each request pays a TokenReview and a SubjectAccessReview before its own calls. Prints median, p90 and max, and
each median's ratio to its floor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT / "devcluster")]

from lorajob_devcluster import ControlPlane, ControlPlaneConfig  # noqa: E402
from lorajob_operator import api  # noqa: E402
from lorajob_operator.local import ApiServerProcess  # noqa: E402
from lorajob_operator.openai_api import CALLER_RULES  # noqa: E402

NAMESPACE = "tenant-a"
MODEL = "qwen3-4b"
TEMPLATE = {
    "model": {"name": "qwen3-4b", "huggingFace": "gs://models/qwen3-4b"},
    "training": {"perDeviceBatchSize": 2, "maxTargetLength": 512},
    "compute": {"tpu": {"machineType": "ct6e-standard-4t", "topology": "2x4"}},
}


def chat_line(index: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": f"what is {index} plus {index}?"},
                                    {"role": "assistant", "content": f"the answer is {2 * index}."}]}).encode() + b"\n"


def summary(name: str, seconds: list[float], floor: list[float] | None = None) -> str:
    ordered = sorted(seconds)
    median = statistics.median(ordered)
    line = (f"{name:<28} median {median * 1000:7.1f} ms  p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1000:7.1f} ms  "
            f"max {ordered[-1] * 1000:7.1f} ms  (n={len(ordered)})")
    if floor:
        line += f"  floor {statistics.median(floor) * 1000:6.1f} ms  ratio {median / statistics.median(floor):4.1f}x"
    return line


def timed(function, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--upload-mb", type=float, default=20.0)
    args = parser.parse_args()
    import openai
    from kubernetes import client as kube

    with tempfile.TemporaryDirectory(prefix="api-latency-") as scratch, \
            ControlPlane.start(ControlPlaneConfig(crd_dirs=(REPO_ROOT / "crds",))) as plane:
        directory = Path(scratch)
        plane.kubectl("create", "namespace", NAMESPACE)
        token = plane.service_account_token(NAMESPACE, "alice", CALLER_RULES)
        config = {"storage": str(directory / "storage"), "namespaces": [NAMESPACE], "models": {MODEL: {"template": TEMPLATE}},
                  "limits": {"requestsPerMinute": 100_000}}
        custom = kube.CustomObjectsApi(plane.api_client())
        with ApiServerProcess(plane.kubeconfig, config, directory) as server:
            openai_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=token, project=NAMESPACE, max_retries=0)
            lines = b"".join(chat_line(i) for i in range(200))
            training = openai_client.files.create(file=("train.jsonl", lines), purpose="fine-tune")

            creates, direct_creates, changes, gets = [], [], [], []
            retrieves, events, listings = [], [], []
            for index in range(args.jobs):
                seconds, job = timed(openai_client.fine_tuning.jobs.create, model=MODEL, training_file=training.id)
                creates.append(seconds)
                body = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, job.id)
                copy_body = {k: body[k] for k in ("apiVersion", "kind", "spec")}
                copy_body["metadata"] = {"name": f"direct-{index}"}
                direct_creates.append(timed(custom.create_namespaced_custom_object, api.GROUP, api.VERSION, NAMESPACE,
                                            api.PLURAL, copy_body)[0])

                custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, NAMESPACE, api.PLURAL, job.id,
                                                             {"status": {"phase": "Training"}})
                changed = time.perf_counter()
                while openai_client.fine_tuning.jobs.retrieve(job.id).status != "running":
                    pass
                changes.append(time.perf_counter() - changed)
                gets.append(timed(custom.get_namespaced_custom_object, api.GROUP, api.VERSION, NAMESPACE, api.PLURAL,
                                  job.id)[0])
                retrieves.append(timed(openai_client.fine_tuning.jobs.retrieve, job.id)[0])
                events.append(timed(openai_client.fine_tuning.jobs.list_events, job.id)[0])
                listings.append(timed(openai_client.fine_tuning.jobs.list, limit=20)[0])

            size = int(args.upload_mb * 2**20)
            line = chat_line(12345)
            upload = line * (size // len(line))
            upload_seconds, uploaded = timed(openai_client.files.create, file=("big.jsonl", upload), purpose="fine-tune")

    print(f"fine-tuning API latencies, {args.jobs} jobs (one client, sequential; TokenReview + SubjectAccessReview "
          "per request)")
    print(summary("create -> LoRAJob exists", creates, direct_creates))
    print(summary("status change -> retrieve", changes, gets))
    print(summary("retrieve", retrieves, gets))
    print(summary("list_events", events))
    print(summary("list (limit 20)", listings))
    print(f"{'upload (checked, stored)':<28} {len(upload) / 2**20:.1f} MB ({uploaded.lines} lines) in "
          f"{upload_seconds:.2f} s: {len(upload) / 2**20 / upload_seconds:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
