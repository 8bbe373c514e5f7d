"""Experiment tracking: a run's config, metrics, evaluation and files reported to MLflow and Weights & Biases.

Only the lead process tracks; its MetricsWriter holds the `Trackers` and hands them every metric it writes. Each
tracker has its own thread fed by a bounded queue (`TrackerQueue`): the step's thread only enqueues, so a tracker
that is down or slow never stalls or fails training. The thread first opens the tracker's run (created, or resumed
from the id kept in <run>/tracking.json), then sends what was queued, in order, retrying a failed call with bounded
backoff. `problem()` says which tracker fails, since when and how much waits; a full queue drops its oldest records,
counted there too. At the end the queues get a deadline to drain, after which what is left is given up with a
warning.

Nothing is sent twice after a resume: the last step a run holds is what its tracker says (MLflow: the latest step of
the run's metrics; W&B online: the step a resumed run continues from) or the high-water mark kept in the record
(W&B offline starts a new local run each time, with the same id), whichever is higher, and metrics at or below it
are dropped.

The export entry point appends the exported adapter to the same runs (`Trackers.for_export`, `log_adapter`).
"""

from __future__ import annotations

import abc
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lorajob_trainer import storage
from lorajob_trainer.contract.config import TrackingConfig, TrainConfig, all_keys
from lorajob_trainer.contract.records import (
    FINISHED_STATES, EvalRecord, RunLayout, TrackedRun, TrackingRecord,
)

log = logging.getLogger("lorajob_trainer.tracking")

QUEUE_BOUND = 10_000
"""Records one tracker's queue holds while its tracker is down (a record: one MetricsWriter.write); beyond it the
oldest are dropped."""
RECORDS_PER_CALL = 50
"""Metric records sent in one call when several wait (MLflow: one log_batch)."""
SEND_INTERVAL_SECONDS = 1.0
"""The least time from one call of metrics to the next: the records that come meanwhile go in one call. A call a
step would keep the tracker's thread busy in Python, and the trainer's thread waits for the GIL meanwhile."""
RETRY_FIRST_SECONDS = 0.5
RETRY_MAX_SECONDS = 15.0
"""Backoff between attempts of a failed call: doubling from the first to the most."""
FLUSH_DEADLINE_SECONDS = 60.0
"""How long the end of a run waits for the queues to drain before it gives up what is left."""
PREEMPTED_FLUSH_DEADLINE_SECONDS = 10.0
"""The same for a run stopped by SIGTERM, which has the rest of its pod's grace period (after its checkpoint) to
exit with the code saying it was preempted before SIGKILL."""
RECORD_PERIOD_SECONDS = 30.0
"""How often a tracker's high-water mark (TrackedRun.logged_step) is kept in the record while the run goes; it is
kept at the end too. Where the tracker cannot tell its last step itself (W&B offline), a run killed outright may
send again what it sent since."""
MLFLOW_CLIENT_ENVIRONMENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
"""MLflow's own HTTP retries off and its timeout short: the queue retries, and a call that hangs holds only the
tracker's thread, which must see a dead server soon to report it."""
MLFLOW_PARAM_CHARACTERS = 6000
MLFLOW_TAG_CHARACTERS = 5000
"""MLflow's longest param and tag values (tags: 8000 since MLflow 2.x, 5000 before)."""
MLFLOW_BATCH = {"metrics": 1000, "params": 100, "tags": 100}
"""MLflow's most metrics, params and tags in one log_batch."""
OUTCOMES = ("finished", "failed", "killed")
"""How a run ended, for its trackers (`outcome_of`)."""


@dataclass(frozen=True)
class MetricRecord:
    """The numbers of one MetricsWriter.write, at the time they were measured."""

    step: int
    values: dict[str, float]
    time: float


@dataclass(frozen=True)
class Action:
    """Any other call, kept in order with the metrics: `apply(backend)`; `what` names it in logs."""

    what: str
    apply: Callable[[Backend], None]


@dataclass(frozen=True)
class Opened:
    """A tracker's run once open: its id and address, and the last step whose metrics it already holds (0: none)."""

    run: TrackedRun
    logged_step: int


