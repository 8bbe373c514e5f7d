"""`lorajob status | logs | plot NAME`: watch one LoRAJob from a terminal (also as `kubectl lorajob ...`).

Everything comes through the API server, as `kubectl` would get it: the LoRAJob, its train JobSet, the
lead trainer pod's log (whose progress lines give the loss history) and the operator's events. Building
the text is pure (`format_status`), so it is tested on plain objects as well as against a real API server.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from datetime import datetime, UTC
from pathlib import Path
from collections.abc import Iterator

from lorajob_operator import api, names, rules
from lorajob_operator.cli_errors import CliError
from lorajob_operator.reconcile.conditions import parse_time
from lorajob_operator.reconcile.decide import RUNNING_PHASE, TRACKING_DEGRADED
from lorajob_operator.reconcile.observed import lead_pod_selector
from lorajob_operator.reconcile.status_text import progress_summary
from lorajob_operator.validation import parse_spec
from lorajob_trainer.contract.records import ProgressRecord, duration

SPARK = "▁▂▃▄▅▆▇█"
BAR_WIDTH = 30
EVENTS_SHOWN = 8
EVENT_WIDTH = 160
LOG_TAIL_LINES = 20_000
"""How much of the trainer's log `status` and `plot` read for the loss history (one progress line per step)."""


class RunViewError(CliError):
    """The LoRAJob, its train step or its trainer log cannot be found; the message says which."""


@dataclass(frozen=True)
class LossPoint:
    step: int
    loss: float | None
    eval_loss: float | None = None
    reward_accuracy: float | None = None
    """A preference method's share of the step's pairs ranked right (None for sft)."""
    eval_preference_accuracy: float | None = None
    """A preference method's share of the eval split's pairs the adapter ranks right, at the step it was measured."""


@dataclass(frozen=True)
class RunView:
    lorajob: dict
    history: list[LossPoint] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)


def loss_history(log: str) -> list[LossPoint]:
    """One point per step from the trainer's progress lines (the last line of a step wins), in step order;
    each eval loss (and a preference method's eval preference accuracy) at the step it was measured at."""
    losses: dict[int, float | None] = {}
    accuracies: dict[int, float | None] = {}
    evals: dict[int, float] = {}
    eval_accuracies: dict[int, float] = {}
    for line in log.splitlines():
        record = ProgressRecord.from_line(line)
        if record is None:
            continue
        losses[record.step] = record.loss
        accuracies[record.step] = record.reward_accuracy
        measured = record.step if record.eval_step is None else record.eval_step
        if record.eval_loss is not None:
            evals[measured] = record.eval_loss
        if record.eval_preference_accuracy is not None:
            eval_accuracies[measured] = record.eval_preference_accuracy
    steps = sorted(losses.keys() | evals.keys() | eval_accuracies.keys())
    return [LossPoint(step, losses.get(step), evals.get(step), accuracies.get(step), eval_accuracies.get(step))
            for step in steps]


