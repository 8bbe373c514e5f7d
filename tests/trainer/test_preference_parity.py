"""DPO and ORPO against TRL: our preference step and TRL's DPOTrainer / ORPOTrainer on the same tiny model, adapters
and preference rows give the same loss, rewards and adapter gradients (float32, CPU).

Our side is the real jitted train step (step.build_preference_steps) with plain SGD at learning rate 1 and no
clipping, so the adapters it returns are the adapters less the gradient. TRL's side is its trainer's own loss
function on a batch from its own data pipeline, on a PEFT model loaded from our exported adapter; the reference is
the base with the adapters disabled, ours the adapters as initialised (B = 0), the same model.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from lorajob_trainer import data as data_lib
from lorajob_trainer import lora as lora_lib
from lorajob_trainer import mesh as mesh_lib
from lorajob_trainer import run as run_lib
from lorajob_trainer.checkpoint import CheckpointMetadata
from lorajob_trainer.contract.config import TrainConfig
from trainer_testkit import base_args, random_adapters, tiny_checkpoint

pytestmark = [pytest.mark.torch, pytest.mark.slow(minutes=3)]

TOLERANCE = 1e-5
"""On the loss, the rewards and the log-probabilities (relative above 1), and on the gradients relative to the
largest gradient (float32 in both, summed in a different order)."""
PAIRS = [
    ("what is 12 plus 30?", "the answer is 42.", "maybe 41"),
    ("what is 25 plus 17?", "the answer is 42.", "it is 43, i think"),
    ("what is 40 plus 9?", "the answer is 49.", "no idea"),
]
CASES = {
    "dpo-sigmoid": ["method=dpo", "preference.beta=0.5"],
    "dpo-ipo": ["method=dpo", "preference.beta=0.5", "preference.loss_type=ipo"],
    "dpo-robust": ["method=dpo", "preference.beta=0.5", "preference.loss_type=robust", "preference.label_smoothing=0.2"],
    "orpo": ["method=orpo", "preference.orpo_lambda=0.3"],
    "dpo-rslora": ["method=dpo", "preference.beta=0.5", "lora.use_rslora=true"],
    "dpo-dora": ["method=dpo", "preference.beta=0.5", "lora.use_dora=true"],
}
"""rsLoRA and DoRA change the adapted weights, not the preference loss: checked with DPO's default loss only (the
reference is their adapters as initialised too, DoRA's magnitudes the weights' norms)."""


def conversational_rows() -> list[dict]:
    return [{"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
             "rejected": [{"role": "assistant", "content": rejected}]} for prompt, chosen, rejected in PAIRS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), seed=3)


def our_config(model_dir: Path, tmp_path: Path, case: str) -> TrainConfig:
    return TrainConfig.from_args(base_args(
        model_dir, tmp_path, tmp_path / "unused.jsonl", "steps=1", f"per_device_batch_size={len(PAIRS)}",
        "train_data_columns=['prompt','chosen','rejected']", "dtype=float32", "gradient_clipping_threshold=0",
        *CASES[case],
    ))


def our_batch(config: TrainConfig, pairs: list[data_lib.EncodedPair]) -> dict[str, np.ndarray]:
    """One micro-batch [1, rows, length] of the pairs, two rows each, as data.PairedRows lays them out."""
    batch = data_lib.empty_rows(2 * len(pairs), config.max_target_length)
    for index, pair in enumerate(pairs):
        for offset, example in enumerate((pair.chosen, pair.rejected)):
            data_lib.place(batch, 2 * index + offset, 0, example, len(example.tokens) - 1, segment=1)
    return {name: values[None] for name, values in batch.items()}


def our_run(config: TrainConfig) -> run_lib.Run:
    """The run of `config` on one CPU device with plain SGD at learning rate 1."""
    mesh = mesh_lib.build_mesh(config.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = run_lib.loaded_model(config, mesh, jnp.float32)
        return run_lib.build(config.step_shape, optax.sgd(1.0), model, mesh, jnp.float32, "none",
                             objective=run_lib.objective_of(config))


def our_step(run: run_lib.Run, policy: dict[str, np.ndarray], batch: dict[str, np.ndarray]):
    """(step metrics, gradients) of one train step from `policy`."""
    with jax.set_mesh(run.mesh):
        adapters = {name: jax.device_put(value, run.shardings["lora"][name]) for name, value in policy.items()}
        batch = {name: jax.device_put(values, run.shardings["batch"]) for name, values in batch.items()}
        reference = (run.adapters(),) if run.steps.takes_reference else ()
        updated, _, metrics = run.steps.train(adapters, run.optimizer_state(adapters), run.base, batch, *reference)
    return jax.device_get(metrics), {name: policy[name] - np.asarray(updated[name]) for name in policy}


def encoded(prompt: list[int], answer: list[int]) -> data_lib.EncodedExample:
    return data_lib.EncodedExample(np.asarray(prompt + answer, np.int32),
                                   np.asarray([False] * len(prompt) + [True] * len(answer)))


def trl_pairs(trainer) -> list[data_lib.EncodedPair]:
    """The pairs as TRL's trainer tokenized them: DPO's prompt/chosen/rejected ids, ORPO's sequences and labels."""
    pairs = []
    for row in trainer.train_dataset:
        if "prompt_ids" in row:
            pairs.append(data_lib.EncodedPair(encoded(row["prompt_ids"], row["chosen_ids"]),
                                              encoded(row["prompt_ids"], row["rejected_ids"])))
            continue
        answers = []
        for side in ("chosen", "rejected"):
            tokens, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
            prompt_length = sum(label == -100 for label in labels)
            answers.append(encoded(tokens[:prompt_length], tokens[prompt_length:]))
        pairs.append(data_lib.EncodedPair(*answers))
    return pairs


