"""`lorajob plan FILE...`: whether each LoRAJob's train step fits its TPU chips, before it holds one.

The trainer's own step is compiled by the real TPU compiler for the LoRAJob's machine type, topology and
slices, without a TPU (`lorajob_trainer.plan`; needs the trainer's packages and libtpu, which the operator
image does not carry). The report gives, per chip: the HBM the compiler assigns against the chip's capacity
less a safety margin, the FLOPs of the 4N LoRA cost model, a roofline prediction of the step time, tokens/s
and MFU, and the compile time. A step that does not fit comes with the smallest changes that do, each
confirmed by compiling it: a smaller per-device batch (same global batch through gradient accumulation), or
a larger topology of the same machine type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lorajob_operator import accelerators, api, render

SAFETY_MARGIN = 0.10
"""Share of a chip's HBM a plan leaves free (the runtime's own buffers, fragmentation)."""
LARGER_TOPOLOGIES_TRIED = 2
INSTALL_HINT = ('lorajob plan compiles the trainer\'s step with the TPU compiler: pip install "lorajob[trainer]" '
                '"jax[tpu]" (the operator image carries neither)')


class PlanUnavailable(RuntimeError):
    """No plan can be made for this LoRAJob here (packages missing, a GPU backend, an unknown model)."""


@dataclasses.dataclass
class Target:
    machine_type: str
    topology: str
    slices: int
    per_device_batch_size: int
    gradient_accumulation_steps: int

    @property
    def chips(self) -> int:
        return accelerators.chips_in(self.topology) * self.slices

    def describe(self) -> str:
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return (f"{self.machine_type} {self.topology}{slices} ({self.chips} chips), per-device batch "
                f"{self.per_device_batch_size} x {self.gradient_accumulation_steps} accumulation")


@dataclasses.dataclass
class Attempt:
    """One compile of the step for one target: its figures, or the compiler's refusal."""

    target: Target
    fits: bool
    capacity_bytes: int
    total_bytes: int | None = None
    memory: dict[str, int] = dataclasses.field(default_factory=dict)
    flops_per_step: float | None = None
    compiler_flops: float | None = None
    step_seconds: float | None = None
    tokens_per_second_per_chip: float | None = None
    mfu: float | None = None
    bound: str | None = None
    compile_seconds: float | None = None
    error: str | None = None


def _compile(spec: api.LoRAJobSpec, run: str, target: Target, hf_config: dict[str, Any]) -> Attempt:
    from lorajob_trainer import plan

    machine = accelerators.TPU_MACHINES[target.machine_type]
    chip = accelerators.TPU_CHIPS[machine.generation]
    capacity = int(chip.hbm_bytes * (1 - SAFETY_MARGIN))
    config = render.train_config(spec, run).model_copy(update={
        "per_device_batch_size": target.per_device_batch_size,
        "gradient_accumulation_steps": target.gradient_accumulation_steps,
    })
    try:
        devices = plan.topology_devices(f"{chip.compiler_name}:{target.topology}", target.slices, machine.chips_per_vm)
    except plan.PlanError as error:
        raise PlanUnavailable(str(error)) from None
    try:
        step = plan.compile_train_step(config, hf_config, devices)
    except Exception as error:  # the compiler's RESOURCE_EXHAUSTED: the message says by how much
        return Attempt(target, fits=False, capacity_bytes=capacity, error=str(error).strip().splitlines()[0])
    memory = step.memory
    attempt = Attempt(
        target, fits=memory.total <= capacity, capacity_bytes=capacity, total_bytes=memory.total,
        memory={"arguments": memory.arguments, "temporaries": memory.temporaries,
                "outputs_not_aliased": memory.outputs - memory.aliased, "base_weights": memory.base_weights,
                "adapters_and_optimizer": memory.adapters + memory.optimizer_state, "batch": memory.batch},
        compiler_flops=step.flops, compile_seconds=step.compile_seconds,
    )
    _roofline(attempt, step, chip, config)
    return attempt


def _roofline(attempt: Attempt, step: Any, chip: accelerators.TpuChip, config: Any) -> None:
    """Step time = the largest of: the 4N model's FLOPs at the chip's peak bf16 rate; every layer's gathered
    weights read from HBM once per pass (forward, backward, and the recompute of remat "full"); the same
    weights all-gathered over ICI once per pass (FSDP). Activations' traffic and overlap are left out, so the
    MFU is a ceiling, not a forecast."""
    flops = step.flops_per_token * step.tokens_per_chip
    passes = 3 if config.remat_policy == "full" else 2
    model_bytes = step.memory.base_weights * step.chips
    times = {
        "compute": flops / chip.peak_bf16_flops,
        "HBM bandwidth": passes * model_bytes / chip.hbm_bandwidth,
        "ICI all-gathers": passes * model_bytes * (1 - 1 / step.chips) / chip.ici_bandwidth,
    }
    attempt.bound = max(times, key=times.get)
    attempt.flops_per_step = flops
    attempt.step_seconds = times[attempt.bound]
    attempt.tokens_per_second_per_chip = step.tokens_per_chip / attempt.step_seconds
    attempt.mfu = times["compute"] / attempt.step_seconds