class Backend(abc.ABC):
    """One tracker's calls, made on its queue's thread only. `params` None: append to a kept run only (the export
    step): nothing created, no params, its status left as it is."""

    name: str

    def __init__(self, settings: TrackingConfig, run_name: str, params: dict[str, Any] | None):
        self.settings = settings
        self.run_name = run_name
        self.params = params

    @abc.abstractmethod
    def open(self, kept: TrackedRun | None) -> Opened:
        """Create the run, or resume `kept`; may be called again after it failed part way."""

    @abc.abstractmethod
    def log_metrics(self, records: list[MetricRecord]) -> None: ...

    @abc.abstractmethod
    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[str]]) -> None: ...

    @abc.abstractmethod
    def log_files(self, files: list[Path]) -> None:
        """The run's files at its end (loss plot, plan, evaluation)."""

    @abc.abstractmethod
    def log_adapter(self, files: list[Path], lineage: dict[str, str]) -> None:
        """The exported adapter's files, with what it was trained from."""

    @abc.abstractmethod
    def finish(self, outcome: str | None) -> None:
        """End the run as `outcome` (OUTCOMES); None: leave its status (the export step)."""

    @abc.abstractmethod
    def rejects(self, error: Exception) -> bool:
        """Whether `error` refuses the call for good (a bad value), so that retrying it is pointless."""


