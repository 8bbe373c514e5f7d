"""`lorajob plan FILE...`: whether each LoRAJob's train step fits its TPU chips, before it holds one.

The same check the LoRAJob's first CPU step runs in the cluster, run the same way: `python -m lorajob_trainer.fit`
(`step_commands.plan_command`) in a child process, on the request `step_commands.plan_request` writes, here with the released
config.json facts of the catalogue model (`catalog.released_config`, written to a scratch directory) instead of the
checkpoint's, and with `--json`: the child prints its `contract.fit.Outcome`, the plan read back here. So the operator
imports nothing of the trainer but its contract; the check needs the trainer's packages and libtpu, which the operator
image does not carry. GPU LoRAJobs get the analytic estimate (the child's `fit.analytic_attempt`), saying so.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from lorajob_operator import accelerators, api, names, step_commands, validation
from lorajob_trainer.contract import catalog, fit

INSTALL_HINT = ('lorajob plan compiles the trainer\'s step with the TPU compiler: pip install "lorajob[trainer]" '
                '"jax[tpu]" (the operator image carries neither)')
FIT_CHECK = step_commands.FIT_CHECK
"""The module the child process runs (`python -m`), as the LoRAJob's CPU step does."""


class PlanUnavailable(RuntimeError):
    """No plan can be made for this LoRAJob here (packages missing, an unknown model, a topology libtpu lacks)."""


@dataclasses.dataclass
class LoRAJobPlan:
    name: str
    model: str
    plan: fit.Plan

    def to_dict(self) -> dict[str, Any]:
        suggestion = self.plan.suggestion
        return {"name": self.name, "model": self.model, "plan": dataclasses.asdict(self.plan.attempt),
                "suggestion": dataclasses.asdict(suggestion) if suggestion else None}

    def format(self) -> str:
        return "\n".join([f"LoRAJob {self.name!r} ({self.model}):", *fit.format_plan(self.plan)])


def plan_lorajob(doc: dict) -> LoRAJobPlan:
    spec, errors = validation.parse_spec(doc)
    name = doc.get("metadata", {}).get("name", "?")
    if spec is None:
        raise PlanUnavailable(f"LoRAJob {name!r} is invalid: {'; '.join(errors)}")
    try:
        hf_config = catalog.released_config(spec.model.name)
    except KeyError as error:
        raise PlanUnavailable(str(error.args[0])) from None
    request = _gpu_request(spec) if spec.compute.gpu is not None else step_commands.plan_request(spec)
    outcome = run_fit_check(step_commands.train_config(spec, names.run_name(spec, name)).to_args(), hf_config, request)
    if outcome.plan is None:
        raise PlanUnavailable(f"{INSTALL_HINT} ({outcome.no_plan})" if outcome.packages_missing else outcome.no_plan)
    return LoRAJobPlan(name, spec.model.name, outcome.plan)


def run_fit_check(config_args: list[str], hf_config: dict[str, Any], request: fit.Request) -> fit.Outcome:
    """`python -m lorajob_trainer.fit --json` of the train config `config_args` on `request`, with `hf_config` as
    the model's config.json; PlanUnavailable when it prints no outcome (it cannot start, or fails otherwise)."""
    with tempfile.TemporaryDirectory(prefix="lorajob-plan-") as model_config:
        (Path(model_config) / "config.json").write_text(json.dumps(hf_config))
        command = step_commands.fit_command(request, model_config, ["--json", *config_args], python=sys.executable,
                                            module=FIT_CHECK)
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = completed.stdout.strip().splitlines()
    try:
        return fit.Outcome.from_json(lines[-1])
    except (IndexError, ValueError, KeyError, TypeError):  # no outcome line: the child failed before it could say
        pass
    said = next((line.strip() for line in reversed(completed.stderr.splitlines()) if line.strip()), "no output")
    if "ModuleNotFoundError" in said or "ImportError" in said or "No module named" in said:
        raise PlanUnavailable(f"{INSTALL_HINT} (python -m {FIT_CHECK} could not import: {said})")
    raise PlanUnavailable(f"python -m {FIT_CHECK} failed with exit code {completed.returncode}: {said}")


def _gpu_request(spec: api.LoRAJobSpec) -> fit.Request:
    """The analytic estimate's request: a GPU's `Chip`, which no compiler runs for without the device."""
    gpu, training = spec.compute.gpu, spec.training
    target = fit.Target(gpu.accelerator, f"{gpu.nodes} node(s) x {gpu.gpus_per_node} GPUs", 1,
                        gpu.nodes * gpu.gpus_per_node, training.per_device_batch_size,
                        training.gradient_accumulation_steps, training.remat)
    return fit.Request(accelerators.GPU_CHIPS[gpu.accelerator], gpu.gpus_per_node, (target,))
