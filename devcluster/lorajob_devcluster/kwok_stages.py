"""kwok Stage objects that play the life of pods on fake nodes.

kwok has no kubelet: Stages patch pod status when a selector (jq expressions over the pod) matches.
Supplying any pod Stage drops kwok's built-in ones, so this module supplies the whole set.

Container-image convention for e2e tests (no test-only code in the operator):

* any other image                    Running, then Succeeded (exit 0) after ``complete_delay_ms``
* ``sim.lorajob.dev/fail:exit-<N>``   Running, then Failed: that container terminated with exit code N,
                                      reason Error, after ``complete_delay_ms``; N in ``FAILING_EXIT_CODES``
* ``sim.lorajob.dev/slow``            Running, then Succeeded after ``slow_delay_ms`` (default 60 s)
* ``sim.lorajob.dev/hang``            Running forever (until deleted)

A LoRAJob's check step (pods labelled ``lorajob.dev/phase: check``) runs the trainer image too, and
succeeds after ``complete_delay_ms`` whatever its image: the special images act on the steps after it.
Only pods owned by a Job ever complete; other pods stay Running. The pod annotation
``sim.lorajob.dev/run-duration`` (a Go duration such as ``45s``) overrides its run time.
A deleted pod is first made terminal (exit 143, like a kubelet after SIGTERM) and then removed once
no finalizer is left, so the Job controller sees the same sequence it sees on a real node.
Pods bound to the nodes given as `runner_nodes` match no Stage: `podrunner` runs them for real.

Container logs: kwok serves `pods/log` from files named by `ClusterLogs` objects (kwok's CRDs, read
from the cluster): `cluster_logs` points the given containers of every pod of a namespace at a file
in the container runtime's log format, which `cri_log` writes; a `Logs` object (namespaced, named after
a pod) does the same for one pod and takes precedence.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, UTC
from pathlib import Path

import yaml

from lorajob_trainer.contract import exit_codes

from .documents import load_document

SIM_IMAGE_PREFIX = "sim.lorajob.dev/"
FAILING_EXIT_CODES = (1, 2, 3, 42, 137)
SLOW_IMAGE = f"{SIM_IMAGE_PREFIX}slow"
HANG_IMAGE = f"{SIM_IMAGE_PREFIX}hang"
RUN_DURATION_ANNOTATION = "sim.lorajob.dev/run-duration"
KWOK_NODE_STAGE_FILES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
)
KWOK_API_VERSION = "kwok.x-k8s.io/v1alpha1"
LOG_CRD_KINDS = ("ClusterLogs", "Logs")
"""kwok reads these kinds from the cluster (`--enable-crds`) instead of its config file."""
KWOK_LOG_CRD_FILES = ("kustomize/crd/bases/kwok.x-k8s.io_clusterlogs.yaml", "kustomize/crd/bases/kwok.x-k8s.io_logs.yaml")


def failing_image(exit_code: int) -> str:
    """The image that makes a simulated container exit with `exit_code`."""
    if exit_code not in FAILING_EXIT_CODES:
        raise ValueError(f"exit code {exit_code} has no failing image; choose one of {FAILING_EXIT_CODES}")
    return f"{SIM_IMAGE_PREFIX}fail:exit-{exit_code}"


@dataclasses.dataclass(frozen=True)
class PodTiming:
    start_delay_ms: int = 200
    complete_delay_ms: int = 1500
    complete_jitter_ms: int = 1000
    slow_delay_ms: int = 60_000
    delete_delay_ms: int = 100


def _jq(key: str, operator: str, values: list[str] | None = None) -> dict:
    expression = {"key": key, "operator": operator}
    if values is not None:
        expression["values"] = values
    return {"jq": expression}


NOT_DELETED = _jq(".metadata.deletionTimestamp", "DoesNotExist")
IS_RUNNING = _jq(".status.phase", "In", ["Running"])
OWNED_BY_JOB = _jq(".metadata.ownerReferences.[].kind", "In", ["Job"])
IMAGES = ".spec.containers.[].image"
STEP = '.metadata.labels["lorajob.dev/phase"]'
CHECK_STEP = ["check"]


def _stage(name: str, expressions: list[dict], delay: dict | None, steps: list[dict]) -> dict:
    spec: dict = {"resourceRef": {"apiGroup": "v1", "kind": "Pod"}, "selector": {"matchExpressions": expressions}}
    if delay:
        spec["delay"] = delay
    spec["steps"] = steps
    return {"apiVersion": KWOK_API_VERSION, "kind": "Stage", "metadata": {"name": name}, "spec": spec}


def _status_patch(template: str) -> dict:
    return {"patch": {"subresource": "status", "root": "status", "template": template}}


def _run_delay(milliseconds: int, jitter_ms: int = 0) -> dict:
    from_annotation = {"jq": {"expression": f'.metadata.annotations["{RUN_DURATION_ANNOTATION}"]'}}
    delay = {"durationMilliseconds": milliseconds, "durationFrom": from_annotation}
    if jitter_ms:
        # kwok caps the delay at the jitter bound, so the annotation must set both.
        delay |= {"jitterDurationMilliseconds": milliseconds + jitter_ms, "jitterDurationFrom": from_annotation}
    return delay


def _conditions(status: str, types: tuple[str, ...]) -> str:
    lines = ["conditions:"]
    for condition_type in types:
        lines += [f"- type: {condition_type}", f'  status: "{status}"', "  lastTransitionTime: {{ $now | Quote }}"]
    return "\n".join(lines) + "\n"


ALL_CONDITIONS = ("PodScheduled", "Initialized", "Ready", "ContainersReady")
READINESS_CONDITIONS = ("Ready", "ContainersReady")

_RUNNING_TEMPLATE = (
    "{{ $now := Now }}\n"
    + _conditions("True", ALL_CONDITIONS)
    + """containerStatuses:
{{ range .spec.containers }}
- name: {{ .name | Quote }}
  image: {{ .image | Quote }}
  ready: true
  started: true
  restartCount: 0
  state:
    running:
      startedAt: {{ $now | Quote }}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""
)