class MlflowBackend(Backend):
    """MLflow through its client (mlflow-skinny suffices): the experiment by name, one run per LoRAJob run."""

    name = "mlflow"

    def __init__(self, settings: TrackingConfig, run_name: str, params: dict[str, Any] | None):
        super().__init__(settings, run_name, params)
        self.client = None
        self.run_id: str | None = None
        self.resumed = False

    def open(self, kept: TrackedRun | None) -> Opened:
        if self.client is None:
            for variable, value in MLFLOW_CLIENT_ENVIRONMENT.items():
                os.environ.setdefault(variable, value)
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.settings.mlflow_tracking_uri)
        if self.run_id is None:
            self.resumed = kept is not None and self._exists(kept.run_id)
            self.run_id = kept.run_id if self.resumed else self._create_run(kept)
        run = self.client.get_run(self.run_id)
        if self.params is not None:
            if self.resumed:
                self.client.update_run(self.run_id, status="RUNNING")
            self._log_missing_params(set(run.data.params))
        # A run's latest value of each metric is the one of its highest step.
        logged = max((metric.step for metric in run.data.to_proto().metrics), default=0) if self.resumed else 0
        return Opened(TrackedRun(self.run_id, self._url(run.info.experiment_id)), logged)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def _create_run(self, kept: TrackedRun | None) -> str:
        if self.params is None:
            raise LookupError(f"no MLflow run to append to (kept: {kept.run_id if kept else 'none'})")
        if kept is not None:
            log.warning("mlflow: the kept run %s is gone from %s; starting a new run", kept.run_id,
                        self.settings.mlflow_tracking_uri)
        settings = self.settings
        tags = {**settings.mlflow_tags, **job_tags(settings)}
        return self.client.create_run(self._experiment_id(), tags=tags, run_name=self.run_name).info.run_id

    def _experiment_id(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.settings.mlflow_experiment or self.settings.job_namespace or "lorajob"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException as error:  # another run created it meanwhile
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def _log_missing_params(self, logged: set[str]) -> None:
        """Params are immutable: a resumed run logs only those its run lacks (a changed value stays as first logged)."""
        from mlflow.entities import Param

        missing = [Param(key, _text(value, MLFLOW_PARAM_CHARACTERS)) for key, value in self.params.items()
                   if key not in logged]
        for chunk in _chunks(missing, MLFLOW_BATCH["params"]):
            self.client.log_batch(self.run_id, params=chunk)

    def _url(self, experiment_id: str) -> str:
        uri = self.settings.mlflow_tracking_uri.rstrip("/")
        if not uri.startswith(("http://", "https://")):
            return ""
        return f"{uri}/#/experiments/{experiment_id}/runs/{self.run_id}"

    def log_metrics(self, records: list[MetricRecord]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(key, value, int(record.time * 1000), record.step)
                   for record in records for key, value in record.values.items()]
        # Sent again after a failure, the same metrics (same time and step) are kept once.
        for chunk in _chunks(metrics, MLFLOW_BATCH["metrics"]):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[str]]) -> None:
        """A table artifact, which MLflow's UI shows (log_table needs pandas, which the trainer has for datasets)."""
        table = {column: [row[i] for row in rows] for i, column in enumerate(columns)}
        self.client.log_table(self.run_id, data=table, artifact_file=f"{name}.json")

    def log_files(self, files: list[Path]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path))

    def log_adapter(self, files: list[Path], lineage: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        for path in files:
            self.client.log_artifact(self.run_id, str(path), artifact_path="adapter")
        tags = [RunTag(f"lorajob.adapter.{key}", _text(value, MLFLOW_TAG_CHARACTERS)) for key, value in lineage.items()]
        for chunk in _chunks(tags, MLFLOW_BATCH["tags"]):
            self.client.log_batch(self.run_id, tags=chunk)

    def finish(self, outcome: str | None) -> None:
        if outcome is not None:
            self.client.set_terminated(self.run_id, status=outcome.upper())

    def rejects(self, error: Exception) -> bool:
        from mlflow.exceptions import MlflowException

        if isinstance(error, (ImportError, LookupError)):
            return True
        if not isinstance(error, MlflowException):
            return False
        status = error.get_http_status_code()  # a refused request, except those a later attempt may pass
        return 400 <= status < 500 and status not in (401, 403, 408, 429)


class WandbBackend(Backend):
    """Weights & Biases through `wandb.init` (online, or offline into files for `wandb sync`). An offline run's
    address is its directory of files, which `wandb sync` takes."""

    name = "wandb"

    def __init__(self, settings: TrackingConfig, run_name: str, params: dict[str, Any] | None, directory: Path):
        super().__init__(settings, run_name, params)
        self.directory = directory
        self.run = None

    def open(self, kept: TrackedRun | None) -> Opened:
        import wandb

        if kept is None and self.params is None:
            raise LookupError("no W&B run to append to")
        if self.run is None:
            settings = self.settings
            self.directory.mkdir(parents=True, exist_ok=True)
            self.run = wandb.init(
                project=settings.wandb_project, entity=settings.wandb_entity or None, mode=settings.wandb_mode,
                id=kept.run_id if kept else None, resume="allow", dir=str(self.directory), name=self.run_name,
                tags=list(settings.wandb_tags), reinit="create_new",
                # Stdout stays the process's own: the operator reads progress lines from it.
                settings=wandb.Settings(console="off"),
            )
            if self.params is not None:
                self.run.config.setdefaults(self.params)
        return Opened(TrackedRun(self.run.id, self._url()), logged_step=max(self.run.starting_step - 1, 0))

    def _url(self) -> str:
        return self.run.url if self.settings.wandb_mode == "online" else str(Path(self.run.dir).parent)

    def log_metrics(self, records: list[MetricRecord]) -> None:
        for record in records:
            self.run.log(record.values, step=record.step)

    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[str]]) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def log_files(self, files: list[Path]) -> None:
        for path in files:
            # Copied into the run's directory: one saved from elsewhere is only linked there, and ours go away.
            copy = shutil.copy(path, Path(self.run.dir) / path.name)
            self.run.save(copy, base_path=self.run.dir, policy="now")

    def log_adapter(self, files: list[Path], lineage: dict[str, str]) -> None:
        import wandb

        artifact = wandb.Artifact(f"adapter-{self.run.id}", type="model", metadata=lineage)
        for path in files:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self, outcome: str | None) -> None:
        self.run.finish(exit_code=0 if outcome in (None, "finished") else 1)

    def rejects(self, error: Exception) -> bool:
        return isinstance(error, (ImportError, LookupError, ValueError, TypeError))


