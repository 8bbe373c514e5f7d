"""The environment variables the operator renders into a step's pods and the trainer reads.

Distributed start-up (`lorajob_trainer.distributed` reads them): `JAX_PLATFORMS` containing `proxy` is Pathways;
`JAX_NUM_PROCESSES` > 1 is multi-controller JAX, with `JAX_COORDINATOR_ADDRESS` (host or host:port, the port
defaulting to `JAX_COORDINATOR_PORT`, else 8476) and `JAX_PROCESS_ID`. The Hugging Face token: a secretKeyRef,
and where it should have come from.
"""

from __future__ import annotations

from collections.abc import Mapping

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
HF_TOKEN_SOURCE_ENV = "LORAJOB_HF_TOKEN_SECRET"
"""`<Secret name>/<key>` the token should come from: set by the operator, which never reads the Secret itself."""


def missing_token(environ: Mapping[str, str]) -> str | None:
    """Why the token a LoRAJob names did not arrive (no such Secret in its namespace, no such key, or an empty
    value); None when it did, or when none was named."""
    source = environ.get(HF_TOKEN_SOURCE_ENV)
    if not source or environ.get(HF_TOKEN_ENV):
        return None
    name, _, key = source.partition("/")
    return (f"the Hugging Face token is missing: no Secret {name} with a non-empty key {key} in the LoRAJob's "
            "namespace (spec.credentials.huggingFaceToken)")