def _per_container(failing_image_name: str | None, failing_value: str, other_value: str) -> str:
    """Template text choosing a value per container: `failing_value` for the failing image (all, when None)."""
    if failing_image_name is None:
        return failing_value
    return f'{{{{ if eq .image "{failing_image_name}" }}}}{failing_value}{{{{ else }}}}{other_value}{{{{ end }}}}'


def _terminated_template(phase: str, failing_image_name: str | None, exit_code: int) -> str:
    """Every container terminates; those running `failing_image_name` (all, when None) get `exit_code`."""
    exit_code_text = _per_container(failing_image_name, str(exit_code), "0")
    reason_text = _per_container(failing_image_name, "Completed" if exit_code == 0 else "Error", "Completed")
    return (
        "{{ $now := Now }}\n"
        + _conditions("False", READINESS_CONDITIONS)
        + f"""containerStatuses:
{{{{ range .spec.containers }}}}
- name: {{{{ .name | Quote }}}}
  image: {{{{ .image | Quote }}}}
  ready: false
  started: false
  restartCount: 0
  state:
    terminated:
      exitCode: {exit_code_text}
      reason: {reason_text}
      startedAt: {{{{ $now | Quote }}}}
      finishedAt: {{{{ $now | Quote }}}}
{{{{ end }}}}
phase: {phase}
"""
    )


