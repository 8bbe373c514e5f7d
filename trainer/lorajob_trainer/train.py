"""LoRA fine-tuning entry point: `python -m lorajob_trainer.train [config.yaml] key=value...`.

The training loop (`Trainer.train`) over the run's step (run.py: built once from the config and the loaded
model), one jitted call per optimizer step: evaluation, checkpoints, progress and metrics, early stopping, preemption. The run resumes from the
latest complete checkpoint in `<base_output_directory>/<run_name>/checkpoints`, including the data position.

Exit status: the codes of `lorajob_trainer.contract.exit_codes` (0 when all steps ran), each non-zero one
with a line on stderr naming what failed and at which step. On SIGTERM the run finishes the step
it is in, saves a checkpoint at that step and exits `exit_codes.PREEMPTED`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax

from lorajob_trainer import checkpoint as ckpt
from lorajob_trainer import data as data_lib
from lorajob_trainer import distributed, preemption
from lorajob_trainer.contract import exit_codes
from lorajob_trainer import evaluate as evaluate_lib
from lorajob_trainer import lora as lora_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import metrics as metrics_lib
from lorajob_trainer import feed as feed_lib
from lorajob_trainer import loading, models, storage, tracking, weights
from lorajob_trainer import run as run_lib
from lorajob_trainer import plan as plan_lib
from lorajob_trainer.contract.config import TrainConfig, describe_keys, parse_or_report
from lorajob_trainer.console import ConsoleProgress, configure_logging
from lorajob_trainer.contract.records import (
    COMPILING, EVALUATING, PREFERENCE_PROGRESS, REMAT_AUTO, REMAT_POLICIES, STOPPED_EARLY, CheckpointRecord,
    last_plan,
)
from lorajob_trainer.contract.fit import SAFETY_MARGIN
from lorajob_trainer.optim import build_optimizer, learning_rate_per_step
from lorajob_trainer import step as step_lib
from lorajob_trainer.step import Batch

log = logging.getLogger("lorajob_trainer.train")


class TrainingFailed(RuntimeError):
    """The run cannot complete its requested steps; the message names what and the step."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass
class RunResult:
    final_step: int
    final_loss: float | None
    resumed_from: int | None
    eval_loss: float | None = None
    stopped_early: bool = False
    """The eval loss stopped improving (early_stopping_patience) before the last step."""


@dataclass
class Plateau:
    """Early stopping: the eval loss has not improved on the best by `min_delta` for `patience` evaluations."""

    patience: int
    min_delta: float
    best: float | None = None
    without_improvement: int = 0

    def update(self, eval_loss: float | None) -> bool:
        """Record an evaluation; True when training should stop."""
        if eval_loss is None:
            return False
        if self.best is None or eval_loss < self.best - self.min_delta:
            self.best, self.without_improvement = eval_loss, 0
        else:
            self.without_improvement += 1
        return 0 < self.patience <= self.without_improvement

    def describe(self) -> str:
        return (f"eval loss did not improve on {self.best:.4f} by more than {self.min_delta:g} "
                f"in {self.without_improvement} evaluations")


