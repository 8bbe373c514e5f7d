"""Run the operator, or the fine-tuning API server, as a child process against a kubeconfig (e2e tests, the demo,
the benchmarks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import TypeVar
from collections.abc import Callable

STARTUP_TIMEOUT_SECONDS = 60.0
T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalProcess:
    """A child process with a kubeconfig and a health URL: `start` returns once the URL answers 200."""

    name = "process"
    health_url: str

    def __init__(self, kubeconfig: Path, log_path: Path):
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self._process: subprocess.Popen | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return {key: value for key, value in os.environ.items() if not key.startswith("LORAJOB_")} | {
            "KUBECONFIG": str(self.kubeconfig)}

    def start(self):
        log = self.log_path.open("ab")
        self._process = subprocess.Popen(self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_healthy()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the {self.name} exited with {self._process.returncode}; log: {self.log_path}\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the {self.name} was not healthy within {STARTUP_TIMEOUT_SECONDS:.0f} s; log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """SIGKILL: a crash, nothing cleaned up."""
        if self._process and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        if self._process and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class OperatorProcess(LocalProcess):
    """`python -m lorajob_operator` watching `namespaces`, with LORAJOB_* `settings` in its environment.

    Its Lease is in the first watched namespace unless `settings` say otherwise, and its name in the Lease
    stays the same across `kill` and `start` (as a pod's name does across container restarts), so a
    restarted operator resumes at once where no other replica took over."""

    name = "operator"

    def __init__(
        self, kubeconfig: Path, namespaces: list[str], log_path: Path, settings: dict[str, str] | None = None,
        verbose: bool = False,
    ):
        super().__init__(kubeconfig, log_path)
        self.namespaces = namespaces
        self.settings = settings or {}
        self.verbose = verbose
        self.health_url = f"http://127.0.0.1:{_free_port()}/healthz"
        metrics_port = int(self.settings.get("LORAJOB_METRICS_PORT", "0"))
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
        """The Prometheus endpoint, when `settings` give LORAJOB_METRICS_PORT (off by default: a fixed port
        would clash between test sessions sharing a machine)."""
        self.identity = self.settings.get("LORAJOB_LEADER_IDENTITY") or f"local-{uuid.uuid4().hex[:8]}"

    def environment(self) -> dict[str, str]:
        return super().environment() | {"LORAJOB_METRICS_PORT": "0", "LORAJOB_LEADER_IDENTITY": self.identity,
                                        **self.settings}

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "lorajob_operator", "--liveness", self.health_url]
        for namespace in self.namespaces:
            command += ["--namespace", namespace]
        if self.verbose:
            command.append("--verbose")
        return command

    def metrics(self) -> dict[str, float]:
        """The samples of its Prometheus endpoint, `name{labels}` -> value (needs LORAJOB_METRICS_PORT)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return {key: float(value) for key, _, value in
                (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}

    def requests_by_verb(self) -> dict[str, float]:
        """API requests it has sent, by Kubernetes verb."""
        prefix = 'lorajob_operator_api_requests_total{verb="'
        return {key[len(prefix):].split('"', 1)[0]: value for key, value in self.metrics().items() if key.startswith(prefix)}

    def looked_at_lease(self) -> bool:
        """It has read the Lease at least once (a standby sends no other get: it reconciles nothing)."""
        return self.requests_by_verb().get("get", 0) >= 1

    def crash(self) -> float:
        """SIGKILL, then a new process: returns time.monotonic() once an operator serves again."""
        self.kill()
        self.start()
        return time.monotonic()

class ApiServerProcess(LocalProcess):
    """`lorajob api` serving `config` (openai_api.config.ServerConfig, as a dict) on a free loopback port."""

    name = "fine-tuning API server"

    def __init__(self, kubeconfig: Path, config: dict, directory: Path):
        super().__init__(kubeconfig, directory / "api-server.log")
        self.config_path = directory / "api-server.yaml"
        self.config_path.write_text(json.dumps(config))
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.health_url = f"{self.url}/healthz"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "lorajob_operator.cli", "api", "--config", str(self.config_path),
                "--listen", self.url.removeprefix("http://")]


class OperatorReplicas:
    """`count` replicas of one operator (one Lease; each its own OperatorProcess, metrics port and log
    `<log_dir>/operator-<i>.log`): `crash` SIGKILLs the leader and starts it again once a standby has taken over."""

    def __init__(self, kubeconfig: Path, namespaces: list[str], log_dir: Path, settings: dict[str, str] | None = None,
                 count: int = 2):
        from kubernetes import client, config

        self.settings = settings or {}
        self.replicas = [
            OperatorProcess(kubeconfig, namespaces, log_dir / f"operator-{index}.log",
                            {**self.settings, "LORAJOB_METRICS_PORT": str(_free_port())})
            for index in range(count)
        ]
        self.lease_namespace = self.settings.get("LORAJOB_LEADER_LEASE_NAMESPACE") or namespaces[0]
        self.lease_name = self.settings.get("LORAJOB_LEADER_LEASE_NAME", "lorajob-operator")
        self._custom = client.CustomObjectsApi(config.new_client_from_config(str(kubeconfig)))

    @property
    def log_path(self) -> Path:
        return self.replicas[0].log_path.parent

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(f"--- {r.log_path.name} ({r.identity})\n{r.log_tail(lines)}" for r in self.replicas)

    def lease(self) -> dict:
        """The Lease's spec ({} while there is no Lease)."""
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self._custom.get_namespaced_custom_object(
                "coordination.k8s.io", "v1", self.lease_namespace, "leases", self.lease_name)
        except ApiException as error:
            if error.status == 404:
                return {}
            raise
        return lease.get("spec") or {}

    def holder(self) -> str | None:
        """The Lease's holderIdentity (None: no Lease, or released)."""
        return self.lease().get("holderIdentity")

    def leader(self) -> OperatorProcess | None:
        """The running replica that holds the Lease (None: none does, e.g. the holder was killed)."""
        holder = self.holder()
        return next((r for r in self.replicas if r.identity == holder and r.running()), None)

    def wait_for_leader(self, timeout: float = STARTUP_TIMEOUT_SECONDS) -> OperatorProcess:
        return self._poll(self.leader, timeout, "no running replica took the Lease")

    def _poll(self, found: Callable[[], T | None], timeout: float, failure: str) -> T:
        """`found()` once it is truthy; RuntimeError (`failure`, with the replicas' logs) after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not (value := found()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{failure} within {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.1)
        return value

    def start(self) -> OperatorReplicas:
        """Starts the replicas not running, the first one alone until it leads; returns when every other one
        stands by (its caches synced, it has looked at the Lease: the campaign starts after the sync)."""
        for index, replica in enumerate(self.replicas):
            if not replica.running():
                replica.start()
            if index == 0:
                self.wait_for_leader()
        self._poll(lambda: all(replica.looked_at_lease() for replica in self.replicas), STARTUP_TIMEOUT_SECONDS,
                   "a replica did not look at the Lease")
        return self

    def healthy(self) -> bool:
        return all(replica.healthy() for replica in self.replicas)

    def crash(self) -> float:
        """SIGKILLs the leader; returns time.monotonic() when a standby holds the Lease, after which the killed
        replica is started again (it stands by)."""
        killed = self.wait_for_leader()
        killed.kill()
        self.wait_for_leader()  # the killed one is not running: another replica
        at = time.monotonic()
        killed.start()
        return at

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def __enter__(self) -> OperatorReplicas:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
