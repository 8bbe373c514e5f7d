"""The fine-tuning API server's configuration (`lorajob api --config FILE`, the Helm chart's ConfigMap).

The platform team names the base models the API offers; each is a LoRAJob spec template (model, compute,
scheduling, training defaults, LoRA settings), written as in a LoRAJob. A request fills in the dataset, the
steps, the output directory and the hyperparameters the API has a meaning for.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, field_validator

from lorajob_operator import api, names, step_commands

REQUEST_FIELDS = ("dataset", "method", "preference", "runName", "suspend")
"""spec fields a request decides: a model's template may not set them (nor training.steps, training.packing and
output.baseOutputDirectory)."""


class ModelOffer(api._Model):
    """One base model offered as the API's `model`."""

    template: dict[str, Any]
    """template is a LoRAJob spec without dataset, method, preference, training.steps, training.packing and
    output.baseOutputDirectory."""
    owned_by: str = Field(default="lorajob", max_length=256)
    """ownedBy is what GET /v1/models says owns the model."""

    @field_validator("template")
    @classmethod
    def _leaves_request_fields_alone(cls, template: dict[str, Any]) -> dict[str, Any]:
        taken = [field for field in REQUEST_FIELDS if field in template]
        taken += [f"training.{field}" for field in ("steps", "packing") if field in template.get("training", {})]
        if "baseOutputDirectory" in template.get("output", {}):
            taken.append("output.baseOutputDirectory")
        if taken:
            raise ValueError(f"the template sets {', '.join(taken)}, which each request decides")
        return template

    @functools.cached_property
    def spec(self) -> api.LoRAJobSpec:
        """The template as a LoRAJob spec, with placeholders for what a request decides (its training defaults and
        accelerators are what requests read); a pydantic ValidationError where the template is not one."""
        spec = copy.deepcopy(self.template)
        spec.setdefault("training", {})["steps"] = 1
        spec["dataset"] = {"name": "json"}
        spec["output"] = {"baseOutputDirectory": "/"}
        return api.LoRAJobSpec.model_validate(spec)

    @property
    def accelerators(self) -> int:
        """TPU chips or GPUs a job of this model trains on."""
        return step_commands.accelerator_count(self.spec)


class Limits(api._Model):
    """Bounds on what one namespace may send."""

    file_bytes: int = Field(default=512 * 2**20, ge=1)
    """fileBytes bounds one uploaded file (the upload is refused as soon as it passes this)."""
    file_lines: int = Field(default=1_000_000, ge=1)
    """fileLines bounds the examples in one file."""
    files_per_namespace: int = Field(default=1000, ge=1)
    """filesPerNamespace bounds the files a namespace keeps."""
    requests_per_minute: int = Field(default=600, ge=1)
    """requestsPerMinute bounds the requests of one namespace (a token bucket of this size, refilled over a minute)."""
    line_errors: int = Field(default=20, ge=1, le=1000)
    """lineErrors is how many of a refused file's bad lines the error lists."""


class ServerConfig(api._Model):
    """What `lorajob api` serves."""

    storage: api.StoragePath
    """storage holds the uploaded files and each job's outputs, under one folder per namespace: a gs:// prefix or
    an absolute path that the trainer pods can read."""
    namespaces: list[Annotated[str, Field(max_length=names.DNS_LABEL_MAX)]] = Field(min_length=1)
    """namespaces the API serves (an OpenAI project is a namespace); the server's RBAC covers exactly these."""
    models: dict[str, ModelOffer] = Field(min_length=1)
    """models offered, by the API's model name."""
    limits: Limits = Field(default_factory=Limits)
    """limits per namespace."""

    @classmethod
    def load(cls, path: Path) -> ServerConfig:
        return cls.model_validate(yaml.safe_load(path.read_text()))