class Trainer:
    """The loop of one run over its step (`run.Run`); `train()` trains to `config.steps`."""

    def __init__(self, config: TrainConfig, run: run_lib.Run):
        self.config = config
        self.run = run
        self.mesh = run.mesh
        self.lora = run.adapters()
        """The adapters as trained so far (the step donates and replaces them)."""
        self.opt_state = run.optimizer_state(self.lora)
        self.base_adapters = run.adapters() if config.generation_eval.enabled else None
        """The adapters as they start: the base model, for evaluate.py."""
        self.reference: tuple[dict[str, jax.Array], ...] = ()
        """DPO's reference adapters, the last argument of its steps: the adapters as training starts (the restored
        adapter with lora.lora_restore_path, else as initialised), also after a resume."""
        if run.steps.takes_reference:
            restore_path = config.lora.lora_restore_path
            self.reference = (self._adapter_from(restore_path) if restore_path else run.adapters(),)
        self.learning_rates = learning_rate_per_step(config)
        self.tokenizer = data_lib.load_tokenizer(
            str(loading.local_config_directory(config.tokenizer_directory)), config.chat_template_path
        )
        train_split = feed_lib.load_split(config, data_lib.train_source(config), self.tokenizer)
        self.train_feed = feed_lib.data_feed(
            config, self.mesh, train_split, config.gradient_accumulation_steps, config.epoch_policy
        )
        self.eval_data = (
            feed_lib.load_split(config, data_lib.eval_source(config), self.tokenizer) if config.eval_interval else None
        )
        self.is_lead = jax.process_index() == 0
        self.peak_flops = metrics_lib.peak_flops_per_device(jax.devices()[0].device_kind, config.peak_tflops_per_device)
        self.checkpointer = ckpt.for_run(config)
        # Last of what can fail here: the trackers' runs start with it, and only `close` ends them.
        self.writer = metrics_lib.MetricsWriter(
            config.layout, config.steps, enabled=self.is_lead, tensorboard=config.enable_tensorboard,
            progress_lines=config.progress_lines, trackers=self._trackers(train_split[0]) if self.is_lead else None,
        )
        self.stop = preemption.StopSignal()
        self.current_step = 0
        self.last_tokens_per_second = 0.0
        self.last_loss: float | None = None
        self.last_eval: tuple[int | None, float | None] = (None, None)
        self.expert_rows_dropped: int | None = None
        """Rows the expert-parallel steps dropped since the start (ProgressRecord.expert_rows_dropped)."""
        self.preference_progress: dict[str, float] = {}
        """A preference method's latest figures (contract.records.PREFERENCE_PROGRESS), for the progress record."""
        self.kept_checkpoints: tuple[CheckpointRecord, ...] = ()
        """The complete checkpoints the run keeps, reported in every progress record."""
        self.plateau = Plateau(config.early_stopping_patience, config.early_stopping_min_delta)

    def _trackers(self, train_dataset: Any) -> tracking.Trackers | None:
        """The experiment trackers the config names (None: none), told what this run trains with."""
        lineage = tracking.dataset_lineage(self.config, train_dataset)
        params = tracking.run_params(self.config, dict(self.mesh.shape), self.run.remat_policy, lineage)
        return tracking.Trackers.for_training(self.config, params, lineage)

    def metadata(self, step: int) -> ckpt.CheckpointMetadata:
        c = self.config
        return ckpt.CheckpointMetadata(
            step=step,
            lora_rank=c.lora.lora_rank,
            lora_alpha=c.lora.lora_alpha,
            use_rslora=c.lora.use_rslora,
            use_dora=c.lora.use_dora,
            base_quantization=c.lora.base_quantization,
            target_modules=self.run.model.target_modules,
            lora_module_path=c.lora.lora_module_path,
            base_model=c.model_name,
            family=c.family,
            load_parameters_path=c.load_parameters_path,
            tokenizer_path=c.tokenizer_path,
        )

    # Start point.
    def restore_or_start(self) -> int:
        """Resume from the latest complete checkpoint, else start (from lora_restore_path if set)."""
        latest = self.checkpointer.latest_step() if self.checkpointer else None
        if latest is not None:
            self.checkpointer.check_matches(latest, self.metadata(latest))
            self.lora, self.opt_state, positions = self.checkpointer.restore(
                latest, self.lora, self.opt_state, self.train_feed.positions()
            )
            self.train_feed.restore(positions)
            self.kept_checkpoints = tuple(self.checkpointer.complete())
            log.info("resumed from checkpoint step %d in %s", latest, self.checkpointer.directory)
            return latest
        if self.config.lora.lora_restore_path:
            self.lora = self._adapter_from(self.config.lora.lora_restore_path)
        return 0

    def _adapter_from(self, path: str) -> dict[str, jax.Array]:
        """LoRA weights of an earlier adapter checkpoint, placed like the current ones."""
        params, metadata = lora_lib.load_adapter_checkpoint(path)
        for option in ("use_rslora", "use_dora"):
            if getattr(metadata, option) != getattr(self.config.lora, option):
                raise lora_lib.LoraError(
                    f"lora.lora_restore_path {path}: adapter has {option}={getattr(metadata, option)}, this run has "
                    f"lora.{option}={getattr(self.config.lora, option)}; the same weights would mean another update"
                )
        if metadata.lora_rank != self.config.lora.lora_rank or set(params) != set(self.lora):
            raise lora_lib.LoraError(
                f"lora.lora_restore_path {path}: adapter has rank {metadata.lora_rank} and "
                f"{len(params)} tensors, this run has lora.lora_rank={self.config.lora.lora_rank} and {len(self.lora)}"
            )
        log.info("starting from adapter %s (step %d of %s)", path, metadata.step, metadata.base_model)
        return {
            name: jax.make_array_from_callback(
                current.shape, current.sharding,
                lambda index, host=params[name], dtype=current.dtype: host[index].astype(dtype)
            )
            for name, current in self.lora.items()
        }

    # Loop.
    def train(self) -> RunResult:
        start = self.current_step = self.restore_or_start()
        total = self.config.steps
        result = RunResult(final_step=start, final_loss=None, resumed_from=start or None)
        if start >= total:
            log.info("nothing to do: checkpoint step %d >= steps=%d", start, total)
            loss = next((c.train_loss for c in self.kept_checkpoints if c.step == start), None)
            if self.config.generation_eval.enabled:
                self._evaluate_generations(start, loss)
            self.report_progress(start, loss=loss, tokens_per_second=0.0, eta_seconds=0.0, state="succeeded")
            return result
        self.report_progress(start, loss=None, tokens_per_second=0.0, eta_seconds=float("nan"), state=COMPILING,
                             message="compiling the train step; its first step follows")
        timer = metrics_lib.StepTimer()
        pending: tuple[int, dict[str, jax.Array]] | None = None
        # The operator's pods print progress lines for the operator instead.
        self.console = ConsoleProgress(total, start, enabled=self.is_lead and not self.config.progress_lines)
        with jax.set_mesh(self.mesh), self.stop, self.console:
            for step in range(start + 1, total + 1):
                try:
                    batch = self._next_batch(step)
                except TrainingFailed:
                    if pending is not None:
                        self._report(*pending, timer)
                    raise
                self.lora, self.opt_state, step_metrics = self.run.steps.train(
                    self.lora, self.opt_state, self.run.base, batch, *self.reference)
                if pending is not None:
                    result.final_loss = self._report(*pending, timer)
                pending = (step, step_metrics)
                if self._checkpoint_due(step) or self._eval_due(step):
                    result.final_loss = self._report(*pending, timer)
                    pending = None
                    if self._eval_due(step):
                        result.eval_loss = self._evaluate(step)
                        result.stopped_early = self.plateau.update(result.eval_loss) and step < total
                    if self._checkpoint_due(step) or result.stopped_early:
                        self._save(step, result.final_loss)
                    timer.reset()
                result.final_step = self.current_step = step
                if result.stopped_early:
                    log.info("stopping early at step %d: %s", step, self.plateau.describe())
                    break
                if step < total and self.stop.due(step):
                    if pending is not None:
                        result.final_loss = self._report(*pending, timer)
                    self._stop_preempted(step)
            if pending is not None:
                result.final_loss = self._report(*pending, timer)
        if self.checkpointer:
            self._finish_checkpoints()
        if self.config.generation_eval.enabled:
            self._evaluate_generations(result.final_step, result.final_loss)
        if result.stopped_early:
            self.report_progress(result.final_step, loss=result.final_loss, tokens_per_second=self.last_tokens_per_second,
                                 eta_seconds=0.0, state=STOPPED_EARLY, message=self.plateau.describe())
        else:
            self.report_progress(total, loss=result.final_loss, tokens_per_second=self.last_tokens_per_second,
                                 eta_seconds=0.0, state="succeeded")
        return result

    def _next_batch(self, step: int) -> Batch:
        try:
            return self.train_feed.next_batch(step)
        except data_lib.DataExhausted as error:
            raise TrainingFailed(str(error), exit_codes.DATA) from None
        except data_lib.DataError as error:
            raise TrainingFailed(f"data error at step {step}: {error}", exit_codes.DATA) from None

    def _checkpoint_due(self, step: int) -> bool:
        return self.checkpointer is not None and (step % self.config.checkpoint_period == 0 or step == self.config.steps)

    def _eval_due(self, step: int) -> bool:
        interval = self.config.eval_interval
        return interval > 0 and (step % interval == 0 or step == self.config.steps)

    def _save(self, step: int, train_loss: float | None) -> None:
        eval_step, eval_loss = self.last_eval
        metadata = replace(self.metadata(step), train_loss=train_loss, time=time.time(),
                                       eval_loss=eval_loss if eval_step == step else None)
        try:
            self.checkpointer.save(step, self.lora, self.opt_state, self.train_feed.positions(), metadata)
        except ckpt.CheckpointError as error:
            raise TrainingFailed(str(error), exit_codes.CHECKPOINT_WRITE) from None
        self.kept_checkpoints = tuple(self.checkpointer.complete())

    def _finish_checkpoints(self) -> None:
        try:
            self.checkpointer.wait()
        except ckpt.CheckpointError as error:
            raise TrainingFailed(str(error), exit_codes.CHECKPOINT_WRITE) from None
        self.kept_checkpoints = tuple(self.checkpointer.complete())

    def report_progress(self, step: int, **values) -> None:
        eval_step, eval_loss = self.last_eval
        self.writer.progress(step, eval_loss=eval_loss, eval_step=eval_step, checkpoints=self.kept_checkpoints,
                             expert_rows_dropped=self.expert_rows_dropped, **self.preference_progress, **values)

    def _stop_preempted(self, step: int) -> None:
        """SIGTERM: a complete checkpoint at `step`, the last step run, before exiting."""
        if self.checkpointer is None:
            raise TrainingFailed(f"stopped by SIGTERM after step {step}; checkpointing is off, nothing saved",
                                 exit_codes.PREEMPTED)
        if not self._checkpoint_due(step):
            self._save(step, self.last_loss)
        self._finish_checkpoints()
        raise TrainingFailed(f"stopped by SIGTERM after step {step}; checkpoint saved at step {step}",
                             exit_codes.PREEMPTED)

    def _report(self, step: int, step_metrics: dict[str, jax.Array], timer: metrics_lib.StepTimer) -> float:
        values = {name: float(value) for name, value in jax.device_get(step_metrics).items()}
        if not math.isfinite(values["loss"]):
            raise TrainingFailed(f"loss is {values['loss']} at step {step}", exit_codes.DIVERGED)
        step_time = timer.lap()
        if "expert_rows_dropped" in values:
            self.expert_rows_dropped = (self.expert_rows_dropped or 0) + int(values["expert_rows_dropped"])
        self.preference_progress.update({name: values[name] for name in PREFERENCE_PROGRESS if name in values})
        tokens_per_second = self.last_tokens_per_second = values["real_tokens"] / step_time
        eta = timer.eta_seconds(self.config.steps - step)
        if step % self.config.log_period == 0 or step == self.config.steps:
            record = {
                **values,
                "learning_rate": float(self.learning_rates[step - 1]),
                "step_time_s": step_time,
                "tokens_per_second": tokens_per_second,
                "mfu": metrics_lib.mfu(tokens_per_second, self.run.flops, jax.device_count(), self.peak_flops),
                "peak_host_memory_bytes": metrics_lib.peak_host_memory_bytes(),
                "peak_device_memory_bytes": metrics_lib.peak_device_memory_bytes(jax.local_devices()),
            }
            self.writer.write(step, record)
            aux = f" aux_loss {values['aux_loss']:.4f}" if "aux_loss" in values else ""
            if "reward_accuracy" in values:
                aux += f" reward accuracy {values['reward_accuracy']:.3f} margin {values['reward_margin']:.4f}"
            log.info("step %d/%d loss %.4f%s  %.0f tok/s  %.3f s/step", step, self.config.steps, values["loss"], aux,
                     tokens_per_second, step_time)
            if values.get("expert_rows_dropped"):
                log.warning("step %d: the experts' all-to-alls dropped %d (token, expert) rows past their capacity "
                            "(expert_capacity_factor %s)", step, values["expert_rows_dropped"],
                            self.config.expert_capacity_factor)
        self.last_loss = values["loss"]
        self.report_progress(step, loss=values["loss"], tokens_per_second=tokens_per_second, eta_seconds=eta,
                       state="running")
        self.console.update(step, loss=values["loss"], tokens_per_second=tokens_per_second)
        return values["loss"]

    def _eval_sums(self, adapters: dict[str, jax.Array], step: int) -> dict[str, float]:
        """The eval step's sums with `adapters` over `eval_steps` batches of the evaluation split (padded at its end)."""
        feed = feed_lib.data_feed(self.config, self.mesh, self.eval_loaded(), accumulation=1, on_end="pad")
        sums: dict[str, float] = {}
        for _ in range(self.config.eval_steps):
            totals = jax.device_get(self.run.steps.evaluate(adapters, self.run.base, feed.next_batch(step),
                                                            *self.reference))
            for name, value in totals.items():
                sums[name] = sums.get(name, 0.0) + float(value)
        return sums

    def _evaluate(self, step: int) -> float | None:
        result = step_lib.evaluation_result(run_lib.objective_of(self.config), self._eval_sums(self.lora, step))
        if result is None:
            log.warning("evaluation at step %d saw nothing to evaluate (no trained tokens or pairs)", step)
            return None
        self.writer.write(step, result)
        self.last_eval = (step, result["eval_loss"])
        if "eval_preference_accuracy" in result:
            self.preference_progress["eval_preference_accuracy"] = result["eval_preference_accuracy"]
        log.info("step %d eval loss %.4f%s", step, result["eval_loss"],
                 f" preference accuracy {result['eval_preference_accuracy']:.3f}"
                 if "eval_preference_accuracy" in result else "")
        return result["eval_loss"]

    def _evaluate_generations(self, step: int, loss: float | None) -> None:
        self.report_progress(step, loss=loss, tokens_per_second=0.0, eta_seconds=0.0, state=EVALUATING,
                             message="generating answers with the base model and with the adapter")
        dataset, _ = self.eval_loaded()
        settings, columns = self.config.generation_eval, self.config.train_data_columns
        rows = [dataset[i] for i in range(min(settings.examples, len(dataset)))]
        adapters = {"base": self.base_adapters, "adapter": self.lora}
        with jax.set_mesh(self.mesh):
            accuracy = None
            if self.config.preference_method:  # the chosen answer is the reference
                examples = [prompt + chosen for prompt, chosen, _ in (data_lib.to_preference_messages(row, columns)
                                                                      for row in rows)]
                accuracy = {name: self._chosen_likelier(values, step) for name, values in adapters.items()}
            else:
                examples = [data_lib.to_messages(row, columns) for row in rows]
            record = evaluate_lib.evaluate(self.run, self.tokenizer, settings, examples, adapters, step,
                                           self.config.layout if self.is_lead else None, preference_accuracy=accuracy)
        self.writer.evaluation(record)

    def _chosen_likelier(self, adapters: dict[str, jax.Array], step: int) -> float:
        """The share of the evaluation split's pairs (eval_steps batches) whose chosen answer the model with
        `adapters` finds likelier than the rejected (ModelScore.preference_accuracy)."""
        sums = self._eval_sums(adapters, step)
        return sums["likelier"] / max(sums["pairs"], 1.0)

    def eval_loaded(self) -> tuple[Any, Callable[[int], data_lib.EncodedExample]]:
        """The evaluation split (loaded once)."""
        if self.eval_data is None:
            self.eval_data = feed_lib.load_split(self.config, data_lib.eval_source(self.config), self.tokenizer)
        return self.eval_data

    def close(self) -> None:
        try:
            self.train_feed.close()
            if self.checkpointer:
                self.checkpointer.close()
        finally:
            self.writer.close()  # ends the trackers' runs whatever happened before