def sparkline(values: list[float], width: int = 60) -> str:
    """The values as block characters, averaged into at most `width` buckets."""
    if not values:
        return ""
    count = min(width, len(values))
    buckets = [values[i * len(values) // count:(i + 1) * len(values) // count] for i in range(count)]
    means = [sum(b) / len(b) for b in buckets]
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in means)


def progress_bar(step: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = width * min(step, total) // total
    return "[" + "█" * filled + "░" * (width - filled) + "]"


def _step_marks(obj: dict) -> list[str]:
    """Each step of the chain with its state: done (✓), running (▶), failed (✗) or not reached (·)."""
    status = obj.get("status") or {}
    spec, _ = parse_spec(obj)
    steps = rules.phases(spec) if spec is not None else list(rules.PHASES)
    phase = status.get("phase")
    current = next((step for step, running in RUNNING_PHASE.items() if running.value == phase), None)
    failed = next((c for c in status.get("conditions") or [] if c.get("type") == "Failed" and c.get("status") == "True"), None)
    if failed is not None:  # a step's failure is reported as <Step>Failed (TrainFailed, ...)
        current = next((step for step in steps if failed.get("reason") == f"{step.capitalize()}Failed"), None)
    restarts = status.get("restarts") or {}
    marks = []
    for index, step in enumerate(steps):
        if phase == api.Phase.Succeeded.value or (current in steps and index < steps.index(current)):
            mark = "✓"
        elif step == current:
            mark = "✗" if failed is not None else "▶"
        else:
            mark = "·"
        retries = f" ({restarts[step]} retries)" if restarts.get(step) else ""
        marks.append(f"{mark} {step}{retries}")
    return marks


ROOFLINE_FLOOR_S = 0.01
"""Below this step time the plan's roofline says nothing: such a step is spent in the fixed costs of a step (dispatch,
the host, collectives' latency) that it leaves out (a tiny test model's roofline is 1.2 billion tokens/s beside a
measured 5,000); from a chip, the smallest real step measured was 2.2x its roofline (docs/tpu-v5e.md)."""


def _bytes(value: int | None) -> str:
    """Bytes in the unit that keeps two decimals meaningful: GB, MB or kB."""
    if value is None:
        return "?"
    scale, unit = next(((scale, unit) for scale, unit in ((1e9, "GB"), (1e6, "MB")) if value >= scale), (1e3, "kB"))
    return f"{value / scale:.2f} {unit}"


def _plan_line(plan: dict) -> str:
    memory = f"{_bytes(plan.get('hbmBytesPerChip'))} of {_bytes(plan.get('capacityBytes'))} HBM per chip"
    step = plan.get("stepSeconds") or 0.0
    if step < ROOFLINE_FLOOR_S:
        return f"plan      {plan.get('target', '?')}: {memory}; roofline under {ROOFLINE_FLOOR_S * 1e3:.0f} ms/step (a step " \
               "this small is its fixed costs, which the roofline leaves out)"
    return (f"plan      {plan.get('target', '?')}: {memory}; roofline {step:.3f} s/step, "
            f"{plan.get('tokensPerSecond', 0):,.0f} tok/s, MFU ceiling {plan.get('mfu', 0):.0%} ({plan.get('bound', '?')}-bound)")


def format_status(view: RunView, now: datetime | None = None, samples: int = 0) -> str:
    """What `lorajob status` prints; `samples`: that many evaluated prompts with both models' answers."""
    now = now or datetime.now(UTC)
    obj = view.lorajob
    metadata, spec, status = obj["metadata"], obj.get("spec") or {}, obj.get("status") or {}
    resolved = status.get("resolved") or {}
    queue = resolved.get("queueName") or (spec.get("scheduling") or {}).get("queueName") or "-"
    lines = [
        f"LoRAJob {metadata.get('namespace', '')}/{metadata['name']}: {status.get('phase') or 'Pending'}",
        f"  model {(spec.get('model') or {}).get('name', '?')}, backend {(spec.get('compute') or {}).get('backend', 'pathways')},"
        f" queue {queue}",
    ]
    if status.get("message"):
        lines.append(f"  {status['message']}")
    lines.append("steps     " + "   ".join(_step_marks(obj)))
    started, finished = parse_time(status.get("startTime")), parse_time(status.get("completionTime"))
    if started:
        lines[-1] += f"   ({duration(((finished or now) - started).total_seconds())})"

    plan = status.get("plan") or {}
    if plan:
        lines.append(_plan_line(plan))
    progress = status.get("progress") or {}
    if progress.get("step") is not None:
        total = progress.get("totalSteps")
        text = progress_summary(progress["step"], total, progress.get("state"))
        bar = progress_bar(progress["step"], total) + " " if total else ""
        extras = [f"loss {progress['loss']:.4f}"] if progress.get("loss") is not None else []
        if progress.get("tokensPerSecond") is not None:
            predicted = plan.get("tokensPerSecond") if (plan.get("stepSeconds") or 0.0) >= ROOFLINE_FLOOR_S else None
            against = f" (plan's roofline {predicted:,.0f})" if predicted is not None else ""
            extras.append(f"{progress['tokensPerSecond']:,.0f} tok/s{against}")
        if progress.get("etaSeconds") is not None and status.get("phase") == api.Phase.Training.value:
            extras.append(f"ETA {duration(progress['etaSeconds'])}")
        lines.append(f"progress  {bar}{text}  " + "  ".join(extras))
        preference = _preference_line(progress)
        if preference:
            lines.append(preference)

    losses = [p for p in view.history if p.loss is not None]
    if losses:
        values = [p.loss for p in losses]
        lines.append(
            f"loss      {sparkline(values)}  step {losses[0].step}..{losses[-1].step}: "
            f"{values[0]:.4f} -> {values[-1]:.4f} (min {min(values):.4f})"
        )
    evaluated = [p for p in view.history if p.eval_loss is not None]
    if evaluated:
        lines.append(f"eval loss {sparkline([p.eval_loss for p in evaluated])}  last {evaluated[-1].eval_loss:.4f} at step {evaluated[-1].step}")
    ranked = [p for p in view.history if p.reward_accuracy is not None]
    if ranked:
        values = [p.reward_accuracy for p in ranked]
        lines.append(f"reward acc {sparkline(values)}  step {ranked[0].step}..{ranked[-1].step}: "
                     f"{values[0]:.1%} -> {values[-1]:.1%} (max {max(values):.1%})")
    ranked = [p for p in view.history if p.eval_preference_accuracy is not None]
    if ranked:
        lines.append(f"eval acc  {sparkline([p.eval_preference_accuracy for p in ranked])}  "
                     f"last {ranked[-1].eval_preference_accuracy:.1%} at step {ranked[-1].step}")

    lines += _evaluation_lines(status.get("evaluation"), samples)

    for checkpoint in status.get("checkpoints") or []:
        losses_text = ", ".join(
            f"{label} {checkpoint[key]:.4f}" for label, key in (("loss", "trainLoss"), ("eval", "evalLoss")) if checkpoint.get(key) is not None
        )
        lines.append(f"checkpoint step {checkpoint.get('step')}: {checkpoint.get('path', '')}" + (f" ({losses_text})" if losses_text else ""))

    outputs = status.get("outputs") or {}
    for label, key in (("base", "baseCheckpointPath"), ("checkpoints", "checkpointPath"), ("adapter", "adapterPath")):
        if outputs.get(key):
            exported = f" (step {outputs['exportedStep']})" if key == "adapterPath" and "exportedStep" in outputs else ""
            lines.append(f"{label + ':':13}{outputs[key]}{exported}")
    lines += _tracking_lines(status)

    conditions = [c for c in status.get("conditions") or [] if c.get("status") == "True"]
    if conditions:
        lines.append("conditions " + ", ".join(f"{c['type']}" + (f" ({c['reason']})" if c.get("reason") else "") for c in conditions))
    if view.events:
        lines.append("events")
        for event in view.events[-EVENTS_SHOWN:]:
            at = parse_time(event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp"))
            age = duration((now - at).total_seconds()) + " ago" if at else ""
            text = f"  {age:>10}  {event.get('type', ''):8} {event.get('reason', ''):16} {event.get('message', '')}"
            lines.append(text if len(text) <= EVENT_WIDTH else text[:EVENT_WIDTH - 1] + "…")
    return "\n".join(lines)


def _tracking_lines(status: dict) -> list[str]:
    """The tracker runs' addresses (status.tracking), and what TrackingDegraded says while it is True."""
    lines = [f"{tracker + ' run:':13}{run['url']}" for tracker, run in (status.get("tracking") or {}).items() if run.get("url")]
    degraded = next((c for c in status.get("conditions") or []
                     if c.get("type") == TRACKING_DEGRADED and c.get("status") == "True"), None)
    if degraded is not None:
        lines.append(f"tracking degraded (training goes on): {degraded.get('message', '')}")
    return lines


def _preference_line(progress: dict) -> str:
    """A preference method's figures at the last reported step (status.progress), or "" for sft."""
    figures = []
    if progress.get("rewardAccuracy") is not None:
        figures.append(f"reward accuracy {progress['rewardAccuracy']:.1%}")
    if progress.get("rewardMargin") is not None:
        figures.append(f"margin {progress['rewardMargin']:.4g}")
    if progress.get("chosenLogps") is not None and progress.get("rejectedLogps") is not None:
        figures.append(f"log-probs chosen {progress['chosenLogps']:.4g}, rejected {progress['rejectedLogps']:.4g}")
    if progress.get("evalPreferenceAccuracy") is not None:
        at = f" at step {progress['evalStep']}" if progress.get("evalStep") is not None else ""
        figures.append(f"eval preference accuracy {progress['evalPreferenceAccuracy']:.1%}{at}")
    return "pairs     " + "  ".join(figures) if figures else ""


def _evaluation_lines(evaluation: dict | None, samples: int) -> list[str]:
    """Base against adapter (status.evaluation), and up to `samples` prompts with both answers side by side."""
    if not evaluation:
        return []
    scorer, count = evaluation.get("scorer", "?"), evaluation.get("examples", 0)

    def figures(name: str) -> str:
        model = evaluation.get(name) or {}
        return (f"{name:8} {model.get('score', 0):7.1%}   stop rate {model.get('stopRate', 0):6.1%}   "
                f"mean length {model.get('meanLength', 0):.1f} tokens")

    lines = [f"evaluation step {evaluation.get('step', '?')}, {scorer} on {count} examples "
             f"({duration(evaluation.get('seconds', 0))}):", "  " + figures("base"), "  " + figures("adapter")]
    kept = evaluation.get("samples") or []
    for number, sample in enumerate(kept[:samples], 1):
        lines.append(f"  sample {number}: {_one_line(sample.get('prompt', ''))}")
        for label in ("reference", "base", "adapter"):
            lines.append(f"    {label:9} {_one_line(sample.get(label, ''))}")
    if samples > len(kept):
        lines.append(f"  ({len(kept)} samples kept in status: spec.evaluation.samples; all answers are in "
                     "<run>/evaluation-samples.jsonl)")
    return lines


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty)"


# --- I/O through the API server ----------------------------------------------------------------------

class Client:
    """The few reads the run view needs, through the kubernetes client (kubeconfig or in-cluster)."""

    def __init__(self, context: str | None = None):
        from kubernetes import client, config

        try:
            config.load_kube_config(context=context)
        except config.ConfigException as no_kubeconfig:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                raise no_kubeconfig from None  # outside a pod, the kubeconfig's problem is the one to fix
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()

    def lorajob(self, namespace: str, name: str) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                raise RunViewError(f"no LoRAJob {name!r} in namespace {namespace!r}") from None
            raise

    def lead_pod(self, namespace: str, obj: dict) -> str:
        """The newest pod of the train step's process 0, whose trainer log carries the progress lines."""
        from kubernetes.client.exceptions import ApiException

        name = (obj.get("status", {}).get("children") or {}).get("train")
        if not name:
            raise RunViewError(f"LoRAJob {obj['metadata']['name']!r} has no train step yet")
        try:
            jobset = self.custom.get_namespaced_custom_object(
                names.JOBSET_GROUP, names.JOBSET_VERSION, namespace, names.JOBSET_PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                raise RunViewError(f"the train JobSet {name!r} does not exist (not started yet, or finished and deleted)") from None
            raise
        selector = lead_pod_selector(jobset)
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items if selector else []
        if not pods:
            raise RunViewError(f"the train JobSet {name!r} has no trainer pod yet")
        return max(pods, key=lambda p: p.metadata.creation_timestamp).metadata.name

    def log(self, namespace: str, pod: str, tail_lines: int | None = LOG_TAIL_LINES) -> str:
        response = self.core.read_namespaced_pod_log(
            pod, namespace, container=names.TRAINER_CONTAINER, tail_lines=tail_lines, _preload_content=False,
        )
        return response.data.decode("utf-8", errors="replace")

    def follow(self, namespace: str, pod: str) -> Iterator[str]:
        response = self.core.read_namespaced_pod_log(
            pod, namespace, container=names.TRAINER_CONTAINER, follow=True, _preload_content=False,
        )
        for chunk in response.stream(decode_content=True):
            yield chunk.decode("utf-8", errors="replace")

    def events(self, namespace: str, name: str) -> list[dict]:
        listing = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.kind={api.KIND},involvedObject.name={name}")
        events = [self.core.api_client.sanitize_for_serialization(e) for e in listing.items]
        return sorted(events, key=lambda e: int(e["metadata"]["resourceVersion"]))

    def view(self, namespace: str, name: str) -> RunView:
        obj = self.lorajob(namespace, name)
        try:
            history = loss_history(self.log(namespace, self.lead_pod(namespace, obj)))
        except RunViewError:
            history = []  # no train step (yet): the rest of the view still helps
        except Exception as error:  # noqa: BLE001 - an unreadable log must not hide the status
            print(f"note: the trainer log could not be read: {error}", file=sys.stderr)
            history = []
        return RunView(obj, history, self.events(namespace, name))


def plot(view: RunView, path: Path) -> Path:
    """Draw the loss (and eval loss) curve of the run to a PNG; for a preference method, its reward accuracy (and eval
    preference accuracy) on a second axis."""
    losses = [p for p in view.history if p.loss is not None]
    if not losses:
        raise RunViewError(f"LoRAJob {view.lorajob['metadata']['name']!r} has no loss to plot yet (no progress lines in the trainer log)")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    axes.plot([p.step for p in losses], [p.loss for p in losses], label="train loss")
    evaluated = [p for p in view.history if p.eval_loss is not None]
    if evaluated:
        axes.plot([p.step for p in evaluated], [p.eval_loss for p in evaluated], "o-", label="eval loss")
    axes.set(xlabel="step", ylabel="loss", title=f"LoRAJob {view.lorajob['metadata']['name']}")
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    ranked = [p for p in view.history if p.reward_accuracy is not None]
    evaluated = [p for p in view.history if p.eval_preference_accuracy is not None]
    if ranked or evaluated:
        accuracy = axes.twinx()
        if ranked:
            accuracy.plot([p.step for p in ranked], [p.reward_accuracy for p in ranked], color="tab:green",
                          alpha=0.8, label="reward accuracy")
        if evaluated:
            accuracy.plot([p.step for p in evaluated], [p.eval_preference_accuracy for p in evaluated], "s-",
                          color="tab:red", label="eval preference accuracy")
        accuracy.set(ylabel="share of pairs ranked right", ylim=(0, 1))
        more_handles, more_labels = accuracy.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    axes.legend(handles, labels)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return path


NEEDS = ("Needs the kubernetes package (pip install \"lorajob[operator]\") and a cluster: the kubeconfig's current "
         "context (KUBECONFIG, --context), or the pod's service account.")


def add_commands(commands) -> None:
    """Register status, logs and plot on the `lorajob` argument parser's subcommands."""
    for command, text, needs in (
        ("status", "show a LoRAJob's phase, steps, progress, loss, checkpoints, outputs, tracker runs and recent events",
         NEEDS),
        ("logs", "print (or follow with -f) the lead trainer's log of a LoRAJob", NEEDS),
        ("plot", "draw a LoRAJob's loss curve (and eval loss; a preference run's reward accuracy) to a PNG",
         NEEDS + " Also needs matplotlib."),
    ):
        sub = commands.add_parser(command, help=text, description=f"{text[0].upper()}{text[1:]}. {needs}")
        sub.add_argument("name", help="name of the LoRAJob")
        sub.add_argument("-n", "--namespace", default=None, help="namespace of the LoRAJob (default: the kubeconfig context's)")
        sub.add_argument("--context", default=None, help="kubeconfig context to use")
        if command == "logs":
            sub.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until the trainer exits")
        if command == "status":
            sub.add_argument("--samples", type=int, default=0, metavar="K",
                             help="also show K evaluated prompts with the base's and the adapter's answers")
        if command == "plot":
            sub.add_argument("-o", "--output", type=Path, default=Path("loss.png"), help="PNG file to write (default: loss.png)")
        sub.set_defaults(run=_run)


def _namespace(args) -> str:
    if args.namespace:
        return args.namespace
    from kubernetes import config

    try:
        _, active = config.list_kube_config_contexts()
        return (active or {}).get("context", {}).get("namespace") or "default"
    except config.ConfigException:
        return "default"


def _run(args) -> int:
    """One of the commands; a failure (RunViewError, the cluster's) is said by the `lorajob` command's handler."""
    cluster = Client(args.context)
    namespace = _namespace(args)
    if args.command == "status":
        print(format_status(cluster.view(namespace, args.name), samples=args.samples))
    elif args.command == "logs":
        pod = cluster.lead_pod(namespace, cluster.lorajob(namespace, args.name))
        if args.follow:
            for chunk in cluster.follow(namespace, pod):
                sys.stdout.write(chunk)
                sys.stdout.flush()
        else:
            sys.stdout.write(cluster.log(namespace, pod, tail_lines=None))
    else:
        print(f"wrote {plot(cluster.view(namespace, args.name), args.output)}")
    return 0
