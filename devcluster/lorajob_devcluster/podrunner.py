"""A stand-in kubelet and container runtime: pods bound to designated fake nodes run as local processes.

kwok keeps the nodes (heartbeats, the kubelet API that serves `pods/log`) and every other pod; its
Stages skip the pods on these nodes. For each such pod this runner

* runs every container's `command` + `args` (Kubernetes `$(VAR)` expansion) as a process; the image
  is ignored and stands for this virtual environment: its `bin/` is first on PATH, so `python` is
  this venv's interpreter;
* builds the environment as the kubelet does: `envFrom`, then `env` in order (`value`, `fieldRef`,
  `secretKeyRef`, `configMapKeyRef` read through the API), plus the image's part (`IMAGE_ENV`: JAX
  on CPU, one device per process whatever accelerator the pod asks for);
* gives each pod a directory (`<state dir>/pods/<namespace>/<pod>/`): the containers' working
  directory (`workingDir` is created inside it), HOME, the container logs, and its `emptyDir`
  volumes; volumes (`emptyDir`, `hostPath`) are bind-mounted at their `mountPath` in a mount
  namespace of the pod's own;
* resolves pod DNS names (`<hostname>.<subdomain>[.<ns>.svc.cluster.local]`, what a JobSet's
  headless service gives) to loopback, where every process listens: each pod's mount namespace sees
  one shared hosts file at /etc/hosts, appended to before a pod starts;
* writes stdout and stderr in the container runtime's log format to files that a kwok `Logs`
  object per pod serves, so `kubectl logs` and the API server's `pods/log` read them;
* patches the pod status from what really happens: Running, then Succeeded or Failed with each
  container's exit code (128 + N for signal N) and, under `FallbackToLogsOnError`, the log tail as
  termination message;
* on delete sends SIGTERM, then SIGKILL once the pod's grace period has passed, reports the exit and
  removes the pod, as a kubelet does.

Not supported (the pod stays Pending with the reason in its container status): init containers,
a restartPolicy other than Never, other volume types, `resourceFieldRef`.

    python -m lorajob_devcluster run-pods --kubeconfig K --state-dir D --node N [--node N ...]
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, UTC
from pathlib import Path

from .kwok_stages import KWOK_API_VERSION, cri_log

POD_IP = "127.0.0.1"
RESYNC_SECONDS = 1.0
IMAGE_ENV = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
"""What the trainer image would set (CPU JAX here, no network)."""
TERMINATION_MESSAGE_LINES = 80
TERMINATION_MESSAGE_BYTES = 2048
SHUTDOWN_GRACE_SECONDS = 5.0
READY_FILE = "ready"


class PodConfigError(ValueError):
    """The pod cannot be started as written; the message says why (the kubelet's CreateContainerConfigError)."""


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, values: dict[str, str]) -> str:
    """Kubernetes' `$(NAME)` expansion: known names are replaced, `$$` is a literal `$`, the rest is kept."""
    out, index = [], 0
    while index < len(text):
        char = text[index]
        if char != "$" or index + 1 == len(text):
            out.append(char)
            index += 1
            continue
        following = text[index + 1]
        if following == "$":
            out.append("$")
            index += 2
        elif following == "(" and (end := text.find(")", index + 2)) != -1:
            name = text[index + 2 : end]
            out.append(values.get(name, f"$({name})"))
            index = end + 1
        else:
            out.append("$" + following)
            index += 2
    return "".join(out)


def _field(pod: dict, path: str) -> str:
    metadata = pod["metadata"]
    for mapping in ("labels", "annotations"):
        prefix = f"metadata.{mapping}['"
        if path.startswith(prefix) and path.endswith("']"):
            return (metadata.get(mapping) or {}).get(path[len(prefix) : -2], "")
    simple = {
        "metadata.name": metadata["name"],
        "metadata.namespace": metadata["namespace"],
        "metadata.uid": metadata["uid"],
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName", ""),
        "status.hostIP": POD_IP,
        "status.podIP": POD_IP,
    }
    if path not in simple:
        raise PodConfigError(f"fieldRef {path!r} is not supported")
    return simple[path]


