"""Whether a train step fits its TPU chips, judged by the TPU compiler without a TPU, and how fast it may go.

    python -m lorajob_trainer.fit --request JSON --model-config DIR [config.yaml] KEY=VALUE...

The request (`Request`, written by the operator) names the chip's facts and the targets to try in order:
the LoRAJob's own first, then the smallest changes that may fit (a smaller per-device batch with the same
global batch through accumulation, remat "full", larger topologies of the machine type). The train step of the config
(`lorajob_trainer.plan`) is compiled for the first target; when it does not fit, for the next ones until
one fits. Per chip: the HBM the compiler assigns against the chip's capacity less `SAFETY_MARGIN`, the
FLOPs of the 4N LoRA cost model, a roofline step time, tokens/s and MFU ceiling, the compile time.

When the LoRAJob's own target fits it prints one `LORAJOB_PLAN` line (`contract.PlanRecord`, lifted into
status.plan) and exits 0; when it does not, it exits DoesNotFit (exit_codes) with one line on stderr giving
the figures and the smallest change that fits.
The operator runs it in the CPU step before any TPU is held; `lorajob plan FILE` runs the same `plan`
on a workstation. Without libtpu (a CPU or GPU image) it says so and exits 0: nothing is judged.
This module imports without JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from typing import Any

from lorajob_trainer import exit_codes
from lorajob_trainer.config import TrainConfig, parse_or_report
from lorajob_trainer.contract import REMAT_AUTO, REMAT_POLICIES, PlanRecord

log = logging.getLogger("lorajob_trainer.fit")  # not __name__: run as __main__

SAFETY_MARGIN = 0.10
"""Share of a chip's HBM a plan leaves free (the runtime's own buffers, fragmentation)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """What a plan needs to know of one accelerator chip (the operator's catalogue: accelerators.TPU_CHIPS and
    GPU_CHIPS)."""

    hbm_bytes: int
    peak_bf16_flops: float
    """Dense (no sparsity)."""
    hbm_bandwidth: float
    """Bytes per second."""
    interconnect_bandwidth: float
    """Bytes per second per chip between chips: ICI on a TPU, NVLink (or PCIe) on a GPU."""

    @property
    def capacity_bytes(self) -> int:
        return int(self.hbm_bytes * (1 - SAFETY_MARGIN))


@dataclasses.dataclass(frozen=True)
class TpuChip(Chip):
    compiler_name: str
    """The generation's name in libtpu topology names (`v6e` in `v6e:2x4`)."""
    devices_per_chip: int = 1
    """JAX devices per chip: 2 on tpu7x, whose two TensorCores each hold half the chip's HBM, FLOP/s and
    bandwidths; the compiler's figures, and so a plan's, are per device."""

    def device(self) -> Chip:
        """One JAX device's share of the chip."""
        n = self.devices_per_chip
        return Chip(self.hbm_bytes // n, self.peak_bf16_flops / n, self.hbm_bandwidth / n,
                    self.interconnect_bandwidth / n)


ACTIVATION_BYTES = {"full": 16, "minimal": 76}
"""Activation bytes a step keeps per token, per unit of model width, per layer, by remat policy: the TPU
compiler's temporaries for llama3.1-8b on v6e (1 row of 1,024 tokens per chip: 2.09 GB over 32 layers with
"full", 0.32 GB per layer with "minimal"), which the analytic plan for GPUs takes as its calibration."""


@dataclasses.dataclass(frozen=True)
class Target:
    machine_type: str
    topology: str
    slices: int
    chips: int
    per_device_batch_size: int
    gradient_accumulation_steps: int
    remat_policy: str

    def describe(self) -> str:
        return f"{self.machine_type} {self.short()}"

    def short(self) -> str:
        """Without the machine type, which the LoRAJob names."""
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return (f"{self.topology}{slices} ({self.chips} chips), per-device batch {self.per_device_batch_size} x "
                f"{self.gradient_accumulation_steps} accumulation, remat {self.remat_policy}")


