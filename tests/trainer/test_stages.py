"""Long steps without a step counter say what they do, keep saying it while it runs, and how long it took."""

from __future__ import annotations

import logging
import threading

import pytest

from lorajob_trainer import stages
from lorajob_trainer.contract.records import duration


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record):
        with self.changed:
            self.messages.append(record.getMessage())
            self.changed.notify_all()


@pytest.fixture
def lines():
    handler, log = Lines(), logging.getLogger("lorajob_trainer.test_stages")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield log, handler
    log.removeHandler(handler)


def test_a_stage_says_when_it_starts_while_it_runs_and_how_long_it_took(lines):
    log, handler = lines
    with stages.stage(log, "converting qwen3-8b", every=0.01):
        with handler.changed:  # stay in the stage until a heartbeat arrives
            assert handler.changed.wait_for(lambda: len(handler.messages) >= 2, timeout=30)
    assert handler.messages[0] == "converting qwen3-8b ..."
    assert handler.messages[1] == "converting qwen3-8b: 0s so far"
    assert handler.messages[-1] == "converting qwen3-8b: done in 0s"


def test_a_failed_stage_does_not_claim_it_is_done(lines):
    log, handler = lines
    with pytest.raises(ValueError), stages.stage(log, "exporting", every=60):
        raise ValueError("no checkpoint")
    assert handler.messages == ["exporting ..."]


@pytest.mark.parametrize("seconds, text", [(0.4, "0s"), (59, "59s"), (61, "1m01s"), (3725, "1h02m05s")])
def test_duration(seconds, text):
    assert duration(seconds) == text
