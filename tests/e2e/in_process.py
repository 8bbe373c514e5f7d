"""The operator's kopf handlers run in the test's own process (kopf on a thread with its own event loop), so
that a test can reach its `Controller`: `with kopf_operator(...) as controller`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import kopf
from kubernetes.config import kube_config

import lorajob_operator.handlers  # noqa: F401  (registers the handlers)

SYNC_TIMEOUT_SECONDS = 60


@contextlib.contextmanager
def kopf_operator(monkeypatch, kubeconfig: Path, namespaces: list[str], settings: dict[str, str]):
    """Yields the Controller once its caches are synced; `settings`: LORAJOB_* environment variables."""
    # The kubernetes client reads KUBECONFIG once, at import; kopf's login and the operator's client use it.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    memo = kopf.Memo(namespaces=namespaces)
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(standalone=True, namespaces=namespaces, memo=memo, stop_flag=stop))
        except BaseException as error:  # noqa: BLE001 - reported by the waiting test
            failure.append(error)

    thread = threading.Thread(target=run, name="kopf-in-process", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SYNC_TIMEOUT_SECONDS
        while not _running(memo) and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not failure and thread.is_alive(), f"kopf stopped: {failure}"
        assert _running(memo), f"the caches did not sync within {SYNC_TIMEOUT_SECONDS} s"
        yield memo.controller
    finally:
        stop.set()
        thread.join(timeout=30)


def _running(memo: kopf.Memo) -> bool:
    return "controller" in memo and memo.controller.running.is_set()
