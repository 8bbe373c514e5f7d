"""LoRAJob helpers for end-to-end tests on the simulated cluster (kubectl against the real API server)."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
SAMPLE = REPO_ROOT / "examples" / "qwen3-gsm8k.yaml"
HF_SECRET = "hf-token"
STEPS = 10
"""training.steps of `sample`."""


def every_image(image: str) -> dict:
    """spec.images running `image` in every container (the Pathways workers too: in the simulation a
    worker that exits early would give its TPU quota back to Kueue, which a real one never does)."""
    return {"trainer": image, "pathwaysServer": image, "pathwaysProxy": image}


def sample(name: str, *, train_only: bool = False, images: dict | None = None, **scheduling) -> dict:
    """The tutorial sample (convert -> Pathways train on v6e-16 -> export), renamed; `train_only`
    starts from a trainer checkpoint and skips the export."""
    body = copy.deepcopy(yaml.safe_load(SAMPLE.read_text()))
    body["metadata"] = {"name": name}
    spec = body["spec"]
    spec["training"]["steps"] = STEPS
    if train_only:
        spec["model"] = {"name": spec["model"]["name"], "maxtextCheckpoint": "gs://my-bucket/qwen3/0/items"}
        spec["export"] = {"enabled": False}
    if images:
        spec["images"] = images
    spec["scheduling"] |= scheduling
    return body


def progress_line(step: int, state: str = "running", **extra) -> str:
    """A trainer progress line (as the trainer prints it) for step `step` of a `sample` run, with a
    checkpoint and an evaluation every 5 steps."""
    from lorajob_trainer.contract.records import CheckpointRecord, ProgressRecord

    saved = [CheckpointRecord(s, round(3.0 / s, 4), round(4.0 / s, 4), 1767268800.0 + s) for s in range(5, step + 1, 5)]
    values = {"loss": round(3.0 / step, 4), "tokens_per_second": 1200.0, "eta_seconds": 4.0 * (STEPS - step),
              "checkpoints": saved, "eval_step": saved[-1].step if saved else None,
              "eval_loss": saved[-1].eval_loss if saved else None, **extra}
    return ProgressRecord(step=step, total_steps=STEPS, state=state, **values).line()


class Lorajobs:
    def __init__(self, cluster, namespace: str):
        self.cluster = cluster
        self.namespace = namespace

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        return self.cluster.kubectl("-n", self.namespace, *args, input=input, check=check)

    def apply(self, body: dict) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

    def get(self, name: str) -> dict | None:
        result = self.kubectl("get", "lorajobs.lorajob.dev", name, "-o", "json", "--ignore-not-found")
        return json.loads(result.stdout) if result.stdout.strip() else None

    def patch_spec(self, name: str, changes: dict) -> None:
        self.kubectl("patch", "lorajobs.lorajob.dev", name, "--type=merge", "-p", json.dumps({"spec": changes}))

    def delete(self, name: str) -> None:
        self.kubectl("delete", "lorajobs.lorajob.dev", name, "--wait=false")

    def jobsets(self) -> list[dict]:
        return json.loads(self.kubectl("get", "jobsets.jobset.x-k8s.io", "-o", "json").stdout)["items"]

    def pods(self) -> list[dict]:
        return json.loads(self.kubectl("get", "pods", "-o", "json").stdout)["items"]

    def events(self, name: str) -> list[dict]:
        listing = json.loads(self.kubectl("get", "events", "--field-selector", f"involvedObject.name={name}", "-o", "json").stdout)
        ours = [e for e in listing["items"] if e.get("source", {}).get("component") == "lorajob-operator"]
        return sorted(ours, key=lambda e: int(e["metadata"]["resourceVersion"]))  # creation order

    def wait(self, name: str, predicate, what: str, timeout: float = 120.0, interval: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.get(name)
            if last is not None and predicate(last):
                return last
            time.sleep(interval)
        status = json.dumps((last or {}).get("status"), indent=1)
        raise AssertionError(f"LoRAJob {self.namespace}/{name} did not reach {what} within {timeout:.0f} s; status: {status}")

    def wait_phase(self, name: str, phase: str, timeout: float = 120.0) -> dict:
        return self.wait(name, lambda obj: obj.get("status", {}).get("phase") == phase, f"phase {phase}", timeout)

    def wait_until(self, predicate, what: str, timeout: float = 60.0, interval: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            time.sleep(interval)
        raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


def condition(obj: dict, condition_type: str) -> dict:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == condition_type), {})
