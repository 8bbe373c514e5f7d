"""Run the operator as a child process against a kubeconfig (e2e tests, the demo, the benchmark)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_SECONDS = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OperatorProcess:
    """`python -m lorajob_operator` watching `namespaces`, with LORAJOB_* `settings` in its environment."""

    def __init__(
        self, kubeconfig: Path, namespaces: list[str], log_path: Path, settings: dict[str, str] | None = None,
        verbose: bool = False,
    ):
        self.kubeconfig = kubeconfig
        self.namespaces = namespaces
        self.log_path = log_path
        self.settings = settings or {}
        self.verbose = verbose
        self.liveness_url = f"http://127.0.0.1:{_free_port()}/healthz"
        metrics_port = int(self.settings.get("LORAJOB_METRICS_PORT", "0"))
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None
        """The Prometheus endpoint, when `settings` give LORAJOB_METRICS_PORT (off by default: a fixed port
        would clash between test sessions sharing a machine)."""
        self._process: subprocess.Popen | None = None

    def start(self) -> "OperatorProcess":
        environment = {key: value for key, value in os.environ.items() if not key.startswith("LORAJOB_")}
        environment |= {"KUBECONFIG": str(self.kubeconfig), "LORAJOB_METRICS_PORT": "0", **self.settings}
        command = [sys.executable, "-m", "lorajob_operator", "--liveness", self.liveness_url]
        for namespace in self.namespaces:
            command += ["--namespace", namespace]
        if self.verbose:
            command.append("--verbose")
        log = self.log_path.open("ab")
        self._process = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_healthy()
        return self

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.liveness_url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"the operator exited with {self._process.returncode}; log: {self.log_path}\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the operator was not healthy within {STARTUP_TIMEOUT_SECONDS:.0f} s; log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

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

    def __enter__(self) -> "OperatorProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
