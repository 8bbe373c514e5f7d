"""The console of the trainer's entry points: their log lines, and for a person at a terminal a progress bar
with step, loss, tokens/s and ETA, the log lines printed above it. The bar is not drawn where the console is
not a terminal (a pod's log, a pipe, CI)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import TextIO

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


HARMLESS_ORBAX_WARNINGS = (
    "Skipping merge of OCDBT checkpoints",  # every save without OCDBT (the Pathways-safe default)
    "was found in the checkpoint, but could not be restored",  # reading one item's metadata of a step
)
"""Orbax warnings our own calls cause on purpose; they would bury the lines a person needs."""


def _not_harmless(record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in HARMLESS_ORBAX_WARNINGS)


def configure_logging() -> None:
    """INFO lines of this package on stderr, for every entry point (JAX/absl install their own root handler,
    so no basicConfig); Orbax's harmless warnings left out."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package_logger = logging.getLogger("lorajob_trainer")
    package_logger.handlers = [handler]
    package_logger.setLevel(logging.INFO)
    package_logger.propagate = False
    logging.getLogger("absl").addFilter(_not_harmless)


class ConsoleProgress:
    """A tqdm bar on `stream` while the loop runs, when `stream` is a terminal and `enabled`."""

    def __init__(self, total_steps: int, first_step: int, *, enabled: bool, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.shown = enabled and self.stream.isatty()
        self.total_steps, self.first_step = total_steps, first_step
        self._bar: tqdm | None = None
        self._scope = contextlib.ExitStack()

    def __enter__(self) -> ConsoleProgress:
        if self.shown:
            self._bar = tqdm(total=self.total_steps, initial=self.first_step, file=self.stream, unit="step",
                             desc="train", dynamic_ncols=True, smoothing=0.1)
            # Log lines go through tqdm.write, so they print above the bar instead of through it.
            self._scope.enter_context(logging_redirect_tqdm([logging.getLogger("lorajob_trainer")]))
        return self

    def update(self, step: int, *, loss: float, tokens_per_second: float) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_second:,.0f} tok/s", refresh=False)
        self._bar.update(step - self._bar.n)

    def __exit__(self, *exc_info) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._scope.close()