def pod_stages(timing: PodTiming = PodTiming(), runner_nodes: tuple[str, ...] = ()) -> list[dict]:
    failing = {failing_image(code): code for code in FAILING_EXIT_CODES}
    special_images = [*failing, SLOW_IMAGE, HANG_IMAGE]
    completes = [NOT_DELETED, IS_RUNNING, OWNED_BY_JOB]
    stages = [
        _stage(
            "lorajob-pod-start",
            [NOT_DELETED, _jq(".status.podIP", "DoesNotExist")],
            {"durationMilliseconds": timing.start_delay_ms},
            [_status_patch(_RUNNING_TEMPLATE)],
        ),
        _stage(
            "lorajob-pod-succeed",
            [*completes, _jq(IMAGES, "NotIn", special_images)],
            _run_delay(timing.complete_delay_ms, timing.complete_jitter_ms),
            [_status_patch(_terminated_template("Succeeded", None, 0))],
        ),
        _stage(
            "lorajob-pod-succeed-check",
            [*completes, _jq(IMAGES, "In", special_images), _jq(STEP, "In", CHECK_STEP)],
            _run_delay(timing.complete_delay_ms, timing.complete_jitter_ms),
            [_status_patch(_terminated_template("Succeeded", None, 0))],
        ),
        _stage(
            "lorajob-pod-succeed-slow",
            [*completes, _jq(IMAGES, "In", [SLOW_IMAGE]), _jq(IMAGES, "NotIn", list(failing)), _jq(STEP, "NotIn", CHECK_STEP)],
            _run_delay(timing.slow_delay_ms),
            [_status_patch(_terminated_template("Succeeded", None, 0))],
        ),
    ]
    for image, code in failing.items():
        stages.append(
            _stage(
                f"lorajob-pod-fail-exit-{code}",
                [*completes, _jq(IMAGES, "In", [image]), _jq(STEP, "NotIn", CHECK_STEP)],
                _run_delay(timing.complete_delay_ms),
                [_status_patch(_terminated_template("Failed", image, code))],
            )
        )
    stages += [
        _stage(
            "lorajob-pod-terminate-on-delete",
            [_jq(".metadata.deletionTimestamp", "Exists"), _jq(".status.phase", "NotIn", ["Succeeded", "Failed"])],
            {"durationMilliseconds": timing.delete_delay_ms},
            [_status_patch(_terminated_template("Failed", None, exit_codes.TERMINATED_BY_SIGTERM))],
        ),
        _stage(
            "lorajob-pod-remove-on-delete",
            [
                _jq(".metadata.deletionTimestamp", "Exists"),
                _jq(".status.phase", "In", ["Succeeded", "Failed"]),
                _jq(".metadata.finalizers", "DoesNotExist"),
            ],
            {"durationMilliseconds": timing.delete_delay_ms},
            [{"delete": True}],
        ),
    ]
    if runner_nodes:
        for stage in stages:
            stage["spec"]["selector"]["matchExpressions"].append(_jq(".spec.nodeName", "NotIn", list(runner_nodes)))
    return stages


def node_stages(kwok_module_dir: Path) -> list[dict]:
    """kwok's own node initialize + lease heartbeat Stages, read from its Go module download."""
    return [load_document(kwok_module_dir / path) for path in KWOK_NODE_STAGE_FILES]


def write_kwok_config(
    path: Path, kwok_module_dir: Path, timing: PodTiming = PodTiming(), runner_nodes: tuple[str, ...] = ()
) -> Path:
    stages = [*node_stages(kwok_module_dir), *pod_stages(timing, runner_nodes)]
    path.write_text(yaml.safe_dump_all(stages, sort_keys=False))
    return path


def log_crds(kwok_module_dir: Path) -> list[dict]:
    """kwok's CustomResourceDefinitions of the log kinds, read from its Go module download."""
    return [load_document(kwok_module_dir / path) for path in KWOK_LOG_CRD_FILES]


def cluster_logs(name: str, namespace: str, containers: list[str], logs_file: Path) -> dict:
    """A ClusterLogs object: kwok answers log requests for `containers` of every pod in `namespace` from `logs_file`."""
    return {
        "apiVersion": KWOK_API_VERSION,
        "kind": "ClusterLogs",
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchNamespaces": [namespace]},
            "logs": [{"containers": list(containers), "logsFile": str(logs_file)}],
        },
    }


def cri_log(lines: list[str], stream: str = "stdout", at: datetime | None = None) -> str:
    """`lines` as a container runtime writes them to a log file (`<RFC 3339 time> <stream> F <line>`)."""
    at = at or datetime.now(UTC)
    stamp = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f000Z")
    return "".join(f"{stamp} {stream} F {line}\n" for line in lines)
