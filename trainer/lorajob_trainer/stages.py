"""Progress of long steps that have no step counter (downloads, conversions, exports): a line when a stage
starts, one every `every` seconds while it runs, and one with its duration when it ends."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from lorajob_trainer.contract.records import duration

HEARTBEAT_SECONDS = 30.0


@contextlib.contextmanager
def stage(log: logging.Logger, description: str, *, every: float = HEARTBEAT_SECONDS) -> Iterator[None]:
    started = time.monotonic()
    log.info("%s ...", description)
    finished = threading.Event()

    def heartbeat() -> None:
        while not finished.wait(every):
            log.info("%s: %s so far", description, duration(time.monotonic() - started))

    thread = threading.Thread(target=heartbeat, name="stage-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        finished.set()
        thread.join()
    log.info("%s: done in %s", description, duration(time.monotonic() - started))
