"""Greedy generation with a KV cache (generate.py) equals generating one token at a time with a full forward over the
unpadded sequence, token for token, for every family (Gemma 4 with scanned layers, and with per-layer inputs and
KV-shared layers), with the adapters as they start (the base model) and trained ones; ragged prompts share a batch,
a batch is padded, and a row that emits a stop token stops there."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from trainer_testkit import arithmetic_rows, base_args, gemma4_checkpoint, tiny_checkpoint, write_jsonl

from lorajob_trainer import evaluate, models
from lorajob_trainer import train as train_lib
from lorajob_trainer.contract.config import TrainConfig

FAMILIES = ["qwen3", "llama3", "gemma3", "qwen3-moe", "gemma4", "gemma4-e2b"]
MAX_NEW_TOKENS = 6


GEMMA4_SHAPES = {"gemma4": "gemma4-26b", "gemma4-e2b": "gemma4-e2b"}


def _checkpoint(directory: Path, family: str) -> Path:
    if family not in GEMMA4_SHAPES:
        return tiny_checkpoint(directory, family)
    from lorajob_trainer import tiny

    gemma4_checkpoint(directory, GEMMA4_SHAPES[family], seed=3)
    tiny.write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def trainer(request, tmp_path_factory) -> train_lib.Trainer:
    root = tmp_path_factory.mktemp(request.param)
    model_dir = _checkpoint(root / "model", request.param)
    data = write_jsonl(root / "data.jsonl", arithmetic_rows(8))
    config = TrainConfig.from_args(base_args(
        model_dir, root / "out", data, f"model_name={'tiny-gemma4' if request.param in GEMMA4_SHAPES else f'tiny-{request.param}'}", f"hf_eval_files=['{data}']", "steps=1",
        "generation_eval.enabled=true", f"generation_eval.max_new_tokens={MAX_NEW_TOKENS}",
    ))
    built = train_lib.build_trainer(config)
    yield built
    built.close()


def _one_at_a_time(forward, prompt: list[int], stop_ids: set[int], width: int) -> tuple[list[int], bool]:
    """Greedy tokens from forwards over the sequence so far alone (the rest of a fixed-width row is padding,
    segment 0, which nothing attends to: one compile serves every length)."""
    tokens, generated = list(prompt), []
    for _ in range(MAX_NEW_TOKENS):
        row = np.zeros((1, width), np.int32)
        row[0, : len(tokens)] = tokens
        segments = (np.arange(width) < len(tokens)).astype(np.int32)[None]
        chosen = int(jnp.argmax(forward(row, segments)[0, len(tokens) - 1]))
        generated.append(chosen)
        tokens.append(chosen)
        if chosen in stop_ids:
            return generated, True
    return generated, False


def _forward(trainer):
    """Logits of the trainer's model with given adapters (one compile for the base's and the trained ones)."""

    @jax.jit
    def forward(adapters, tokens, segments):
        model = nnx.merge(trainer.run.graphdef, trainer.run.layout.state(adapters), trainer.run.base)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return models.forward(model, tokens, positions, segments)

    return forward


def _trained(adapters: dict[str, jax.Array]) -> dict[str, jax.Array]:
    keys = jax.random.split(jax.random.key(1), len(adapters))
    return {name: value + 0.3 * jax.random.normal(key, value.shape, value.dtype)
            for key, (name, value) in zip(keys, sorted(adapters.items()))}


def test_generation_equals_one_full_forward_per_token(trainer):
    prompts = [evaluate.prompt_tokens(trainer.tokenizer, [{"role": "user", "content": text}], 48)
               for text in ("what is 12 plus 30?", "add", "what is the answer to 7 plus 9 plus 11?")]
    assert len({len(p) for p in prompts}) == 3, "ragged prompts"
    trained = _trained(trainer.base_adapters)
    outputs, forward_with = {}, _forward(trainer)
    with jax.set_mesh(trainer.mesh):
        for name, adapters in (("base", trainer.base_adapters), ("trained", trained)):
            forward, width = partial(forward_with, adapters), max(map(len, prompts)) + MAX_NEW_TOKENS
            free = [_one_at_a_time(forward, p, set(), width)[0] for p in prompts]
            # A stop token the first prompt reaches at its third token: that row stops, the others need not.
            stop_ids = [free[0][2]]
            expected = [_one_at_a_time(forward, p, set(stop_ids), width) for p in prompts]
            generator = trainer.run.generator(MAX_NEW_TOKENS, stop_ids)
            got = generator.generate(adapters, trainer.run.base, prompts, batch_rows=generator.batch_rows(2))
            assert [(g.tokens, g.stopped) for g in got] == expected, name
            assert got[0].stopped and len(got[0].tokens) == free[0].index(stop_ids[0]) + 1
            outputs[name] = free
    assert outputs["base"] != outputs["trained"], "the adapters take part in generation"


def test_the_base_adapters_compute_the_base_model(trainer):
    """The adapters kept for the base's generations change nothing: B is zero (and DoRA's magnitudes are the norms)."""
    lora_b = {name: value for name, value in trainer.base_adapters.items() if "lora_b" in name}
    assert lora_b and all(not np.any(np.asarray(value)) for value in lora_b.values())