def remat_for_run(config: TrainConfig, hf_config: dict[str, Any], devices: list[jax.Device]) -> str:
    """The remat policy the train step runs: the config's, or under auto the first of `REMAT_POLICIES` that fits:
    as the fit check chose it before the chips were held (the run's plan.json, written by lorajob_trainer.fit from
    this same config), else as the compiler judges it for `devices` against the memory they report, less the plan's
    safety margin (`plan.choose_remat`); "minimal" where the devices report no memory limit (a CPU: host memory
    is no compiler's to judge)."""
    if config.remat_policy != REMAT_AUTO:
        return config.remat_policy
    recorded = last_plan(storage.read_text(config.layout.plan) or "")
    if recorded is not None and recorded.fits and recorded.remat_policy in REMAT_POLICIES:
        log.info("remat auto: %s, as the fit check chose (%s)", recorded.remat_policy, config.layout.plan)
        return recorded.remat_policy
    limit = metrics_lib.device_memory_limit_bytes([device for device in devices
                                                  if device.process_index == jax.process_index()])
    if limit is None:
        log.info("remat auto: minimal (the devices report no memory limit)")
        return "minimal"
    capacity = int(limit * (1 - SAFETY_MARGIN))
    choice = plan_lib.choose_remat(config, hf_config, devices, capacity)
    log.info("remat auto: %s, compiled for these devices (%s of %.2f GB)%s", choice.policy,
             "fits" if choice.fits else "none fits", capacity / 1e9,
             "".join(f"; {rejected}" for rejected in choice.rejected))
    return choice.policy