class TrackerQueue:
    """One tracker's calls on its own thread, in the order they were put. The thread opens the run, then sends
    what waits; a failed call is retried (the records it carries stay first) until it goes through, the error
    refuses it for good (dropped, with a warning) or the queue is given up."""

    def __init__(self, backend: Backend, kept: TrackedRun | None, keep: Callable[[str, TrackedRun], None], *,
                 bound: int = QUEUE_BOUND, retry_max_seconds: float = RETRY_MAX_SECONDS):
        """`kept`: the run to resume; `keep(name, run)` keeps the run (id, address, high-water mark) in the record."""
        self.backend = backend
        self._kept = kept
        self._keep = keep
        self._bound = bound
        self._retry_max_seconds = retry_max_seconds
        self._items: deque[MetricRecord | Action] = deque()
        self._in_flight = 0
        self._dropped = 0
        self._failing_since: float | None = None
        self._failure: tuple[str, str] = ("", "")
        """How the last attempt failed: unreachable or failing, and why."""
        self._gave_up = ""
        self._run: TrackedRun | None = None
        self._closing = False
        self._abandoned = threading.Event()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._work, name=f"tracking-{backend.name}", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self.backend.name

    def put(self, item: MetricRecord | Action) -> None:
        with self._changed:
            if self._gave_up:
                return
            if self._items and len(self._items) + self._in_flight >= self._bound:
                self._items.popleft()
                self._dropped += 1
            self._items.append(item)
            self._changed.notify_all()

    def url(self) -> str:
        """The run's address; "" until it is open."""
        return self._run.url if self._run is not None else ""

    def waiting(self) -> int:
        with self._changed:
            return len(self._items) + self._in_flight

    def problem(self) -> str:
        """"" while the tracker takes what it is sent; else what is wrong, since when, and what waits."""
        with self._changed:
            waiting = len(self._items) + self._in_flight
            if self._gave_up:
                return f"{self.name}: gave up ({self._gave_up})"
            dropped = f", {self._dropped} oldest dropped (queue full at {self._bound})" if self._dropped else ""
            if self._failing_since is not None:
                since = time.strftime("%H:%M:%S", time.localtime(self._failing_since))
                kind, reason = self._failure
                return f"{self.name}: {kind} since {since} ({reason}), {waiting} records waiting{dropped}"
            if self._dropped:
                return f"{self.name}: too slow, {waiting} records waiting{dropped}"
            return ""

    def close(self, deadline: float) -> bool:
        """Let the thread send what waits until `deadline` (time.monotonic()); True when everything went, else
        what is left is given up."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if not self._thread.is_alive():
            return not self._gave_up
        left, problem = self.waiting(), self.problem()
        self._abandoned.set()
        log.warning("%s: gave up with %d records unsent at the end of the run (%s)", self.name, left, problem)
        return False

    def _work(self) -> None:
        opened = self._attempt("opening the run", lambda: self.backend.open(self._kept))
        if opened is None:
            self._give_up_everything()
            return
        logged_step = max(opened.logged_step, self._kept.logged_step if self._kept else 0)
        self._run = replace(opened.run, logged_step=logged_step)
        self._keep(self.name, self._run)
        kept_at = time.monotonic()
        while (batch := self._take()) is not None:
            started = time.monotonic()
            self._attempt(_describe_batch(batch), lambda: self._send(batch, logged_step))
            self._sent(batch)
            if isinstance(batch[0], MetricRecord):
                self._linger(started + SEND_INTERVAL_SECONDS)
            if time.monotonic() - kept_at >= RECORD_PERIOD_SECONDS:
                self._keep(self.name, self._run)
                kept_at = time.monotonic()
        self._keep(self.name, self._run)

    def _take(self) -> list[MetricRecord | Action] | None:
        """The next call's items: an action, or consecutive metric records; None once closed and drained."""
        with self._changed:
            while not self._items and not self._closing:
                self._changed.wait()
            if not self._items or self._abandoned.is_set():
                return None
            batch = [self._items.popleft()]
            while (isinstance(batch[0], MetricRecord) and self._items and isinstance(self._items[0], MetricRecord)
                   and len(batch) < RECORDS_PER_CALL):
                batch.append(self._items.popleft())
            self._in_flight = len(batch)
            return batch

    def _send(self, batch: list[MetricRecord | Action], logged_step: int) -> None:
        """Send `batch`, less the metrics at or below `logged_step` (the run held them before this process)."""
        if isinstance(batch[0], Action):
            batch[0].apply(self.backend)
            return
        fresh = [record for record in batch if record.step > logged_step]
        if fresh:
            self.backend.log_metrics(fresh)
            self._run = replace(self._run, logged_step=max(self._run.logged_step, fresh[-1].step))

    def _linger(self, until: float) -> None:
        """Let records gather until `until` (time.monotonic()), or until the queue is closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._closing, timeout=max(until - time.monotonic(), 0.0))

    def _sent(self, batch: list) -> None:
        with self._changed:
            self._in_flight = 0
            if self._dropped and not self._items:
                log.warning("%s: caught up; %d records were dropped while its queue was full", self.name, self._dropped)
                self._dropped = 0
            self._changed.notify_all()

    def _attempt(self, what: str, call: Callable[[], Any]) -> Any:
        """`call()`'s result, retried with backoff while it fails; None once it is refused for good or given up."""
        delay = RETRY_FIRST_SECONDS
        while not self._abandoned.is_set():
            try:
                result = call()
            except Exception as error:  # noqa: BLE001 - a tracker's errors are its own: none may reach training
                if self.backend.rejects(error):
                    log.warning("%s: %s refused, dropped: %s", self.name, what, _reason(error))
                    self._recovered()
                    if self._run is None:
                        self._gave_up = f"{what} refused: {_reason(error)}"
                    return None
                self._failed(what, error)
                self._abandoned.wait(delay)
                delay = min(2 * delay, self._retry_max_seconds)
                continue
            self._recovered()
            return result
        return None

    def _failed(self, what: str, error: Exception) -> None:
        with self._changed:
            if self._failing_since is None:
                self._failing_since = time.time()
                log.warning("%s: %s failed, retrying in the background: %s", self.name, what, _reason(error))
            self._failure = ("unreachable" if _unreachable(error) else "failing", _reason(error))

    def _recovered(self) -> None:
        with self._changed:
            if self._failing_since is not None:
                log.info("%s: reachable again after %.0f s", self.name, time.time() - self._failing_since)
            self._failing_since = None

    def _give_up_everything(self) -> None:
        with self._changed:
            self._gave_up = self._gave_up or "given up before its run opened"
            self._items.clear()
            self._changed.notify_all()


