"""What the trainer printed, lifted into status: progress lines from the lead trainer's log tail, the data-check,
plan and evaluation lines, the checkpoints and tracker runs its last progress record lists, and when each log is
worth reading."""

from __future__ import annotations

import dataclasses
import math
from datetime import datetime, UTC

from lorajob_operator import api, rules
from lorajob_operator.names import run_name
from lorajob_operator.reconcile.observed import ChildState, Observed
from lorajob_operator.reconcile.status_text import progress_summary
from lorajob_trainer.contract.records import (
    EVALUATING, FINISHED_STATES, CheckpointRecord, ProgressRecord, RunLayout, choose_checkpoint, last_data,
    last_evaluation, last_plan, last_progress,
)


def parse_progress_line(line: str) -> api.Progress | None:
    """The progress of one trainer progress line; None for any other line, or one cut short or garbled."""
    record = ProgressRecord.from_line(line)
    return None if record is None else _status_progress(record)


def progress_from_log(log: str) -> api.Progress | None:
    """The progress of the last readable progress line in a log tail (None when it holds none)."""
    record = last_progress(log)
    return None if record is None else _status_progress(record)


def _four_digits(loss: float | None) -> float | None:
    """A loss (or a preference figure) as `kubectl get lj` prints it: 4 significant digits (metrics.jsonl keeps every
    digit)."""
    return loss if loss is None or not math.isfinite(loss) else float(f"{loss:.4g}")


def _status_progress(record: ProgressRecord) -> api.Progress:
    eta = record.eta_seconds
    return api.Progress(
        step=record.step,
        total_steps=record.total_steps,
        loss=_four_digits(record.loss),
        tokens_per_second=record.tokens_per_second,
        eta_seconds=None if eta is None else max(0, round(eta)),
        eval_loss=_four_digits(record.eval_loss),
        eval_step=record.eval_step,
        reward_accuracy=_four_digits(record.reward_accuracy),
        reward_margin=_four_digits(record.reward_margin),
        chosen_logps=_four_digits(record.chosen_logps),
        rejected_logps=_four_digits(record.rejected_logps),
        eval_preference_accuracy=_four_digits(record.eval_preference_accuracy),
        expert_rows_dropped=record.expert_rows_dropped,
        state=record.state,
        message=record.message[:4096] or None,
        summary=progress_summary(record.step, record.total_steps, record.state),
    )


def final_progress(progress: dict) -> bool:
    """Whether the trainer reported the end of its step (its last step, or an early stop; an evaluation after the
    last step still to come)."""
    if progress.get("state") in FINISHED_STATES:
        return True
    if progress.get("state") == EVALUATING:
        return False
    return bool(progress.get("totalSteps")) and progress.get("step") == progress.get("totalSteps")


def train_log_wanted(status: dict, train: ChildState | None) -> bool:
    """Whether the lead trainer's log may hold news for status.progress: its step runs (admitted), or it
    finished and status.progress does not show the last step yet (the trainer's last line may)."""
    if train is None or not train.owned or train.deleting or train.lead_pod_selector is None:
        return False
    if train.finished:
        return not final_progress(status.get("progress") or {})
    return not train.suspended


def checks_step(children: dict[str, ChildState]) -> ChildState | None:
    """The step that ran the data and fit checks: check, or convert."""
    return next((children[phase] for phase in rules.CPU_FIRST_STEPS if phase in children), None)


def checks_log_wanted(status: dict, step: ChildState | None) -> bool:
    """Whether the checks step's pod log may hold the figures that status.data lacks: the step completed."""
    return (
        step is not None and step.owned and step.completed and not step.deleting
        and step.lead_pod_selector is not None and not status.get("data")
    )


def data_status(o: Observed) -> dict | None:
    """status.data: the data check's line in this pass's checks log, else kept."""
    record = last_data(o.checks_log) if o.checks_log else None
    if record is None:
        return o.status.get("data")
    return api.DataStatus(**dataclasses.asdict(record)).model_dump(by_alias=True, exclude_none=True)


