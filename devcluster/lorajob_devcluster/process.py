"""Child processes of the dev cluster: started with a log file, stopped by PID (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import dataclasses
import random
import socket
import subprocess
import time
from pathlib import Path
from collections.abc import Callable

STOP_GRACE_SECONDS = 10.0


class ComponentFailed(RuntimeError):
    """A dev-cluster component exited or never became ready; the message carries its log tail."""


LOWEST_PORT = 20000
"""Ports for the cluster's components are drawn from here up to the kernel's ephemeral range."""
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_loopback_port() -> int:
    """A loopback port that nothing listens on, below the kernel's ephemeral range. A free port from that range (what
    binding port 0 gives) can become the local end of any outgoing connection before the component binds it: a
    cluster starting beside another lost its scheduler's port that way ("bind: address already in use")."""
    try:
        ephemeral_from = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = LOWEST_PORT
    candidates = range(LOWEST_PORT, max(ephemeral_from, LOWEST_PORT))
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # no such range here: any free port
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def host_ip() -> str | None:
    """This machine's first non-loopback IPv4 address, if it has one (no packet is sent: a UDP socket only
    picks a route)."""
    for probe_address in ("192.0.2.1", "10.255.255.255", "8.8.8.8"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((probe_address, 9))
            except OSError:
                continue
            address = probe.getsockname()[0]
            if not address.startswith("127."):
                return address
    return None


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclasses.dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        log = open(self.log_path, "ab")
        # A new session keeps Ctrl-C in the foreground CLI from reaching children before we stop them in order.
        self.popen = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        return self

    def check_alive(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            code = None if self.popen is None else self.popen.returncode
            raise ComponentFailed(f"{self.name} exited (code {code}); log {self.log_path}:\n{log_tail(self.log_path)}")

    def wait_until(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll `ready` until true; fail early with the log tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise ComponentFailed(f"{self.name} not {what} after {timeout:.0f} s; log {self.log_path}:\n{log_tail(self.log_path)}")

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash: the component gets no chance to shut down cleanly."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