def _describe_batch(batch: list[MetricRecord | Action]) -> str:
    if isinstance(batch[0], Action):
        return batch[0].what
    first, last = batch[0].step, batch[-1].step
    return f"metrics of step {first}" if first == last else f"metrics of steps {first}-{last}"


def _reason(error: BaseException) -> str:
    """The innermost cause of `error` in a few words ("Connection refused"), else its first line."""
    innermost = error
    while innermost.__cause__ is not None or innermost.__context__ is not None:
        innermost = innermost.__cause__ or innermost.__context__
    if isinstance(innermost, OSError) and innermost.strerror:
        return innermost.strerror
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 200 else text[:199] + "…"


def _unreachable(error: BaseException) -> bool:
    """The error is the connection's (refused, reset, timed out, no such host), not the tracker's answer."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError):  # requests' and urllib3's connection errors too
            return True
        cause = cause.__cause__ or cause.__context__
    return False


class Trackers:
    """The trackers of one process, each behind its own queue; the record of their runs kept at `record_location`."""

    def __init__(self, record_location: str, kept: TrackingRecord,
                 backends: list[tuple[Backend, TrackedRun | None]], **queue_options: Any):
        self.record_location = record_location
        self._record = kept
        self._record_lock = threading.Lock()
        self._scratch = Path(tempfile.mkdtemp(prefix="lorajob-tracking-"))
        self.queues = [TrackerQueue(backend, run, self._keep, **queue_options) for backend, run in backends]

    @classmethod
    def for_training(cls, config: TrainConfig, params: dict[str, Any], lineage: dict[str, str],
                     **queue_options: Any) -> Trackers | None:
        """The trackers `config.tracking` names (None: none), their runs created or resumed from the record."""
        settings = config.tracking
        if not settings.trackers:
            return None
        location = config.layout.tracking
        kept = TrackingRecord(read_record(location).runs, lineage)
        run_name = settings.mlflow_run_name or settings.job_name or config.run_name
        backends = []
        if "mlflow" in settings.trackers:
            backends.append((MlflowBackend(settings, run_name, params), kept.runs.get("mlflow")))
        if "wandb" in settings.trackers:
            directory = Path(settings.wandb_dir or _local_or_temporary(config.layout.run_directory))
            backends.append((WandbBackend(settings, settings.job_name or config.run_name, params, directory),
                             kept.runs.get("wandb")))
        return cls(location, kept, backends, **queue_options)

    @classmethod
    def for_export(cls, settings: TrackingConfig, record_location: str, **queue_options: Any) -> Trackers | None:
        """The trackers `settings` names whose runs the training recorded at `record_location` (None: none)."""
        kept = read_record(record_location)
        names = [name for name in settings.trackers if name in kept.runs]
        for name in set(settings.trackers) - set(names):
            log.warning("%s: no run recorded in %s; the adapter is not logged to it", name, record_location)
        if not names:
            return None
        backends = []
        if "mlflow" in names:
            backends.append((MlflowBackend(settings, "", None), kept.runs["mlflow"]))
        if "wandb" in names:
            directory = Path(settings.wandb_dir or tempfile.mkdtemp(prefix="lorajob-wandb-"))
            backends.append((WandbBackend(settings, "", None, directory), kept.runs["wandb"]))
        return cls(record_location, kept, backends, **queue_options)

    @property
    def lineage(self) -> dict[str, str]:
        return dict(self._record.lineage)

    def log_metrics(self, step: int, values: dict[str, float], at: float) -> None:
        """`values` (finite numbers) at `step`, measured at `at` (Unix time), to every tracker."""
        if values:
            self._put(MetricRecord(step, values, at))

    def log_evaluation(self, record: EvalRecord) -> None:
        """The evaluation of base and adapter: each model's scores as metrics at its step, its samples as a table."""
        self.log_metrics(record.step, evaluation_metrics(record), time.time())
        columns = ["prompt", "reference", "base", "adapter"]
        rows = [[sample.prompt, sample.reference, sample.base, sample.adapter] for sample in record.samples]
        self._put(Action("the evaluation's samples",
                         lambda backend: backend.log_table("generation_samples", record.step, columns, rows)))

    def log_adapter(self, directory: Path, lineage: dict[str, str]) -> None:
        """The exported adapter's files under `directory`, copied: the trackers send them after it may be gone."""
        (self._scratch / "adapter").mkdir()
        files = [Path(shutil.copy(directory / name, self._scratch / "adapter" / name)) for name in storage.ADAPTER_FILES]
        self._put(Action("the exported adapter", lambda backend: backend.log_adapter(files, lineage)))

    def urls(self) -> dict[str, str]:
        return {queue.name: queue.url() for queue in self.queues}

    def problem(self) -> str:
        """"" while every tracker takes what it is sent, else each failing one's problem."""
        return "; ".join(problem for queue in self.queues if (problem := queue.problem()))

    def finish_training(self, state: str | None, layout: RunLayout) -> None:
        """The run's files, then its end as its last progress `state` says (None: it never reported one); close."""
        files = run_files(layout, self._scratch)
        if files:
            self._put(Action("the run's files", lambda backend: backend.log_files(files)))
        outcome = outcome_of(state)
        self.close(outcome, PREEMPTED_FLUSH_DEADLINE_SECONDS if outcome == "killed" else FLUSH_DEADLINE_SECONDS)

    def close(self, outcome: str | None = None, deadline_seconds: float = FLUSH_DEADLINE_SECONDS) -> bool:
        """End the runs as `outcome` (None: leave their status) once what waits is sent, or give it up at the
        deadline; True when everything went."""
        self._put(Action("ending the run", lambda backend: backend.finish(outcome)))
        deadline = time.monotonic() + deadline_seconds
        sent = all([queue.close(deadline) for queue in self.queues])
        shutil.rmtree(self._scratch, ignore_errors=True)
        return sent

    def _put(self, item: MetricRecord | Action) -> None:
        for queue in self.queues:
            queue.put(item)

    def _keep(self, name: str, run: TrackedRun) -> None:
        """Keep `name`'s run in the record (a resumed process, and the export step, append to it)."""
        with self._record_lock:
            self._record = TrackingRecord({**self._record.runs, name: run}, self._record.lineage)
            try:
                storage.write_text(self.record_location, self._record.to_json())
            except OSError as error:
                log.warning("cannot write %s: %s; a resumed run will start new tracker runs", self.record_location,
                            error)


