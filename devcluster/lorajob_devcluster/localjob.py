"""A LoRAJob whose every step really runs on the simulated cluster (the pod runner's nodes).

`write_assets(directory)` generates a tiny Qwen3 checkpoint with its tokenizer, a question/answer dataset and a
preference dataset of the same task (`json` files, `train` and `test` splits) offline; `lorajob(...)` is a LoRAJob over them:
convert on the local CPU pool, multi-controller (mcjax) training on the 2-host v6e 2x4 pool, export,
all writing under a local `baseOutputDirectory`. The operator renders its JobSets as for any
cluster; the runner runs exactly those command lines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from lorajob_trainer.contract.records import RunLayout

from . import topology

MODEL_NAME = "tiny-qwen3"
MACHINE_TYPE = "ct6e-standard-4t"


@dataclasses.dataclass(frozen=True)
class Assets:
    model: Path
    data: Path
    """Question/answer rows (`train` and `test` splits)."""
    outputs: Path
    compilation_cache: Path | None = None
    """The LoRAJobs' output.compilationCache (None: the default, under `outputs`)."""

    @property
    def preference_data(self) -> Path:
        """Prompt/chosen/rejected rows of the same task (`train` and `test` splits; demo.preference_rows)."""
        return self.data.parent / "preference-data"

    def layout(self, run: str) -> RunLayout:
        """Where the LoRAJob `run` writes under `outputs` (its `baseOutputDirectory`)."""
        return RunLayout(str(self.outputs), run)

    def run_directory(self, run: str) -> Path:
        return Path(self.layout(run).run_directory)

    def adapter(self, run: str) -> Path:
        return Path(self.layout(run).adapter_export)

    def metrics(self, run: str) -> Path:
        return Path(self.layout(run).metrics)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_assets(directory: Path, *, train_rows: int = 400, eval_rows: int = 40,
                 compilation_cache: Path | None = None) -> Assets:
    """The tiny model (generated once per directory), the dataset, and where runs write; absolute paths."""
    from lorajob_trainer import demo, tiny

    directory = directory.absolute()
    assets = Assets(directory / "model", directory / "data", directory / "runs", compilation_cache)
    if not (assets.model / "config.json").is_file():
        tiny.make_tiny_checkpoint("qwen3", assets.model)
    _write_jsonl(assets.data / "train.jsonl", demo.arithmetic_rows(train_rows))
    _write_jsonl(assets.data / "test.jsonl", demo.arithmetic_rows(eval_rows, seed=1))
    _write_jsonl(assets.preference_data / "train.jsonl", demo.preference_rows(train_rows))
    _write_jsonl(assets.preference_data / "test.jsonl", demo.preference_rows(eval_rows, seed=1))
    assets.outputs.mkdir(parents=True, exist_ok=True)
    return assets


def lorajob(name: str, assets: Assets, *, steps: int = 30, checkpoint_period: int = 10, queue: str = topology.DEFAULT_LOCAL_QUEUE) -> dict:
    pool = topology.LOCAL_V6E_2X4
    return {
        "apiVersion": "lorajob.dev/v1alpha1",
        "kind": "LoRAJob",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": MODEL_NAME, "huggingFace": str(assets.model)},
            "dataset": {"name": "json", "dataDir": str(assets.data), "columns": ["question", "answer"], "evalSplit": "test"},
            "training": {
                "steps": steps, "perDeviceBatchSize": 2, "maxTargetLength": 64, "learningRate": 1e-2,
                "checkpointPeriod": checkpoint_period, "evalInterval": checkpoint_period,
            },
            "lora": {"rank": 8, "alpha": 16},
            "compute": {
                "backend": "mcjax", "cpuNodePool": topology.LOCAL_CPU_NP.name,
                "tpu": {"machineType": MACHINE_TYPE, "topology": pool.tpu_topology},
            },
            "output": {"baseOutputDirectory": str(assets.outputs),
                       **({"compilationCache": str(assets.compilation_cache)} if assets.compilation_cache else {})},
            "scheduling": {"queueName": queue, "terminationGracePeriodSeconds": 30},
        },
    }


def fine_tuning_offer(assets: Assets) -> dict:
    """The tiny model as the fine-tuning API's model (openai_api.config.ModelOffer): `lorajob`'s spec without what
    each request decides."""
    spec = lorajob("template", assets)["spec"]
    del spec["dataset"], spec["output"]["baseOutputDirectory"]
    for decided in ("steps", "checkpointPeriod", "evalInterval"):
        del spec["training"][decided]
    return {"template": spec}
