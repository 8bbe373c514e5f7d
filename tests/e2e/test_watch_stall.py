"""A watch that goes silent without closing (a dead connection: nothing arrives, not even its end) is
detected by its timeout and replaced, so the cache catches up within client_timeout_seconds of the stall.
Runs the operator's kopf watches against the real API server through a TCP relay that can black-hole the
connections open at a given moment (new ones pass)."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import yaml
from in_process import kopf_operator

from lorajob_operator import caches

pytestmark = pytest.mark.apiserver
STALL_BOUND_SECONDS = 3
"""client_timeout_seconds of the test's watches: the bound within which a stalled watch is replaced."""


class BlackHoleRelay:
    """Relays TCP connections to `upstream`; `black_hole()` silently drops everything on the connections
    open at that moment, in both directions, their closing included."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._open: list[threading.Event] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def black_hole(self) -> None:
        with self._lock:
            for dead in self._open:
                dead.set()

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            dead = threading.Event()
            with self._lock:
                self._open.append(dead)
            for source, sink in ((downstream, upstream), (upstream, downstream)):
                threading.Thread(target=self._pump, args=(source, sink, dead), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, dead: threading.Event) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if dead.is_set():
                if not data:
                    return  # dropped like the rest: the other side is never told
                continue
            if not data:
                sink.close()
                return
            try:
                sink.sendall(data)
            except OSError:
                return


def _kubeconfig_through(kube, port: int, path):
    kubeconfig = yaml.safe_load(kube.kubeconfig.read_text())
    for cluster in kubeconfig["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{port}"
    path.write_text(yaml.safe_dump(kubeconfig))
    return path


def test_a_silently_stalled_watch_is_replaced_within_its_timeout(kube, monkeypatch, tmp_path):
    server = urlparse(kube.server)
    relay = BlackHoleRelay((server.hostname, server.port))
    settings = {"LORAJOB_WATCH_SERVER_TIMEOUT_SECONDS": str(STALL_BOUND_SECONDS - 1),
                "LORAJOB_WATCH_CLIENT_TIMEOUT_SECONDS": str(STALL_BOUND_SECONDS),
                "LORAJOB_LEADER_ENABLED": "false", "LORAJOB_METRICS_PORT": "0"}
    try:
        with kopf_operator(monkeypatch, _kubeconfig_through(kube, relay.port, tmp_path / "kubeconfig"),
                           ["default"], settings) as controller:
            store = controller.caches.stores[caches.NAMESPACES]
            _created_and_seen(kube, store, "watched", timeout=10)  # the watch streams
            relay.black_hole()  # the watch now open hears nothing more, and never learns it ended
            _created_and_seen(kube, store, "stalled-watch", timeout=STALL_BOUND_SECONDS + 5)  # + backoff, reconnect
    finally:
        relay.close()
        for name in ("watched", "stalled-watch"):
            kube.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found")


def _created_and_seen(kube, store: caches.Store, namespace: str, timeout: float) -> None:
    kube.kubectl("create", "namespace", namespace)
    deadline = time.monotonic() + timeout
    while store.get(("", namespace)) is None:
        assert time.monotonic() < deadline, f"namespace {namespace} did not reach the cache within {timeout} s"
        time.sleep(0.05)