def read_record(location: str) -> TrackingRecord:
    """The tracker runs kept at `location`; none when it is missing or unreadable."""
    try:
        text = storage.read_text(location)
        return TrackingRecord({}) if text is None else TrackingRecord.from_json(text)
    except (OSError, ValueError, TypeError) as error:
        log.warning("cannot read the tracker runs in %s (%s); starting new ones", location, error)
        return TrackingRecord({})


def outcome_of(state: str | None) -> str:
    """The tracker runs' end (OUTCOMES) for the run's last progress state."""
    if state in FINISHED_STATES:
        return "finished"
    return "killed" if state == "preempted" else "failed"


def evaluation_metrics(record: EvalRecord) -> dict[str, float]:
    """generation/<model>_<figure> of both models: score, stop rate, mean answer length (and preference accuracy)."""
    metrics = {}
    for model, score in (("base", record.base), ("adapter", record.adapter)):
        figures = {"score": score.score, "stop_rate": score.stop_rate, "mean_length": score.mean_length,
                   "preference_accuracy": score.preference_accuracy}
        metrics.update({f"generation/{model}_{name}": value for name, value in figures.items() if value is not None})
    return metrics


def run_files(layout: RunLayout, scratch: Path) -> list[Path]:
    """Local copies of the run's files for its trackers: the loss plot, plan.json and evaluation.json where they
    exist."""
    from lorajob_trainer import metrics as metrics_lib

    files = []
    try:
        files.append(metrics_lib.plot_loss_curve(Path(layout.metrics), scratch / "loss.png"))
    except (OSError, ValueError) as error:  # no metrics yet, or no loss among them
        log.info("no loss plot for the trackers: %s", error)
    for location in (layout.plan, layout.evaluation):
        text = storage.read_text(location)
        if text is not None:
            copy = scratch / Path(str(location)).name
            copy.write_text(text)
            files.append(copy)
    return files


