"""The trainer's exit codes: the contract between `python -m lorajob_trainer.train` and the operator.

Standard library only, so the operator imports it without JAX. Every code but 0 and 1 comes with
one line on stderr naming the problem (the last line of the log, which Kubernetes keeps as the
container's termination message). The operator fails a LoRAJob at once on a user error and retries
an infrastructure failure on its own budget (`scheduling.infrastructureRetryLimit`); code 1, an
error the trainer did not foresee, is retried within `scheduling.retryLimit`.
"""

from __future__ import annotations

import dataclasses
import enum
import signal


class Kind(str, enum.Enum):
    user = "user error"
    infrastructure = "infrastructure"
    unknown = "unclassified"


@dataclasses.dataclass(frozen=True)
class ExitCode:
    code: int
    name: str
    kind: Kind
    meaning: str


SUCCEEDED = 0
UNEXPECTED = 1
CONFIG = 2
DATA = 3
MODEL = 4
OUTPUT = 5
DIVERGED = 6
CHECKPOINT_WRITE = 7
PREEMPTED = 8
DOES_NOT_FIT = 9
NO_IMPROVEMENT = 10

TABLE = (
    ExitCode(SUCCEEDED, "Succeeded", Kind.unknown, "every requested step ran"),
    ExitCode(UNEXPECTED, "Unexpected", Kind.unknown,
             "an error without a code of its own (a bug, a host or accelerator fault); the traceback is in the log"),
    ExitCode(CONFIG, "InvalidConfig",
             Kind.user, "an unknown or malformed config key or value, or a mesh the devices cannot hold"),
    ExitCode(DATA, "InvalidData", Kind.user,
             "the dataset lacks the columns, is empty, runs out (epoch_policy=fail), holds an example that "
             "cannot be encoded, or the chat template does not render"),
    ExitCode(MODEL, "InvalidModel", Kind.user,
             "the base weights are corrupt or truncated, the adapter's rank or targets do not fit the model, "
             "or a checkpoint belongs to another model"),
    ExitCode(OUTPUT, "OutputNotWritable", Kind.user, "the output directory cannot be written"),
    ExitCode(DIVERGED, "Diverged", Kind.user, "the loss became NaN or infinite (lower the learning rate)"),
    ExitCode(CHECKPOINT_WRITE, "CheckpointWriteFailed", Kind.infrastructure,
             "a checkpoint write failed mid-run (storage unavailable)"),
    ExitCode(PREEMPTED, "Preempted", Kind.infrastructure,
             "stopped by SIGTERM (preemption, node drain, suspend) after saving a checkpoint at the last step"),
    ExitCode(DOES_NOT_FIT, "DoesNotFit", Kind.user,
             "the train step, compiled for the LoRAJob's TPU chips before any is held, needs more HBM per chip "
             "than they have (the message gives the figures and the smallest change that fits)"),
    ExitCode(NO_IMPROVEMENT, "NoImprovement", Kind.user,
             "the export gate (export.requireImprovement, minimumScore, minimumStopRate) refused the adapter: the "
             "message gives the base's and the adapter's scores; the checkpoints stay"),
)
BY_CODE = {entry.code: entry for entry in TABLE}

SIGNAL_BASE = 128
"""A process killed by signal N exits 128 + N in a container (137: SIGKILL, 143: SIGTERM)."""
TERMINATED_BY_SIGTERM = SIGNAL_BASE + signal.SIGTERM
"""143: how a kubelet reports a container stopped by a pod deletion (SIGTERM, then gone)."""


def kind(code: int) -> Kind:
    """What a non-zero exit of the trainer says about its cause."""
    if code > SIGNAL_BASE:
        return Kind.infrastructure
    return BY_CODE[code].kind if code in BY_CODE else Kind.unknown


def markdown_table() -> str:
    """The table the user guide shows (a test keeps the two equal)."""
    lines = ["| code | name | kind | meaning |", "|---|---|---|---|"]
    lines += [f"| {e.code} | {e.name} | {e.kind.value} | {e.meaning} |" for e in TABLE]
    lines.append(f"| > {SIGNAL_BASE} | killed by signal (code - {SIGNAL_BASE}) | infrastructure | "
                 "e.g. 137: SIGKILL after the grace period, or the out-of-memory killer |")
    return "\n".join(lines)