SETUP_ERRORS = {
    data_lib.DataError: exit_codes.DATA,
    mesh_lib.MeshError: exit_codes.CONFIG,
    lora_lib.LoraError: exit_codes.MODEL,
    weights.WeightsError: exit_codes.MODEL,
    models.ModelConfigError: exit_codes.MODEL,
    ckpt.CheckpointError: exit_codes.MODEL,
    ckpt.OutputNotWritable: exit_codes.OUTPUT,
}
"""Bad inputs found while setting up, by exit code: reported without a traceback (most specific type first)."""


def build_trainer(
    config: TrainConfig, load_model: Callable[..., run_lib.LoraModel] = run_lib.loaded_model
) -> Trainer:
    """The trainer of `config`: its checkpoint loaded onto the configured mesh (`load_model`), the run built."""
    config = run_lib.resolve_expert_axis(
        config, lambda: loading.checkpoint_hf_config(config.load_parameters_path, config.tokenizer_directory),
        jax.devices(),
    )
    mesh = mesh_lib.build_mesh(config.mesh)
    ckpt.ensure_writable(config.run_directory)
    dtype = run_lib.compute_dtype(config)
    with jax.set_mesh(mesh):
        model = load_model(config, mesh, dtype)
    policy = remat_for_run(config, model.hf_config, list(mesh.devices.flat))
    return Trainer(config, run_lib.build(config.step_shape, build_optimizer(config), model, mesh, dtype, policy,
                                         objective=run_lib.objective_of(config)))