def run_params(config: TrainConfig, mesh_shape: Mapping[str, int], remat_policy: str,
               dataset: dict[str, str]) -> dict[str, Any]:
    """What the run trains with: every config key (defaults included, dotted), the mesh it runs on, the remat
    policy it uses and its dataset (`dataset_lineage`)."""
    return {
        **{key: functools.reduce(getattr, key.split("."), config) for key in all_keys()},
        **{f"resolved.mesh.{axis}": size for axis, size in mesh_shape.items()},
        "resolved.remat_policy": remat_policy,
        **dataset,
    }


def dataset_lineage(config: TrainConfig, dataset: Any) -> dict[str, str]:
    """The training data: its name (hub dataset or files), split, and the fingerprint Hugging Face datasets
    computes for it (a hash of the data files' origin — local files' paths and modification times, a hub
    dataset's revision — and of the column selection), with the model trained."""
    name = ",".join(config.hf_train_files) if config.hf_train_files else config.hf_path
    return {
        "base_model": config.model_name,
        "base_checkpoint": config.load_parameters_path,
        "dataset.name": name,
        "dataset.config": config.hf_name,
        "dataset.split": "train" if config.hf_train_files else config.train_split,
        "dataset.examples": str(len(dataset)),
        "dataset.fingerprint": getattr(dataset, "_fingerprint", ""),
    }


def job_tags(settings: TrackingConfig) -> dict[str, str]:
    """The LoRAJob the run belongs to."""
    return {f"lorajob.{name}": value for name, value in (
        ("job", settings.job_name), ("namespace", settings.job_namespace), ("uid", settings.job_uid)) if value}


def _text(value: Any, longest: int) -> str:
    """`value` as text (JSON unless it is text), cut to `longest` characters."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= longest else text[: longest - 1] + "…"


def _chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def _local_or_temporary(run_directory: str) -> str:
    """The run directory where it is local (W&B writes its files under <it>/wandb), else a temporary directory."""
    return tempfile.mkdtemp(prefix="lorajob-wandb-") if storage.is_remote(run_directory) else run_directory
