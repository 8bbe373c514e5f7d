"""`lorajob plan FILE...`: whether each LoRAJob's train step fits its TPU chips, before it holds one.

The same check the LoRAJob's first CPU step runs in the cluster (`lorajob_trainer.fit`, on the request
`render.plan_request` writes), here with the released config.json facts of the catalogue model
(`catalog.released_config`) instead of the checkpoint's. It needs the trainer's packages and libtpu, which
the operator image does not carry. GPU LoRAJobs get the analytic estimate (`fit.analytic_attempt`), saying so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lorajob_operator import accelerators, render
from lorajob_trainer.contract import catalog, fit

INSTALL_HINT = ('lorajob plan compiles the trainer\'s step with the TPU compiler: pip install "lorajob[trainer]" '
                '"jax[tpu]" (the operator image carries neither)')


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
    spec, errors = render.parse_spec(doc)
    name = doc.get("metadata", {}).get("name", "?")
    if spec is None:
        raise PlanUnavailable(f"LoRAJob {name!r} is invalid: {'; '.join(errors)}")
    try:
        from lorajob_trainer import fit as compile_fit  # JAX, the trainer's packages and libtpu
        from lorajob_trainer import plan
    except ImportError as error:
        raise PlanUnavailable(f"{INSTALL_HINT} ({error})") from None
    try:
        hf_config = catalog.released_config(spec.model.name)
    except KeyError as error:
        raise PlanUnavailable(str(error.args[0])) from None
    config = render.train_config(spec, render.run_name(spec, name))
    if spec.compute.gpu is not None:
        return LoRAJobPlan(name, spec.model.name, fit.Plan(_gpu_attempt(spec, config, hf_config), []))
    try:
        result = compile_fit.plan(config, hf_config, render.plan_request(spec))
    except plan.PlanError as error:
        raise PlanUnavailable(str(error)) from None
    return LoRAJobPlan(name, spec.model.name, result)


def _gpu_attempt(spec: Any, config: Any, hf_config: dict[str, Any]) -> Any:
    """The analytic plan (`fit.analytic_attempt`): no compiler runs for a GPU without the device."""
    from lorajob_trainer import fit as compile_fit

    gpu = spec.compute.gpu
    target = fit.Target(gpu.accelerator, f"{gpu.nodes} node(s) x {gpu.gpus_per_node} GPUs", 1,
                        gpu.nodes * gpu.gpus_per_node, spec.training.per_device_batch_size,
                        spec.training.gradient_accumulation_steps, spec.training.remat)
    return compile_fit.analytic_attempt(config, hf_config, accelerators.GPU_CHIPS[gpu.accelerator], target)