@dataclasses.dataclass(frozen=True)
class Request:
    chip: TpuChip
    chips_per_host: int
    targets: tuple[Target, ...]
    """The LoRAJob's own target first, then the alternatives in the order they are tried."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Request:
        values = json.loads(text)
        return cls(TpuChip(**values["chip"]), values["chips_per_host"], tuple(Target(**t) for t in values["targets"]))


@dataclasses.dataclass
class Attempt:
    """One compile of the step for one target: its figures, or the compiler's refusal."""

    target: Target
    fits: bool
    capacity_bytes: int
    total_bytes: int | None = None
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    flops_per_step: float | None = None
    """The model's (the 4N LoRA cost model): what MFU counts."""
    executed_flops_per_step: float | None = None
    """What the step runs: the model's, remat's recompute, the masked attention scores."""
    compiler_flops: float | None = None
    attention_block: int | None = None
    """The splash-attention kernel's block (the compiler's count leaves the kernel out); None: dense attention."""
    step_seconds: float | None = None
    tokens_per_second_per_chip: float | None = None
    mfu: float | None = None
    bound: str | None = None
    compile_seconds: float | None = None
    error: str | None = None
    remat_policy: str | None = None
    """The remat policy compiled: the target's, or what its remat auto chose."""
    remat_rejected: tuple[str, ...] = ()
    """Under remat auto: the policies with less recompute tried first, each with why it was not taken."""
    devices_per_chip: int = 1
    """Memory figures and capacity are per JAX device; tokens/s per chip counts all of a chip's devices."""
    analytic: bool = False
    """Estimated by `analytic_attempt` (GPUs), not compiled."""

    @property
    def unit(self) -> str:
        """What the memory figures are per: "chip", or "device" where a chip has several."""
        return "chip" if self.devices_per_chip == 1 else "device"


@dataclasses.dataclass
class Plan:
    attempt: Attempt
    """The LoRAJob's own target."""
    tried: list[Attempt]
    """The alternatives compiled after it, in order (none when it fits)."""

    @property
    def suggestion(self) -> Attempt | None:
        """The first alternative that fits (the last tried)."""
        return self.tried[-1] if self.tried and self.tried[-1].fits else None

    def record(self) -> PlanRecord:
        a, s = self.attempt, self.suggestion
        return PlanRecord(
            fits=a.fits, target=a.target.describe(), chips=a.target.chips, hbm_bytes_per_chip=a.total_bytes, capacity_bytes=a.capacity_bytes,
            step_seconds=a.step_seconds, tokens_per_second_per_chip=a.tokens_per_second_per_chip, mfu=a.mfu,
            bound=a.bound, compile_seconds=a.compile_seconds, suggestion=s.target.describe() if s else None,
            remat_policy=a.remat_policy,
        )


def compile_attempt(
    config: TrainConfig, hf_config: dict[str, Any], chip: TpuChip, chips_per_host: int, target: Target
) -> Attempt:
    """The step of `config` at `target`'s batch, compiled for its chips (under remat auto, the policy with the least
    recompute that fits: `plan.choose_remat`); PlanError without libtpu."""
    from lorajob_trainer import plan

    config = config.model_copy(update={
        "per_device_batch_size": target.per_device_batch_size,
        "gradient_accumulation_steps": target.gradient_accumulation_steps,
        "remat_policy": target.remat_policy,
    })
    devices = plan.topology_devices(f"{chip.compiler_name}:{target.topology}", target.slices, chips_per_host)
    device = chip.device()
    if target.remat_policy == REMAT_AUTO:
        choice = plan.choose_remat(config, hf_config, devices, device.capacity_bytes)
        policy, step, error, rejected = choice.policy, choice.step, choice.error, choice.rejected
    else:
        policy, step, error, rejected = target.remat_policy, None, None, ()
        try:
            step = plan.compile_train_step(config, hf_config, devices)
        except Exception as refusal:
            if plan.OUT_OF_MEMORY not in str(refusal):
                raise
            error = str(refusal).strip().splitlines()[0]
    if step is None:
        return Attempt(target, fits=False, capacity_bytes=device.capacity_bytes, error=error, remat_policy=policy,
                       remat_rejected=rejected, devices_per_chip=chip.devices_per_chip)
    return attempt_of_step(target, step, chip, policy, rejected)


