"""The environment variables the operator renders into a step's pods and the trainer reads.

Distributed start-up (`lorajob_trainer.distributed` reads them): `JAX_PLATFORMS` containing `proxy` is Pathways;
`JAX_NUM_PROCESSES` > 1 is multi-controller JAX, with `JAX_COORDINATOR_ADDRESS` (host or host:port, the port
defaulting to `JAX_COORDINATOR_PORT`, else 8476) and `JAX_PROCESS_ID`. Credentials (`CREDENTIALS`: the Hugging Face
token, the experiment trackers'): each an optional secretKeyRef, and where it should have come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENV_PLATFORMS = "JAX_PLATFORMS"
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
DEFAULT_COORDINATOR_PORT = 8476
PATHWAYS_PLATFORM = "proxy"
"""The JAX platform of a Pathways client: its backend is the Pathways proxy."""

HF_TOKEN_ENV = "HF_TOKEN"
"""The Hugging Face token's environment variable (a secretKeyRef the operator renders, optional)."""


@dataclass(frozen=True)
class Credential:
    """A secret a LoRAJob names in spec.credentials: the variable it reaches the pods in (an optional secretKeyRef; the
    Secret's key defaults to the variable's name) and, in `source_variable`, `<Secret name>/<key>` it should have come
    from, set by the operator, which never reads a Secret itself."""

    field: str
    """Its field in spec.credentials."""
    variable: str
    what: str
    """What it is, for the message that it is missing."""

    @property
    def source_variable(self) -> str:
        return f"LORAJOB_{self.variable}_SECRET"

    def missing(self, environ: Mapping[str, str]) -> str | None:
        """Why it did not arrive (no such Secret in the LoRAJob's namespace, no such key, or an empty value); None
        when it did, or when the LoRAJob names none."""
        source = environ.get(self.source_variable)
        if not source or environ.get(self.variable):
            return None
        name, _, key = source.partition("/")
        return (f"{self.what} is missing: no Secret {name} with a non-empty key {key} in the LoRAJob's namespace "
                f"(spec.credentials.{self.field})")


CREDENTIALS = (
    Credential("huggingFaceToken", HF_TOKEN_ENV, "the Hugging Face token"),
    Credential("mlflowToken", "MLFLOW_TRACKING_TOKEN", "the MLflow token"),
    Credential("mlflowUsername", "MLFLOW_TRACKING_USERNAME", "the MLflow user name"),
    Credential("mlflowPassword", "MLFLOW_TRACKING_PASSWORD", "the MLflow password"),
    Credential("wandbApiKey", "WANDB_API_KEY", "the Weights & Biases API key"),
)
"""Every credential a LoRAJob can name; the variables are the ones huggingface_hub, MLflow and wandb read."""


def missing_credentials(environ: Mapping[str, str]) -> str | None:
    """Why the credentials a LoRAJob names did not all arrive (each missing one said), or None."""
    missing = [reason for credential in CREDENTIALS if (reason := credential.missing(environ))]
    return "; ".join(missing) or None
