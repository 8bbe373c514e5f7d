"""A real MLflow tracking server on loopback, for the tracking tests and the demo.

`python -m mlflow server` with a SQLite backend store and the artifacts it serves itself (clients upload them
through the server, as a trainer pod does) under one directory, on a free port. `stop()` and `start()` take it
down and bring it back on the same port with the same store: clients see the server vanish and return.

    with MlflowServer(directory) as server:
        ... tracking.mlflow_tracking_uri=server.url ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

from .process import ManagedProcess, free_loopback_port

STARTUP_TIMEOUT_SECONDS = 120.0
"""A first start creates the SQLite store (its schema migrations take a while on a busy machine)."""
STOP_GRACE_SECONDS = 10.0


class MlflowServer:
    """An MLflow tracking server whose store and artifacts are under `directory`; started at construction."""

    def __init__(self, directory: Path, *, python: str = sys.executable):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.port = free_loopback_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = ManagedProcess("mlflow-server", self.command(), self.directory / "mlflow-server.log")
        self.start()

    def command(self, port: int | None = None) -> list[str]:
        """The server's command line; `port`: the same store served on another port (after this one stopped)."""
        return [
            self.python, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{self.directory / 'mlflow.db'}",
            "--artifacts-destination", str(self.directory / "artifacts"),
            "--host", "127.0.0.1",
            "--port", str(port or self.port),
            "--workers", "1",
        ]

    @property
    def running(self) -> bool:
        return self.process.popen is not None and self.process.popen.poll() is None

    def start(self) -> MlflowServer:
        """Start the server (again, where it was stopped) and wait until it answers /health."""
        if self.running:
            return self
        self.process.start()
        try:
            self.process.wait_until(self.healthy, STARTUP_TIMEOUT_SECONDS, "healthy")
        except BaseException:
            self.stop()
            raise
        return self

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
            return response.status == 200

    def stop(self) -> None:
        """Stop the server and the web server processes it started (its process group), so that the port is free
        for `start()`."""
        if not self.running:
            return
        popen = self.process.popen
        group = os.getpgid(popen.pid)  # its own session (ManagedProcess): the group holds only the server's processes
        os.killpg(group, signal.SIGTERM)
        try:
            popen.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            popen.wait()
        _kill_group_leftovers(group)

    def __enter__(self) -> MlflowServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group_leftovers(group: int) -> None:
    """SIGKILL what is left of the process group (workers that outlive the server's main process)."""
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass
