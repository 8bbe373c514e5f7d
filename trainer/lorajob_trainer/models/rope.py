"""Rotary position embeddings as Hugging Face defines them (default, linear, Llama 3.1 scaling), for the
attention that applies them (models/attention.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RopeConfigError(ValueError):
    """config.json asks for a RoPE variant this trainer does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, parameters: dict[str, Any]) -> RopeSpec:
        """From one `rope_parameters` dict (transformers >= 5) or `{rope_theta, **rope_scaling}` (4.x)."""
        rope_type = parameters.get("rope_type") or parameters.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise RopeConfigError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if parameters.get("rope_theta") is None:
            raise RopeConfigError("config.json has no rope_theta")
        spec = cls(theta=float(parameters["rope_theta"]), rope_type=rope_type)
        if rope_type == "linear":
            spec = dataclasses.replace(spec, factor=float(parameters["factor"]))
        if rope_type == "llama3":
            spec = dataclasses.replace(
                spec,
                factor=float(parameters["factor"]),
                low_freq_factor=float(parameters["low_freq_factor"]),
                high_freq_factor=float(parameters["high_freq_factor"]),
                original_max_position_embeddings=int(parameters["original_max_position_embeddings"]),
            )
        return spec


def inverse_frequencies(spec: RopeSpec, head_dim: int) -> np.ndarray:
    """float32[head_dim // 2], the same values transformers' rope initialisers compute."""
    inv_freq = 1.0 / (spec.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    if spec.rope_type == "linear":
        return (inv_freq / spec.factor).astype(np.float32)
    if spec.rope_type == "llama3":
        return _llama3_scaled(inv_freq, spec).astype(np.float32)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, spec: RopeSpec) -> np.ndarray:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between blended.
    old_context = spec.original_max_position_embeddings
    low_freq_wavelen = old_context / spec.low_freq_factor
    high_freq_wavelen = old_context / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_context / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    blended = (1 - smooth) * scaled / spec.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def apply_rope(inputs, positions, head_dim: int, *, spec: RopeSpec):
    """Rotate `inputs` [B, L, heads, head_dim] by `positions` [B, L] (half-split layout, as in HF)."""
    inv_freq = jnp.asarray(inverse_frequencies(spec, head_dim))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, L, head_dim // 2]
    angles = angles[..., None, :]
    sin, cos = jnp.sin(angles).astype(inputs.dtype), jnp.cos(angles).astype(inputs.dtype)
    first, second = jnp.split(inputs, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(inputs.dtype)

