"""config.json as current transformers writes it: for every family, the config a checkpoint was released with and
the one the pinned transformers' `save_pretrained` writes for the same model (renamed keys: `rope_parameters` for
`rope_theta`, `num_local_experts` for `num_experts`, defaults filled in) build the same model. (Gemma 4's tiny
checkpoints are written by transformers itself: trainer_testkit.gemma4_checkpoint.)"""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from lorajob_trainer import models, tiny

pytestmark = pytest.mark.torch


def _saved_by_transformers(released: dict, directory) -> dict:
    import transformers

    config = transformers.AutoConfig.for_model(**released)
    config.save_pretrained(directory)
    return json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("family", tiny.TINY_CONFIGS)
def test_the_released_and_the_re_saved_config_build_the_same_model(family, tmp_path):
    released = tiny.tiny_config(family)
    saved = _saved_by_transformers(released, tmp_path)
    assert saved != released  # transformers did rewrite it
    built = models.family_for_hf_config(released)
    assert models.family_for_hf_config(saved) is built
    assert built.config_from_hf(saved, jnp.float32) == built.config_from_hf(released, jnp.float32)