def peft_named(params: dict[str, np.ndarray], config: TrainConfig) -> dict[str, np.ndarray]:
    num_layers = 1 + max(int(name.split(".")[1]) for name in params if name.startswith("layers."))
    tensors, _ = lora_lib.to_peft(params, config.family, num_layers, config.lora.lora_rank)
    return tensors


def exported_adapter(config: TrainConfig, model_dir: Path, policy: dict[str, np.ndarray], directory: Path) -> Path:
    """Our policy adapters exported in PEFT's format."""
    from lorajob_trainer import export

    metadata = CheckpointMetadata(
        step=1, lora_rank=config.lora.lora_rank, lora_alpha=config.lora.lora_alpha,
        use_rslora=config.lora.use_rslora, use_dora=config.lora.use_dora,
        target_modules=lora_lib.default_targets(config.family), lora_module_path="", base_model=config.model_name,
        family=config.family, load_parameters_path=str(model_dir),
    )
    step_dir = lora_lib.save_adapter_checkpoint(directory / "checkpoint", policy, metadata)
    return export.export_adapter(step_dir, directory / "adapter")


def trl_trainer(case: str, model_dir: Path, adapter: Path, tokenizer, directory: Path):
    """TRL's trainer of the case over the rows, with a fresh adapter of the exported adapter's config (so its
    reference is the base with the adapters disabled) into which the exported adapter's weights are loaded."""
    import datasets
    import torch
    import transformers
    from peft import LoraConfig, set_peft_model_state_dict
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    peft_config = LoraConfig.from_pretrained(adapter)
    peft_config.inference_mode = False  # an exported adapter is saved for inference; here it trains
    rows = datasets.Dataset.from_list(conversational_rows())
    common = dict(output_dir=str(directory / "trl"), per_device_train_batch_size=len(PAIRS), report_to=[],
                  use_cpu=True, bf16=False, max_length=None, seed=0, dataloader_drop_last=False)
    settings = dict(arg.split("=", 1) for arg in CASES[case])
    if settings["method"] == "dpo":
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(**common, beta=float(settings["preference.beta"]),
                         loss_type=[settings.get("preference.loss_type", "sigmoid")],
                         label_smoothing=float(settings.get("preference.label_smoothing", 0.0)))
        trainer = DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                             peft_config=peft_config)
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        args = ORPOConfig(**common, beta=float(settings["preference.orpo_lambda"]))
        trainer = ORPOTrainer(model=model, args=args, train_dataset=rows, processing_class=tokenizer,
                              peft_config=peft_config)
    loaded = set_peft_model_state_dict(trainer.model, load_file(adapter / "adapter_model.safetensors"))
    assert not loaded.unexpected_keys
    return trainer