def attempt_of_step(target: Target, step: Any, chip: TpuChip, policy: str, rejected: tuple[str, ...] = ()) -> Attempt:
    """The figures of a compiled step (`plan.CompiledStep`) of `target` on `chip`, with the roofline's."""
    device = chip.device()
    memory = step.memory
    attempt = Attempt(
        target, fits=memory.total <= device.capacity_bytes, capacity_bytes=device.capacity_bytes, total_bytes=memory.total,
        memory={"arguments": memory.arguments, "temporaries": memory.temporaries,
                "outputs_not_aliased": memory.outputs - memory.aliased, "base_weights": memory.base_weights,
                "adapters_and_optimizer": memory.adapters + memory.optimizer_state, "batch": memory.batch},
        compiler_flops=step.flops, attention_block=step.attention_block, compile_seconds=step.compile_seconds,
        remat_policy=policy, remat_rejected=rejected, devices_per_chip=chip.devices_per_chip,
    )
    _roofline(attempt, device, step.flops_per_token, step.executed_flops_per_token, step.tokens_per_device,
              memory.base_weights, step.devices, policy)
    return attempt


def _roofline(
    attempt: Attempt, device: Chip, flops_per_token: float, executed_flops_per_token: float, tokens_per_device: int,
    weight_bytes_per_device: int, devices: int, remat_policy: str, interconnect: str = "ICI",
) -> None:
    """Step time = the largest of: the FLOPs the step runs (the model's, remat's recompute and the masked
    attention scores) at the device's peak bf16 rate; every layer's gathered weights read from HBM once per pass
    (forward, backward, and the recompute of remat "full"); the same weights all-gathered over the interconnect
    once per pass (FSDP). MFU counts the model's FLOPs alone. Activations' traffic and overlap are left out, so
    the MFU is a ceiling, not a forecast."""
    flops = flops_per_token * tokens_per_device
    attempt.executed_flops_per_step = executed_flops_per_token * tokens_per_device
    passes = 3 if remat_policy == "full" else 2
    model_bytes = weight_bytes_per_device * devices
    times = {
        "compute": attempt.executed_flops_per_step / device.peak_bf16_flops,
        "HBM bandwidth": passes * model_bytes / device.hbm_bandwidth,
        f"{interconnect} all-gathers": passes * model_bytes * (1 - 1 / devices) / device.interconnect_bandwidth,
    }
    attempt.bound = max(times, key=times.get)
    attempt.flops_per_step = flops
    attempt.step_seconds = times[attempt.bound]
    attempt.tokens_per_second_per_chip = attempt.devices_per_chip * tokens_per_device / attempt.step_seconds
    attempt.mfu = flops / device.peak_bf16_flops / attempt.step_seconds