def train(config: TrainConfig) -> RunResult:
    trainer = build_trainer(config)
    try:
        return trainer.train()
    except TrainingFailed as error:
        state = "preempted" if error.code == exit_codes.PREEMPTED else "failed"
        trainer.report_progress(trainer.current_step, loss=float("nan"), tokens_per_second=0.0,
                          eta_seconds=float("nan"), state=state, message=str(error))
        raise
    finally:
        trainer.close()


USAGE = """usage: python -m lorajob_trainer.train [CONFIG.yaml] KEY=VALUE...

Keys come from the YAML file, then the KEY=VALUE overrides (nested keys with dots: lora.lora_rank=8;
lists in YAML flow style: train_data_columns=['question','answer']).
"""


def configure_compilation_cache(config: TrainConfig) -> None:
    """Point JAX's persistent compilation cache at `config.compilation_cache_dir`, except on several CPU devices.

    XLA:CPU orders an executable's collectives through one shared resource, and the copy it loads from the cache has
    a separate resource per collective: the devices may then enter two collectives in different orders and wait for
    each other for ever (jaxlib 0.10.2; tests/trainer/test_multiprocess.py deadlocks with a warm cache). Compiling
    keeps the order, so CPU runs with more than one device compile every time."""
    if jax.default_backend() == "cpu" and jax.device_count() > 1:
        jax.config.update("jax_enable_compilation_cache", False)
        log.info("persistent compilation cache off: XLA:CPU loses the order of collectives it loads from the cache")
    elif config.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", config.compilation_cache_dir)


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(arguments):
        print(USAGE + "\n" + describe_keys(), end="")
        return 0
    configure_logging()
    config = parse_or_report(arguments)
    if config is None:
        return exit_codes.CONFIG
    try:
        distributed.initialize()
    except distributed.DistributedConfigError as error:
        print(f"distributed config error: {error}", file=sys.stderr)
        return exit_codes.CONFIG
    configure_compilation_cache(config)
    started = time.time()
    try:
        result = train(config)
    except TrainingFailed as error:
        print(f"training {'stopped' if error.code == exit_codes.PREEMPTED else 'failed'}: {error}", file=sys.stderr)
        return error.code
    except tuple(SETUP_ERRORS) as error:
        print(f"training failed before step 1: {type(error).__name__}: {error}", file=sys.stderr)
        return next(code for kind, code in reversed(SETUP_ERRORS.items()) if isinstance(error, kind))
    log.info("done: step %d, loss %.4f, %.1f s", result.final_step, result.final_loss, time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