def peft_key(parameter_name: str) -> str:
    """A PEFT model's parameter name as its saved adapter names the tensor (a DoRA magnitude without `.weight`)."""
    key = parameter_name.replace(".default", "")
    return key.removesuffix(".weight") if key.endswith("lora_magnitude_vector.weight") else key


def trl_step(trainer) -> tuple[float, dict[str, np.ndarray]]:
    """(TRL's loss, the adapters' gradients by PEFT name) for one batch of all pairs."""
    model = trainer.model
    batch = next(iter(trainer.get_train_dataloader()))
    model.train()
    model.zero_grad()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    gradients = {peft_key(name): parameter.grad.detach().numpy()
                 for name, parameter in model.named_parameters() if "lora_" in name}
    return float(loss.detach()), gradients


def logged(trainer, name: str) -> float:
    """A metric the TRL trainer logged for the batch (ORPO's are in its stored metrics)."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics and metrics["train"].get(name):
        return metrics["train"][name][-1]
    return float(np.mean(trainer._stored_metrics["train"][name]))


@pytest.mark.parametrize("case", list(CASES))
def test_preference_step_equals_trl(case, model_dir, tmp_path):
    tokenizer = data_lib.load_tokenizer(str(model_dir))
    config = our_config(model_dir, tmp_path, case)
    run = our_run(config)
    policy = random_adapters(jax.device_get(run.adapters()))
    trainer = trl_trainer(case, model_dir, exported_adapter(config, model_dir, policy, tmp_path), tokenizer, tmp_path)
    pairs = trl_pairs(trainer)
    if config.method == "dpo":  # TRL's DPO tokenizes conversations as our data pipeline does (its ORPO does not)
        ours = [data_lib.encode_pair(tokenizer, row, config.train_data_columns) for row in conversational_rows()]
        for our_pair, trl_pair in zip(ours, pairs, strict=True):
            for mine, theirs in ((our_pair.chosen, trl_pair.chosen), (our_pair.rejected, trl_pair.rejected)):
                np.testing.assert_array_equal(mine.tokens, theirs.tokens)
                np.testing.assert_array_equal(mine.loss_mask, theirs.loss_mask)

    metrics, our_gradients = our_step(run, policy, our_batch(config, pairs))
    trl_loss, trl_gradients = trl_step(trainer)

    assert abs(float(metrics["loss"]) - trl_loss) <= TOLERANCE, (float(metrics["loss"]), trl_loss)
    for ours, theirs in (("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
                         ("chosen_logps", "logps/chosen"), ("rejected_logps", "logps/rejected")):
        assert abs(float(metrics[ours]) - logged(trainer, theirs)) <= TOLERANCE * max(1.0, abs(float(metrics[ours]))), (
            ours, float(metrics[ours]), logged(trainer, theirs))
    assert float(metrics["reward_margin"]) != 0.0  # the policy and the reference differ
    ours_by_peft = peft_named(our_gradients, config)
    assert set(ours_by_peft) == set(trl_gradients)
    largest = max(float(np.abs(g).max()) for g in trl_gradients.values())
    assert largest > 100 * TOLERANCE  # the gradients are not all (nearly) zero
    for name, gradient in trl_gradients.items():
        np.testing.assert_allclose(ours_by_peft[name], gradient, atol=TOLERANCE * largest, rtol=0, err_msg=name)
    worst = max(float(np.abs(ours_by_peft[name] - gradient).max()) for name, gradient in trl_gradients.items())
    print(f"{case}: loss {float(metrics['loss']):.6f} vs TRL {trl_loss:.6f} (|d| {abs(float(metrics['loss']) - trl_loss):.1e}); "
          f"gradients: worst |d| {worst:.1e} of largest {largest:.2f} ({worst / largest:.1e} relative)")