def analytic_attempt(config: TrainConfig, hf_config: dict[str, Any], gpu: Chip, target: Target) -> Attempt:
    """The GPU plan, where no compiler runs without the device: per GPU, the base weights and the float32
    adapters with their gradients and Adam moments split over every GPU (FSDP), the activations the remat
    policy keeps (`ACTIVATION_BYTES`), one layer's gathered weights twice (prefetch) and the loss chunk's
    float32 logits; the same roofline as the TPU plan, with NVLink for ICI."""
    import jax
    import jax.numpy as jnp

    from flax import nnx

    from lorajob_trainer import mesh as mesh_lib
    from lorajob_trainer import plan as plan_lib
    from lorajob_trainer import run as run_lib

    if target.remat_policy == REMAT_AUTO:
        rejected: list[str] = []
        for policy in (policy for policy in REMAT_POLICIES if policy in ACTIVATION_BYTES):
            attempt = analytic_attempt(config, hf_config, gpu, dataclasses.replace(target, remat_policy=policy))
            if attempt.fits or policy == REMAT_POLICIES[-1]:
                break
            rejected.append(f"{policy}: {_gb(attempt.total_bytes)} > {_gb(attempt.capacity_bytes)}")
        return dataclasses.replace(attempt, target=target, remat_rejected=tuple(rejected))
    config = config.model_copy(update={"remat_policy": target.remat_policy})
    if config.remat_policy not in ACTIVATION_BYTES:
        return Attempt(target, fits=False, capacity_bytes=gpu.capacity_bytes, analytic=True,
                       error=f"no analytic estimate for remat_policy {config.remat_policy!r} (one of {', '.join(ACTIVATION_BYTES)})")
    mesh = mesh_lib.build_mesh(config.mesh, jax.devices("cpu")[:1])
    model = run_lib.abstract_model(config, hf_config, mesh, jnp.bfloat16)
    tunix_config = model.tunix_config
    flops = model.flops(config.max_target_length)
    _, lora, base = nnx.split(model.model, nnx.LoRAParam, ...)
    base_bytes = plan_lib.per_chip_bytes(base)
    adapter_bytes = 4 * sum(leaf.size for leaf in jax.tree.leaves(lora)) * 4  # values, gradients, Adam m and v
    rows = config.per_device_batch_size
    tokens = rows * config.max_target_length
    width, layers = tunix_config.embed_dim, tunix_config.num_layers
    activations = tokens * width * layers * ACTIVATION_BYTES[config.remat_policy]
    working = 2 * base_bytes // layers + 2 * rows * config.loss_chunk_length * tunix_config.vocab_size * 4
    total = base_bytes // target.chips + adapter_bytes // target.chips + activations + working
    attempt = Attempt(
        target, fits=total <= gpu.capacity_bytes, capacity_bytes=gpu.capacity_bytes, total_bytes=total, analytic=True,
        remat_policy=config.remat_policy,
        memory={"arguments": (base_bytes + adapter_bytes) // target.chips, "temporaries": activations + working,
                "outputs_not_aliased": 0, "base_weights": base_bytes // target.chips,
                "adapters_and_optimizer": adapter_bytes // target.chips, "batch": 0},
    )
    _roofline(attempt, gpu, flops.per_token, flops.executed_per_token(config.remat_policy),
              tokens * config.gradient_accumulation_steps, base_bytes // target.chips,
              target.chips, config.remat_policy, interconnect="NVLink")
    return attempt


def plan(config: TrainConfig, hf_config: dict[str, Any], request: Request) -> Plan:
    """The first target compiled; when it does not fit, the others in order until one fits."""
    first, *alternatives = request.targets
    result = Plan(compile_attempt(config, hf_config, request.chip, request.chips_per_host, first), [])
    if not result.attempt.fits:
        for target in alternatives:
            result.tried.append(compile_attempt(config, hf_config, request.chip, request.chips_per_host, target))
            if result.tried[-1].fits:
                break
    return result


def check(config: TrainConfig, model_config: str, request: Request) -> Plan:
    """`plan` with the model's config.json from `model_config` (a local directory, gs:// URI or Hub repo id)."""
    from lorajob_trainer import loading

    return plan(config, loading.read_hf_config(loading.local_config_directory(model_config)), request)


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def format_attempt(attempt: Attempt) -> list[str]:
    lines = [f"  target: {attempt.target.describe()}"]
    if attempt.target.remat_policy == REMAT_AUTO:
        refused = "".join(f"; {rejected}" for rejected in attempt.remat_rejected)
        taken = "the least recompute that fits" if attempt.fits else "it keeps the least, and does not fit: none does"
        lines.append(f"  remat auto: {attempt.remat_policy} ({taken}){refused}")
    if attempt.analytic:
        lines.append("  estimated by the analytic model (no compiler runs for a GPU without the device; activations "
                     "calibrated on the TPU compiler's figures)")
    if attempt.error:
        return lines + [f"  does not fit: {attempt.error}"]
    m = attempt.memory
    verdict = "fits" if attempt.fits else "does NOT fit"
    unit = attempt.unit + ("" if attempt.devices_per_chip == 1 else f" ({attempt.devices_per_chip} per chip)")
    return lines + [
        f"  HBM per {unit}: {_gb(attempt.total_bytes)} of {_gb(attempt.capacity_bytes)} usable "
        f"({int(SAFETY_MARGIN * 100)}% of the {attempt.unit} kept free): {verdict}",
        f"    arguments {_gb(m['arguments'])} (base weights {_gb(m['base_weights'])}, adapters + optimizer "
        f"{_gb(m['adapters_and_optimizer'])}, batch {_gb(m['batch'])}), temporaries {_gb(m['temporaries'])}, "
        f"outputs {_gb(m['outputs_not_aliased'])}",
        f"  FLOPs per step per {unit}: {attempt.flops_per_step:.3e} (4N LoRA cost model), run "
        f"{attempt.executed_flops_per_step:.3e} (with remat's recompute and "
        + ("the masked attention scores" if attempt.attention_block is None else
           f"the splash kernel's attention blocks of {attempt.attention_block} positions, which the compiler does not count")
        + ("" if attempt.compiler_flops is None else
           f"; the compiler's cost analysis counts the scanned layer body once: {attempt.compiler_flops:.3e}") + ")",
        f"  roofline: {attempt.step_seconds:.3f} s/step, {attempt.tokens_per_second_per_chip:,.0f} tokens/s per "
        f"chip, MFU ceiling {attempt.mfu:.0%}, bound by {attempt.bound} (the FLOPs run at the chip's peak bf16 "
        f"FLOP/s, HBM and interconnect bandwidth from the catalogue; weights gathered and read once per pass, "
        f"activations left out)",
        *([] if attempt.analytic else [f"  compiled in {attempt.compile_seconds:.0f} s"]),
    ]


def format_plan(result: Plan) -> list[str]:
    lines = format_attempt(result.attempt)
    if not result.attempt.fits:
        if result.suggestion:
            lines += ["  smallest change that fits (compiled):", *format_attempt(result.suggestion)]
        else:
            lines.append(f"  none of {len(result.tried)} smaller batches, remat policies or larger topologies tried fits")
    return lines


_COMPILER_SHORT_BY = re.compile(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)")


def refusal(result: Plan) -> str:
    """One line (short enough for a condition message) saying why the step does not fit and what would."""
    a = result.attempt
    if a.error:
        short = _COMPILER_SHORT_BY.search(a.error)
        why = (f"the compiler needs {short[1]} for temporaries alone, {short[2]} available" if short
               else a.error[:120])
    else:
        why = f"it needs {_gb(a.total_bytes)} of HBM per {a.unit}, {_gb(a.capacity_bytes)} usable"
    s = result.suggestion
    change = (f"fits (compiled): {s.target.short()}, {_gb(s.total_bytes)} per {s.unit}" if s
              else f"none of {len(result.tried)} smaller batches, remat policies or larger topologies tried fits")
    return f"the train step does not fit {a.target.short()}: {why}; {change}"


def main(argv: list[str] | None = None) -> int:
    from lorajob_trainer import models, storage, weights
    from lorajob_trainer.console import configure_logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="the chip and targets to try, as JSON (fit.Request)")
    parser.add_argument("--model-config", required=True,
                        help="where the model's config.json is: a local directory, gs:// URI or Hugging Face repo id")
    parser.add_argument("config", nargs="*", help="the train step's [config.yaml] KEY=VALUE... (see train --help)")
    args = parser.parse_args(argv)
    configure_logging()
    config = parse_or_report(args.config)
    if config is None:
        return exit_codes.CONFIG
    try:
        from lorajob_trainer import plan as plan_lib
    except ImportError as error:
        log.warning("plan skipped: the trainer's packages are missing (%s)", error)
        return 0
    try:
        result = check(config, args.model_config, Request.from_json(args.request))
    except plan_lib.PlanError as error:
        log.warning("plan skipped: %s", error)
        return 0
    except (models.ModelConfigError, weights.WeightsError) as error:
        print(f"plan failed: {error}", file=sys.stderr)
        return exit_codes.MODEL
    for line in format_plan(result):
        log.info("%s", line)
    if not result.attempt.fits:  # stderr only: its last line is the container's termination message
        print(refusal(result), file=sys.stderr)
        return exit_codes.DOES_NOT_FIT
    record = result.record().line()
    try:  # the train step's remat auto reads the choice here; without it, it compiles on its chips to choose
        storage.write_text(config.layout.plan, record + "\n")
    except Exception as error:  # noqa: BLE001 - whatever the storage raises: the record is on stdout all the same
        log.warning("could not write %s (%s): a train step with remat auto will choose by compiling on its chips",
                    config.layout.plan, error)
    print(record, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
