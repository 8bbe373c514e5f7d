"""The fit check's request and answer: what `python -m lorajob_trainer.fit` is asked (`Request`: a chip's facts and the
targets to try, written by the operator) and what it answers (`Plan`: an `Attempt` per target compiled, their
figures, and the lines that say them), without the compiler.

`python -m lorajob_trainer.fit` compiles the train step for each target (`lorajob_trainer.fit`, JAX and libtpu); with
`--json` it prints its `Outcome` (`lorajob plan` reads it back).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from lorajob_trainer.contract.records import REMAT_AUTO, PlanRecord

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


ACTIVATION_BYTES = {"full": 16, "attention": 26, "minimal": 46}
"""Activation bytes a step keeps per token, per unit of model width, per layer, by remat policy: the TPU
compiler's temporaries for llama3.1-8b on v6e-8 (1 row of 1,024 tokens per chip, 32 layers of width 4,096: 2.09 GB
with "full"; 3.45 GB with "attention" and 6.12 GB with "minimal", 2026-12-07, `bench/tpu_plan.py --no-maxtext
--remat POLICY --cases llama3.1-8b:v6e-8:1024`), which the analytic plan for GPUs takes as its calibration. The
GPU step's dense attention has no kernel output for "minimal" and "attention" to keep, so these err high there."""


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
    chip: Chip
    """A `TpuChip`: each target is compiled for it. A plain `Chip` (a GPU, which no compiler runs for without the
    device): the analytic estimate of the first target."""
    chips_per_host: int
    targets: tuple[Target, ...]
    """The LoRAJob's own target first, then the alternatives in the order they are tried."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Request:
        values = json.loads(text)
        chip = TpuChip(**values["chip"]) if "compiler_name" in values["chip"] else Chip(**values["chip"])
        return cls(chip, values["chips_per_host"], tuple(Target(**t) for t in values["targets"]))


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
    collective_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
    """Bytes one device sends to others per step, by collective kind (the compiled step's; empty: analytic)."""
    mesh: dict[str, int] = dataclasses.field(default_factory=dict)
    """The compiled step's mesh axes and sizes (empty: analytic)."""
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

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Attempt:
        """The attempt `dataclasses.asdict` wrote."""
        return cls(**{**values, "target": Target(**values["target"]), "remat_rejected": tuple(values["remat_rejected"])})


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Plan:
        return cls(Attempt.from_dict(values["attempt"]), [Attempt.from_dict(a) for a in values["tried"]])


@dataclasses.dataclass
class Outcome:
    """What `python -m lorajob_trainer.fit --json` prints on stdout, one JSON line: the plan, or why none was made."""

    plan: Plan | None = None
    no_plan: str | None = None
    """Why no plan was made: a topology libtpu lacks, the model's config.json unreadable, a package missing."""
    packages_missing: bool = False
    """No plan because the packages the compile needs (JAX, the trainer's, libtpu) are not installed."""

    def to_json(self) -> str:
        return json.dumps({"plan": self.plan.to_dict() if self.plan else None, "no_plan": self.no_plan,
                           "packages_missing": self.packages_missing}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Outcome:
        values = json.loads(text)
        plan = Plan.from_dict(values["plan"]) if values["plan"] is not None else None
        return cls(plan, values["no_plan"], values["packages_missing"])


def gb(value: int | None) -> str:
    """Bytes as the plan's lines write them."""
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
        f"  HBM per {unit}: {gb(attempt.total_bytes)} of {gb(attempt.capacity_bytes)} usable "
        f"({int(SAFETY_MARGIN * 100)}% of the {attempt.unit} kept free): {verdict}",
        f"    arguments {gb(m['arguments'])} (base weights {gb(m['base_weights'])}, adapters + optimizer "
        f"{gb(m['adapters_and_optimizer'])}, batch {gb(m['batch'])}), temporaries {gb(m['temporaries'])}, "
        f"outputs {gb(m['outputs_not_aliased'])}",
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
        *(["  mesh: " + " x ".join(f"{axis} {size}" for axis, size in attempt.mesh.items())] if attempt.mesh else []),
        *([f"  sent per step per {attempt.unit} (the compiled step's collectives): "
           + ", ".join(f"{kind} {gb(int(sent))}" for kind, sent in attempt.collective_bytes.items())]
          if attempt.collective_bytes else []),
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
        why = f"it needs {gb(a.total_bytes)} of HBM per {a.unit}, {gb(a.capacity_bytes)} usable"
    s = result.suggestion
    change = (f"fits (compiled): {s.target.short()}, {gb(s.total_bytes)} per {s.unit}" if s
              else f"none of {len(result.tried)} smaller batches, remat policies or larger topologies tried fits")
    return f"the train step does not fit {a.target.short()}: {why}; {change}"