def plan_status(o: Observed) -> dict | None:
    """status.plan: the fit check's line in this pass's checks log (read with the data check's), else kept."""
    record = last_plan(o.checks_log) if o.checks_log else None
    if record is None:
        return o.status.get("plan")
    tokens = None if record.tokens_per_second_per_chip is None else record.tokens_per_second_per_chip * record.chips
    return api.PlanStatus(
        target=record.target, hbm_bytes_per_chip=record.hbm_bytes_per_chip, capacity_bytes=record.capacity_bytes,
        step_seconds=record.step_seconds, tokens_per_second=tokens, mfu=record.mfu, bound=record.bound,
        compile_seconds=record.compile_seconds, remat=record.remat_policy,
    ).model_dump(by_alias=True, exclude_none=True)


def evaluation_status(o: Observed) -> dict | None:
    """status.evaluation: the evaluation line in this pass's train log, else kept."""
    record = last_evaluation(o.train_log) if o.train_log else None
    if record is None:
        return o.status.get("evaluation")
    scores = {name: api.ModelEvaluation(score=s.score, stop_rate=s.stop_rate, mean_length=round(s.mean_length, 1),
                                        preference_accuracy=s.preference_accuracy)
              for name, s in (("base", record.base), ("adapter", record.adapter))}
    return api.EvaluationStatus(
        scorer=record.scorer, examples=record.examples, step=record.step, seconds=record.seconds, **scores,
        samples=[api.EvaluationSample(**dataclasses.asdict(sample)) for sample in record.samples],
    ).model_dump(by_alias=True, exclude_none=True)


def progress_status(o: Observed, record: ProgressRecord | None) -> dict | None:
    """status.progress: lifted from this pass's log tail, else kept (a pod that is gone erases nothing)."""
    if record is None:
        return o.status.get("progress")
    return _status_progress(record).model_dump(by_alias=True, exclude_none=True)


def tracking_status(o: Observed) -> dict | None:
    """status.tracking: the tracker runs' addresses in this pass's last progress record, else kept (a run's address
    stays once known)."""
    urls = o.progress_record.tracking_urls if o.progress_record else None
    if not urls:
        return o.status.get("tracking")
    runs = {tracker: api.TrackedRun(url=url).model_dump(exclude_none=True) for tracker, url in urls.items() if url}
    return {**(o.status.get("tracking") or {}), **runs} or None


def watched(progress: dict | None, advanced_time: str | None) -> dict | None:
    """status.progress with the stall watchdog's advancedTime, which it keeps only while it watches."""
    progress = {key: value for key, value in (progress or {}).items() if key != "advancedTime"}
    if advanced_time:
        progress["advancedTime"] = advanced_time
    return progress or None


def checkpoints_status(o: Observed, record: ProgressRecord | None) -> list[dict]:
    """status.checkpoints: the list in this pass's last progress record, else kept."""
    if record is None or record.checkpoints is None:
        return o.status.get("checkpoints") or []
    layout = RunLayout(o.spec.output.base_output_directory, run_name(o.spec, o.name))
    return [
        api.CheckpointStatus(
            step=c.step, train_loss=c.train_loss, eval_loss=c.eval_loss, path=layout.checkpoint(c.step),
            time=None if c.time is None else datetime.fromtimestamp(c.time, UTC).replace(microsecond=0),
        ).model_dump(mode="json", by_alias=True, exclude_none=True)
        for c in record.checkpoints
    ]


def exported_step(spec: api.LoRAJobSpec, progress: dict | None, checkpoints: list[dict]) -> int | None:
    """The step export.step chooses, once training has finished (the list of checkpoints is final then)."""
    if not spec.export.enabled or not final_progress(progress or {}):
        return None
    records = [CheckpointRecord(c["step"], c.get("trainLoss"), c.get("evalLoss")) for c in checkpoints]
    try:
        return choose_checkpoint(spec.export.checkpoint(spec.training), records).step
    except LookupError:  # the export step fails with the trainer's message
        return None
