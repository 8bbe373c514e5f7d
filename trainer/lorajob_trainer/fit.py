"""Whether a train step fits its TPU chips, judged by the TPU compiler without a TPU, and how fast it may go.

    python -m lorajob_trainer.fit --request JSON --model-config DIR [--json] [config.yaml] KEY=VALUE...

The request (`contract.fit.Request`, written by the operator) names the chip's facts and the targets to try in order:
the LoRAJob's own first, then the smallest changes that may fit (a smaller per-device batch with the same
global batch through accumulation, remat "full", larger topologies of the machine type). The train step of the config
(`lorajob_trainer.plan`) is compiled for the first target; when it does not fit, for the next ones until
one fits. Per chip: the HBM the compiler assigns against the chip's capacity less `SAFETY_MARGIN`, the
FLOPs of the 4N LoRA cost model, a roofline step time, tokens/s and MFU ceiling, the compile time. A request for
a GPU (a plain `Chip`) gets the analytic estimate of its first target (`analytic_attempt`).

When the LoRAJob's own target fits it prints one `LORAJOB_PLAN` line (`contract.records.PlanRecord`, lifted into
status.plan) and exits 0; when it does not, it exits DoesNotFit (exit_codes) with one line on stderr giving
the figures and the smallest change that fits. With `--json` it prints the plan, or why none was made, as one JSON
line instead (`contract.fit.Outcome`) and writes nothing.
The operator runs it in the CPU step before any TPU is held; `lorajob plan FILE` runs it with `--json` on a
workstation. Without libtpu (a CPU or GPU image) it says so and exits 0: nothing is judged.
This module imports without JAX; the types it reads and writes are the contract's (`contract.fit`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from lorajob_trainer.contract import exit_codes
from lorajob_trainer.contract.config import TrainConfig, parse_or_report
from lorajob_trainer.contract.fit import (
    ACTIVATION_BYTES, Attempt, Chip, Outcome, Plan, Request, Target, TpuChip, format_plan, gb, refusal,
)
from lorajob_trainer.contract.records import REMAT_AUTO, REMAT_POLICIES

log = logging.getLogger("lorajob_trainer.fit")  # not __name__: run as __main__

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
            if not plan.too_large(refusal):
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
    attempt.collective_bytes = {kind: sent for kind, sent in step.collective_bytes.items() if sent}
    attempt.mesh = step.mesh
    _roofline(attempt, device, step.flops_per_token, step.executed_flops_per_token, step.tokens_per_device,
              step.weights_read_bytes, sum(step.collective_bytes.values()), policy)
    return attempt


def _roofline(
    attempt: Attempt, device: Chip, flops_per_token: float, executed_flops_per_token: float, tokens_per_device: int,
    weights_read_bytes: int, interconnect_bytes: float, remat_policy: str, interconnect: str = "ICI collectives",
) -> None:
    """Step time = the largest of: the FLOPs the step runs (the model's, remat's recompute and the masked
    attention scores) at the device's peak bf16 rate; the weights one device computes with
    (`weights_read_bytes`: every layer's, gathered) read from HBM once per pass (forward, backward, and the
    recompute of remat "full"); `interconnect_bytes`, what one device sends to others per step (the compiled
    step's collectives, or the analytic plan's FSDP all-gathers), at the interconnect's bandwidth. MFU counts the
    model's FLOPs alone. Activations' traffic and overlap are left out, so the MFU is a ceiling, not a forecast."""
    flops = flops_per_token * tokens_per_device
    attempt.executed_flops_per_step = executed_flops_per_token * tokens_per_device
    passes = 3 if remat_policy == "full" else 2
    times = {
        "compute": attempt.executed_flops_per_step / device.peak_bf16_flops,
        "HBM bandwidth": passes * weights_read_bytes / device.hbm_bandwidth,
        interconnect: interconnect_bytes / device.interconnect_bandwidth,
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
            rejected.append(f"{policy}: {gb(attempt.total_bytes)} > {gb(attempt.capacity_bytes)}")
        return dataclasses.replace(attempt, target=target, remat_rejected=tuple(rejected))
    config = config.model_copy(update={"remat_policy": target.remat_policy})
    if config.remat_policy not in ACTIVATION_BYTES:
        return Attempt(target, fits=False, capacity_bytes=gpu.capacity_bytes, analytic=True,
                       error=f"no analytic estimate for remat_policy {config.remat_policy!r} (one of {', '.join(ACTIVATION_BYTES)})")
    config = run_lib.resolve_expert_axis(config, lambda: hf_config, jax.devices("cpu")[:1])
    mesh = mesh_lib.build_mesh(config.mesh, jax.devices("cpu")[:1])
    model = run_lib.abstract_model(hf_config, config.lora, mesh, jnp.bfloat16, config.router_aux_loss_coef,
                                   config.expert_capacity_factor)
    tunix_config = model.tunix_config
    flops = model.flops(config.max_target_length)
    _, lora, base = nnx.split(model.model, nnx.LoRAParam, ...)
    base_bytes = plan_lib.per_chip_bytes(base)
    adapter_bytes = 4 * sum(leaf.size for leaf in jax.tree.leaves(lora)) * 4  # values, gradients, Adam m and v
    rows = config.per_device_batch_size
    tokens = rows * config.max_target_length
    width, layers = tunix_config.embed_dim, tunix_config.num_layers
    activations = tokens * width * layers * ACTIVATION_BYTES[config.remat_policy]
    working = 2 * base_bytes // layers + 2 * rows * config.loss_chunk_per_row * tunix_config.vocab_size * 4
    total = base_bytes // target.chips + adapter_bytes // target.chips + activations + working
    attempt = Attempt(
        target, fits=total <= gpu.capacity_bytes, capacity_bytes=gpu.capacity_bytes, total_bytes=total, analytic=True,
        remat_policy=config.remat_policy,
        memory={"arguments": (base_bytes + adapter_bytes) // target.chips, "temporaries": activations + working,
                "outputs_not_aliased": 0, "base_weights": base_bytes // target.chips,
                "adapters_and_optimizer": adapter_bytes // target.chips, "batch": 0},
    )
    passes = 3 if config.remat_policy == "full" else 2
    gathered = passes * base_bytes * (1 - 1 / target.chips)  # FSDP: every weight all-gathered once per pass
    _roofline(attempt, gpu, flops.per_token, flops.executed_per_token(config.remat_policy),
              tokens * config.gradient_accumulation_steps, base_bytes, gathered, config.remat_policy,
              interconnect="NVLink all-gathers")
    return attempt


def plan(config: TrainConfig, hf_config: dict[str, Any], request: Request) -> Plan:
    """The first target compiled; when it does not fit, the others in order until one fits. For a GPU (a plain `Chip`,
    no `TpuChip`): the analytic estimate of the first target."""
    first, *alternatives = request.targets
    if not isinstance(request.chip, TpuChip):
        return Plan(analytic_attempt(config, hf_config, request.chip, first), [])
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--request", required=True, help="the chip and targets to try, as JSON (contract.fit.Request)")
    parser.add_argument("--model-config", required=True,
                        help="where the model's config.json is: a local directory, gs:// URI or Hugging Face repo id")
    parser.add_argument("--json", action="store_true",
                        help="print the plan, or why none was made, as one JSON line (contract.fit.Outcome) instead "
                             "of the LORAJOB_PLAN record, and write nothing (what `lorajob plan` reads)")
    parser.add_argument("config", nargs="*", help="the train step's [config.yaml] KEY=VALUE... (see train --help)")
    args = parser.parse_args(argv)

    def answer(outcome: Outcome, code: int) -> int:
        if args.json:
            print(outcome.to_json(), flush=True)
        return code

    try:
        from lorajob_trainer import mesh as mesh_lib
        from lorajob_trainer import models, storage, weights
        from lorajob_trainer import plan as plan_lib
        from lorajob_trainer.console import configure_logging
    except ImportError as error:
        log.warning("plan skipped: the trainer's packages are missing (%s)", error)
        return answer(Outcome(no_plan=str(error), packages_missing=True), 0)
    configure_logging()
    config = parse_or_report(args.config)
    if config is None:
        return exit_codes.CONFIG
    try:
        result = check(config, args.model_config, Request.from_json(args.request))
    except plan_lib.PlanError as error:
        log.warning("plan skipped: %s", error)
        return answer(Outcome(no_plan=str(error)), 0)
    except (models.ModelConfigError, weights.WeightsError) as error:
        print(f"plan failed: {error}", file=sys.stderr)
        return answer(Outcome(no_plan=f"plan failed: {error}"), exit_codes.MODEL)
    except mesh_lib.MeshError as error:
        print(f"plan failed: {error}", file=sys.stderr)
        return answer(Outcome(no_plan=f"plan failed: {error}"), exit_codes.CONFIG)
    for line in format_plan(result):
        log.info("%s", line)
    if not result.attempt.fits:  # stderr only: its last line is the container's termination message
        print(refusal(result), file=sys.stderr)
        return answer(Outcome(plan=result), exit_codes.DOES_NOT_FIT)
    if args.json:
        return answer(Outcome(plan=result), 0)
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