class PodApi:
    """The few API calls the runner makes, on the official client; objects are plain dicts."""

    def __init__(self, kubeconfig: Path):
        from kubernetes import client, config

        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.custom = client.CustomObjectsApi(self.api_client)
        self.errors = client.exceptions.ApiException

    def list_pods(self) -> list[dict]:
        response = self.core.list_pod_for_all_namespaces(_preload_content=False)
        return json.loads(response.data)["items"]

    def watch(self, on_change, stop: threading.Event) -> None:
        """Call `on_change()` on every pod event until `stop` (the watch restarts from a fresh version)."""
        from kubernetes import watch

        while not stop.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(limit=1, _preload_content=False)
                version = json.loads(listing.data)["metadata"]["resourceVersion"]
                for _ in watch.Watch().stream(self.core.list_pod_for_all_namespaces, resource_version=version, timeout_seconds=30):
                    on_change()
            except Exception:  # noqa: BLE001 - an expired or broken watch only delays the next resync
                time.sleep(RESYNC_SECONDS)

    def key_ref(self, kind: str, namespace: str, ref: dict) -> str | None:
        values = self.all_keys(kind, namespace, ref)
        if ref["key"] not in values and not ref.get("optional"):
            raise PodConfigError(f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}")
        return values.get(ref["key"])

    def all_keys(self, kind: str, namespace: str, ref: dict) -> dict[str, str]:
        read = self.core.read_namespaced_secret if kind == "secret" else self.core.read_namespaced_config_map
        try:
            return self._decoded(kind, read(ref["name"], namespace))
        except self.errors as error:
            if error.status == 404 and ref.get("optional"):
                return {}
            raise PodConfigError(f"{kind} {namespace}/{ref['name']}: {error.reason}") from None

    @staticmethod
    def _decoded(kind: str, found) -> dict[str, str]:
        data = found.data or {}
        return {k: base64.b64decode(v).decode() for k, v in data.items()} if kind == "secret" else dict(data)

    def patch_status(self, pod: dict, status: dict) -> None:
        meta = pod["metadata"]
        try:
            self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status})
        except self.errors as error:
            if error.status != 404:
                raise

    def remove(self, pod: dict) -> None:
        """The kubelet's final delete (grace 0) once every container has stopped."""
        from kubernetes import client

        meta = pod["metadata"]
        options = client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"]))
        try:
            self.core.delete_namespaced_pod(meta["name"], meta["namespace"], body=options)
        except self.errors as error:
            if error.status not in (404, 409):
                raise

    def serve_logs(self, pod: dict, files: dict[str, Path]) -> None:
        """A kwok `Logs` object named after the pod (owned by it): kwok answers `pods/log` from `files`."""
        meta = pod["metadata"]
        owner = {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
        body = {
            "apiVersion": KWOK_API_VERSION,
            "kind": "Logs",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"], "ownerReferences": [owner]},
            "spec": {"logs": [{"containers": [name], "logsFile": str(path), "follow": True} for name, path in files.items()]},
        }
        group, version = KWOK_API_VERSION.split("/")
        try:
            self.custom.create_namespaced_custom_object(group, version, meta["namespace"], "logs", body)
        except self.errors as error:
            if error.status != 409:
                raise


@dataclasses.dataclass
class Container:
    name: str
    image: str
    process: subprocess.Popen
    log_path: Path
    started_at: str
    pumps: list[threading.Thread]
    finished_at: str = ""

    @property
    def exit_code(self) -> int | None:
        code = self.process.poll()
        if code is None or any(pump.is_alive() for pump in self.pumps):
            return None
        self.finished_at = self.finished_at or now()
        return 128 - code if code < 0 else code  # signal N: 128 + N, as container runtimes report it


@dataclasses.dataclass
class RunningPod:
    pod: dict
    containers: list[Container]
    kill_at: float | None = None
    reported_running: bool = False
    reported: bool = False
    removed: bool = False

    def finished(self) -> bool:
        return all(c.exit_code is not None for c in self.containers)

    def signal(self, signum: int) -> None:
        for container in self.containers:
            if container.process.poll() is None:
                try:
                    os.killpg(container.process.pid, signum)
                except ProcessLookupError:
                    pass


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
    nodes: frozenset[str]
    state_dir: Path
    bin_dir: Path = Path(sys.executable).parent
    """The "image": its python and tools come first on PATH."""


class PodRunner:
    def __init__(self, api: PodApi, config: RunnerConfig):
        self.api = api
        self.config = config
        self.pods: dict[str, RunningPod] = {}
        self.config_errors: dict[str, str] = {}
        self.hosts = config.state_dir / "hosts"
        self.hosts.parent.mkdir(parents=True, exist_ok=True)
        self.hosts.write_text(Path("/etc/hosts").read_text().rstrip("\n") + "\n")
        self.mount = shutil.which("mount") or "/bin/mount"
        self.unshare = self._unshare_command()

    @staticmethod
    def _unshare_command() -> list[str]:
        """A private mount namespace per pod: as root directly, otherwise inside a user namespace."""
        base = [shutil.which("unshare") or "/usr/bin/unshare", "--mount", "--propagation", "private"]
        return base if os.geteuid() == 0 else [base[0], "--user", "--map-root-user", *base[1:]]

    # --- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        wake: queue.Queue = queue.Queue()
        threading.Thread(target=self.api.watch, args=(lambda: wake.put(None), stop), daemon=True).start()
        (self.config.state_dir / READY_FILE).touch()
        while not stop.is_set():
            try:
                self.sync()
            except Exception as error:  # noqa: BLE001 - e.g. the API server restarting: the next sync retries
                print(f"podrunner: sync failed: {error!r}", file=sys.stderr, flush=True)
            try:
                wake.get(timeout=RESYNC_SECONDS)
                while not wake.empty():  # one sync for a burst of events
                    wake.get_nowait()
            except queue.Empty:
                pass
        self.shutdown()

    def sync(self) -> None:
        present = set()
        for pod in self.api.list_pods():
            if pod["spec"].get("nodeName") in self.config.nodes:
                present.add(pod["metadata"]["uid"])
                self.sync_pod(pod)
        for uid in set(self.pods) - present:  # removed without a graceful delete
            self.pods.pop(uid).signal(signal.SIGKILL)
        for uid in set(self.config_errors) - present:
            del self.config_errors[uid]

    def sync_pod(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        deleting = bool(pod["metadata"].get("deletionTimestamp"))
        running = self.pods.get(uid)
        if running is None:
            if deleting or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                if deleting:
                    self.api.remove(pod)
                return
            self.start(pod)
            return
        running.pod = pod
        if not running.reported_running:
            self.api.patch_status(pod, self.running_status(running.containers))
            running.reported_running = True
        if deleting and running.kill_at is None and not running.finished():
            running.signal(signal.SIGTERM)
            grace = pod["metadata"].get("deletionGracePeriodSeconds") or 0
            running.kill_at = time.monotonic() + grace
        if running.kill_at is not None and time.monotonic() >= running.kill_at:
            running.signal(signal.SIGKILL)
        if running.finished() and not running.reported:
            self.api.patch_status(pod, self.terminated_status(running))
            running.reported = True
        if deleting and running.reported and not running.removed:
            self.api.remove(pod)
            running.removed = True

    def shutdown(self) -> None:
        for running in self.pods.values():
            running.signal(signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        while time.monotonic() < deadline and not all(r.finished() for r in self.pods.values()):
            time.sleep(0.1)
        for running in self.pods.values():
            running.signal(signal.SIGKILL)

    # --- starting a pod ---------------------------------------------------------------------

    def start(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        try:
            plans = [self.plan(pod, container) for container in pod["spec"]["containers"]]
        except PodConfigError as error:
            if self.config_errors.get(uid) != str(error):
                self.config_errors[uid] = str(error)
                self.api.patch_status(pod, self.waiting_status(pod, str(error)))
            return
        self.config_errors.pop(uid, None)
        directory = self.pod_dir(pod)
        self.api.serve_logs(pod, {name: directory / f"{name}.log" for name, *_ in plans})
        self.add_host_names(pod)
        self.pods[uid] = RunningPod(pod, [self.launch(pod, *plan) for plan in plans])
        self.sync_pod(pod)

    def pod_dir(self, pod: dict) -> Path:
        meta = pod["metadata"]
        return self.config.state_dir / "pods" / meta["namespace"] / meta["name"]

    def plan(self, pod: dict, container: dict) -> tuple[str, list[str], dict[str, str], Path, list[tuple[Path, str]]]:
        """(name, argv, environment, working directory, bind mounts) of one container, or PodConfigError."""
        spec = pod["spec"]
        if spec.get("initContainers"):
            raise PodConfigError("init containers are not supported by the pod runner")
        if spec.get("restartPolicy", "Always") != "Never":
            raise PodConfigError(f"restartPolicy {spec.get('restartPolicy', 'Always')} is not supported (only Never)")
        env = self.environment(pod, container)
        command = [expand(part, env) for part in [*container.get("command", []), *container.get("args", [])]]
        if not command:
            raise PodConfigError(f"container {container['name']} has no command (image entry points are not known here)")
        directory = self.pod_dir(pod)
        workdir = directory / "root" / container.get("workingDir", "/").lstrip("/")
        return container["name"], command, env, workdir, self.mounts(pod, container)

    def environment(self, pod: dict, container: dict) -> dict[str, str]:
        namespace = pod["metadata"]["namespace"]
        defined: dict[str, str] = {}
        for source in container.get("envFrom", []):
            kind = "secret" if "secretRef" in source else "configmap"
            values = self.api.all_keys(kind, namespace, source.get("secretRef") or source.get("configMapRef"))
            defined |= {source.get("prefix", "") + key: value for key, value in values.items()}
        for item in container.get("env", []):
            value = self.env_value(pod, item, defined)
            if value is not None:
                defined[item["name"]] = value
        directory = self.pod_dir(pod)
        base = {
            "PATH": f"{self.config.bin_dir}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(directory / "home"),
            "HOSTNAME": pod["spec"].get("hostname") or pod["metadata"]["name"],
            **IMAGE_ENV,
        }
        return base | defined

    def env_value(self, pod: dict, item: dict, defined: dict[str, str]) -> str | None:
        if "valueFrom" not in item:
            return expand(item.get("value", ""), defined)
        source = item["valueFrom"]
        namespace = pod["metadata"]["namespace"]
        if "fieldRef" in source:
            return _field(pod, source["fieldRef"]["fieldPath"])
        if "secretKeyRef" in source:
            return self.api.key_ref("secret", namespace, source["secretKeyRef"])
        if "configMapKeyRef" in source:
            return self.api.key_ref("configmap", namespace, source["configMapKeyRef"])
        raise PodConfigError(f"env {item['name']}: {', '.join(source)} is not supported by the pod runner")

    def mounts(self, pod: dict, container: dict) -> list[tuple[Path, str]]:
        volumes = {volume["name"]: volume for volume in pod["spec"].get("volumes", [])}
        mounts = []
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"])
            if volume is None:
                raise PodConfigError(f"volumeMount {mount['name']} names no volume of the pod")
            if "emptyDir" in volume:
                source = self.pod_dir(pod) / "volumes" / mount["name"]
            elif "hostPath" in volume:
                source = Path(volume["hostPath"]["path"])
            else:
                kinds = ", ".join(key for key in volume if key != "name")
                raise PodConfigError(f"volume {mount['name']} ({kinds}) is not supported (only emptyDir, hostPath)")
            mounts.append((source, mount["mountPath"]))
        return mounts

    def add_host_names(self, pod: dict) -> None:
        spec, namespace = pod["spec"], pod["metadata"]["namespace"]
        hostname = spec.get("hostname") or pod["metadata"]["name"]
        names = [hostname]
        if spec.get("subdomain"):
            names = [f"{hostname}.{spec['subdomain']}.{namespace}.svc.cluster.local", f"{hostname}.{spec['subdomain']}", *names]
        with self.hosts.open("a") as hosts:  # in place: the pods' bind mounts see the same file
            hosts.write(f"{POD_IP} {' '.join(names)}\n")

    def launch(self, pod: dict, name: str, argv: list[str], env: dict[str, str], workdir: Path, mounts) -> Container:
        for directory in (workdir, Path(env["HOME"]), *(source for source, _ in mounts)):
            directory.mkdir(parents=True, exist_ok=True)
        setup = [f"{self.mount} --bind {shlex.quote(str(self.hosts))} /etc/hosts"]
        for source, target in mounts:
            setup += [f"mkdir -p {shlex.quote(target)}", f"{self.mount} --bind {shlex.quote(str(source))} {shlex.quote(target)}"]
        script = " && ".join([*setup, 'exec "$@"'])
        log_path = self.pod_dir(pod) / f"{name}.log"
        log_path.touch()
        process = subprocess.Popen(
            [*self.unshare, "/bin/sh", "-c", script, "pod-setup", *argv],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            start_new_session=True,
        )
        lock = threading.Lock()
        pumps = [
            threading.Thread(target=_pump, args=(stream, label, log_path, lock), daemon=True)
            for stream, label in ((process.stdout, "stdout"), (process.stderr, "stderr"))
        ]
        for pump in pumps:
            pump.start()
        image = next(c["image"] for c in pod["spec"]["containers"] if c["name"] == name)
        return Container(name, image, process, log_path, now(), pumps)

    # --- status -----------------------------------------------------------------------------

    @staticmethod
    def _conditions(ready: bool) -> list[dict]:
        stamp = now()
        states = {"PodScheduled": True, "Initialized": True, "Ready": ready, "ContainersReady": ready}
        return [{"type": t, "status": str(s), "lastTransitionTime": stamp} for t, s in states.items()]

    def running_status(self, containers: list[Container]) -> dict:
        statuses = [
            {"name": c.name, "image": c.image, "imageID": "", "containerID": f"podrunner://{c.process.pid}",
             "ready": True, "started": True, "restartCount": 0, "state": {"running": {"startedAt": c.started_at}}}
            for c in containers
        ]
        return {"phase": "Running", "hostIP": POD_IP, "podIP": POD_IP, "podIPs": [{"ip": POD_IP}],
                "startTime": now(), "conditions": self._conditions(True), "containerStatuses": statuses}

    def waiting_status(self, pod: dict, message: str) -> dict:
        statuses = [
            {"name": c["name"], "image": c["image"], "imageID": "", "ready": False, "started": False, "restartCount": 0,
             "state": {"waiting": {"reason": "CreateContainerConfigError", "message": message}}}
            for c in pod["spec"]["containers"]
        ]
        return {"phase": "Pending", "conditions": self._conditions(False), "containerStatuses": statuses}

    def terminated_status(self, running: RunningPod) -> dict:
        policies = {c["name"]: c.get("terminationMessagePolicy", "File") for c in running.pod["spec"]["containers"]}
        statuses = []
        for c in running.containers:
            code = c.exit_code
            terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                          "startedAt": c.started_at, "finishedAt": c.finished_at, "containerID": f"podrunner://{c.process.pid}"}
            if code != 0 and policies[c.name] == "FallbackToLogsOnError":
                terminated["message"] = _log_tail(c.log_path)
            statuses.append({"name": c.name, "image": c.image, "imageID": "", "ready": False, "started": False,
                             "restartCount": 0, "state": {"terminated": terminated}})
        phase = "Succeeded" if all(s["state"]["terminated"]["exitCode"] == 0 for s in statuses) else "Failed"
        return {"phase": phase, "conditions": self._conditions(False), "containerStatuses": statuses}


def _pump(stream, label: str, log_path: Path, lock: threading.Lock) -> None:
    """Copy one output stream into the container log, one CRI line per line of output."""
    with stream:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with lock, log_path.open("a") as log:
                log.write(cri_log([line], stream=label))


def _log_tail(log_path: Path) -> str:
    """The kubelet's FallbackToLogsOnError message: the last lines of the log, at most 2 KiB."""
    lines = [line.split(" ", 3)[-1] for line in log_path.read_text(errors="replace").splitlines()]
    text = "\n".join(lines[-TERMINATION_MESSAGE_LINES:])
    return text.encode()[-TERMINATION_MESSAGE_BYTES:].decode(errors="ignore")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--node", action="append", required=True, help="a node whose pods run here (repeat)")


def serve(args: argparse.Namespace) -> int:
    """Run the pods of `args.node` until SIGINT or SIGTERM, then stop them."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    PodRunner(PodApi(args.kubeconfig), RunnerConfig(frozenset(args.node), args.state_dir)).run(stop)
    return 0