def _alternatives(target: Target) -> list[Target]:
    """Cheapest first: smaller per-device batches (the global batch kept by accumulation), then the next
    larger topologies of the machine type."""
    smaller = []
    batch, accumulation = target.per_device_batch_size, target.gradient_accumulation_steps
    while batch > 1 and batch % 2 == 0:
        batch, accumulation = batch // 2, accumulation * 2
        smaller.append(dataclasses.replace(target, per_device_batch_size=batch, gradient_accumulation_steps=accumulation))
    chips = accelerators.chips_in(target.topology)
    larger = sorted(
        (t for t in accelerators.TPU_MACHINES[target.machine_type].topologies if accelerators.chips_in(t) > chips),
        key=accelerators.chips_in,
    )[:LARGER_TOPOLOGIES_TRIED]
    return smaller + [dataclasses.replace(target, topology=t) for t in larger]


def plan_lorajob(doc: dict) -> dict[str, Any]:
    """The plan of one LoRAJob document: {name, model, attempt, suggestion?, tried} (see module docstring)."""
    spec, errors = render.parse_spec(doc)
    name = doc.get("metadata", {}).get("name", "?")
    if spec is None:
        raise PlanUnavailable(f"LoRAJob {name!r} is invalid: {'; '.join(errors)}")
    if spec.compute.tpu is None:
        raise PlanUnavailable(f"LoRAJob {name!r} runs on GPUs, for which no compiler runs without the device")
    try:
        from lorajob_trainer import catalog
        from lorajob_trainer import plan  # noqa: F401  (JAX and the trainer's packages)
    except ImportError as error:
        raise PlanUnavailable(f"{INSTALL_HINT} ({error})") from None
    try:
        hf_config = catalog.released_config(spec.model.name)
    except KeyError as error:
        raise PlanUnavailable(str(error.args[0])) from None
    tpu, training = spec.compute.tpu, spec.training
    target = Target(tpu.machine_type, tpu.topology, tpu.slices, training.per_device_batch_size,
                    training.gradient_accumulation_steps)
    run = render.run_name(spec, name)
    attempt = _compile(spec, run, target, hf_config)
    result: dict[str, Any] = {"name": name, "model": spec.model.name, "plan": attempt, "tried": []}
    if not attempt.fits:
        for alternative in _alternatives(target):
            tried = _compile(spec, run, alternative, hf_config)
            result["tried"].append(tried)
            if tried.fits:
                result["suggestion"] = tried
                break
    return result


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def format_attempt(attempt: Attempt) -> list[str]:
    lines = [f"  target: {attempt.target.describe()}"]
    if attempt.error:
        return lines + [f"  does not fit: {attempt.error}"]
    m = attempt.memory
    verdict = "fits" if attempt.fits else "does NOT fit"
    lines += [
        f"  HBM per chip: {_gb(attempt.total_bytes)} of {_gb(attempt.capacity_bytes)} usable "
        f"({int(SAFETY_MARGIN * 100)}% of the chip kept free): {verdict}",
        f"    arguments {_gb(m['arguments'])} (base weights {_gb(m['base_weights'])}, adapters + optimizer "
        f"{_gb(m['adapters_and_optimizer'])}, batch {_gb(m['batch'])}), temporaries {_gb(m['temporaries'])}, "
        f"outputs {_gb(m['outputs_not_aliased'])}",
        f"  FLOPs per step per chip: {attempt.flops_per_step:.3e} (4N LoRA cost model; the compiler's cost analysis "
        f"counts the scanned layer body once: {attempt.compiler_flops or 0:.3e})",
        f"  roofline: {attempt.step_seconds:.3f} s/step, {attempt.tokens_per_second_per_chip:,.0f} tokens/s per "
        f"chip, MFU ceiling {attempt.mfu:.0%}, bound by {attempt.bound} (the chip's peak bf16 FLOP/s, HBM and "
        f"ICI bandwidth from the catalogue; weights gathered and read once per pass, activations left out)",
        f"  compiled in {attempt.compile_seconds:.0f} s",
    ]
    return lines


def format_plan(result: dict[str, Any]) -> str:
    lines = [f"LoRAJob {result['name']!r} ({result['model']}):", *format_attempt(result["plan"])]
    if not result["plan"].fits:
        if "suggestion" in result:
            lines += ["  smallest change that fits (compiled):", *format_attempt(result["suggestion"])]
        else:
            lines.append(f"  none of {len(result['tried'])} smaller batches or larger topologies tried fits")
    return "\n".join(lines)
