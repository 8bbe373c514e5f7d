"""MaxText checkpoints as base weights (maxtext.py), against fixtures written by MaxText itself.

Each fixture under fixtures/maxtext/ is MaxText 0.2.5's `to_maxtext` output for a tiny HF model
(make_fixtures.py; fixture.json says how to rebuild that HF source). Loading the fixture through the
MaxText path must give the Tunix parameters the HF path gives for its source: exactly, except Gemma's
norms, which MaxText stores as 1 + w (float32 rounding of that sum, at most 2^-24).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import Mesh
from safetensors.numpy import load_file
from trainer_testkit import arithmetic_rows, base_args, trainer_env, write_jsonl

from lorajob_trainer import convert, export, loading, lora, maxtext, models, tiny, weights
from lorajob_trainer.contract import exit_codes
from lorajob_trainer import train as train_lib

FIXTURES = Path(__file__).parent / "fixtures" / "maxtext"
NAMES = sorted(path.name for path in FIXTURES.iterdir() if (path / "fixture.json").is_file())
GEMMA_NORM_ROUNDING = 2.0**-24


def record(name: str) -> dict:
    return json.loads((FIXTURES / name / "fixture.json").read_text())


def items(name: str) -> Path:
    return FIXTURES / name / "0" / "items"


def model_name(name: str) -> str:
    return f"tiny-{record(name)['family']}"


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """The HF checkpoint a fixture was converted from, rebuilt from its seed (one per fixture)."""
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            spec = record(name)
            built[name] = tiny.make_tiny_checkpoint(
                spec["family"], tmp_path_factory.mktemp(name), seed=spec["seed"], **spec["overrides"]
            )
        return built[name]

    return build


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {weights.path_key(path): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def logits(model: nnx.Module) -> np.ndarray:
    tokens = jnp.asarray(np.random.default_rng(0).integers(5, tiny.VOCAB_SIZE, size=(2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    return np.asarray(models.forward(model, tokens, positions, jnp.ones((2, 12), jnp.int32)))


def differences(name: str, hf_dir: Path, mesh: Mesh) -> list[str]:
    """The Tunix parameters (and logits) where the MaxText load differs from the HF load beyond rounding."""
    reference, _ = loading.load_model(model_name(name), hf_dir, mesh=mesh, dtype=jnp.float32)
    loaded, spec = loading.load_model(model_name(name), items(name), mesh=mesh, dtype=jnp.float32, config_dir=hf_dir)
    assert spec.format == "maxtext" and spec.config_source == hf_dir and spec.tokenizer_path == hf_dir
    tolerance = GEMMA_NORM_ROUNDING if record(name)["family"] == "gemma3" else 0.0
    want, got = params(reference), params(loaded)
    assert sorted(want) == sorted(got)
    bad = [key for key in want if not np.allclose(got[key], want[key], rtol=0, atol=tolerance)]
    if not np.allclose(logits(loaded), logits(reference), rtol=1e-5, atol=1e-5):
        bad.append("logits")
    return bad


def test_fixtures_cover_every_family_and_layout():
    layouts = {(r["family"], r["scan_layers"], r["ocdbt_zarr3"]) for r in map(record, NAMES)}
    for family in maxtext.LAYOUTS:
        assert {(family, True, False), (family, False, False)} <= layouts
    assert any(ocdbt for _, _, ocdbt in layouts)


@pytest.mark.parametrize("name", NAMES)
def test_fixture_sources_rebuild_exactly(name, hf_source):
    digest = hashlib.sha256((hf_source(name) / "model.safetensors").read_bytes()).hexdigest()
    assert digest == record(name)["hf_safetensors_sha256"]


@pytest.mark.parametrize("name", NAMES)
def test_maxtext_checkpoint_loads_the_parameters_of_its_hf_source(name, hf_source, mesh):
    assert differences(name, hf_source(name), mesh) == []


def test_the_checkpoint_root_works_like_its_items_directory(hf_source, mesh):
    via_root, _ = loading.load_model(
        "tiny-qwen3", FIXTURES / "qwen3-scanned", mesh=mesh, dtype=jnp.float32, config_dir=hf_source("qwen3-scanned")
    )
    via_items, spec = loading.load_model(
        "tiny-qwen3", items("qwen3-scanned"), mesh=mesh, dtype=jnp.float32, config_dir=hf_source("qwen3-scanned")
    )
    assert spec.checkpoint == items("qwen3-scanned")
    for key, value in params(via_items).items():
        np.testing.assert_array_equal(params(via_root)[key], value)


def _without_convert(maps, ours_suffix):
    return [dataclasses.replace(m, convert=None) if m.ours.endswith(ours_suffix) else m for m in maps]


def _swap_sources(maps, a, b):
    swap = {a: b, b: a}
    return [dataclasses.replace(m, maxtext=tuple(swap.get(k, k) for k in m.maxtext)) for m in maps]


MUTATIONS = {
    "gemma norms kept as 1 + w": ("gemma3-scanned", lambda maps: _without_convert(maps, ".scale")),
    "gemma embedding kept scaled": ("gemma3-unscanned", lambda maps: _without_convert(maps, "input_embedding")),
    "llama query kept scaled": (
        "llama3-scanned",
        lambda maps: [dataclasses.replace(m, convert=maxtext._llama_key) if "q_proj" in m.ours else m for m in maps],
    ),
    "llama key kept interleaved": ("llama3-unscanned", lambda maps: _without_convert(maps, "k_proj.w")),
    "gate and up swapped": ("qwen3-scanned", lambda maps: _swap_sources(maps, "mlp.wi_0.kernel", "mlp.wi_1.kernel")),
    "expert gate and up swapped": (
        "qwen3-moe-unscanned",
        lambda maps: _swap_sources(maps, "moe_block.wi_0", "moe_block.wi_1"),
    ),
    "key and value swapped": (
        "gemma3-scanned",
        lambda maps: _swap_sources(maps, "self_attention.key.kernel", "self_attention.value.kernel"),
    ),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_wrong_mapping_is_caught(mutation, hf_source, mesh, monkeypatch):
    name, mutate = MUTATIONS[mutation]
    family = record(name)["family"]
    layout = maxtext.LAYOUTS[family]
    monkeypatch.setitem(maxtext.LAYOUTS, family, dataclasses.replace(layout, maps=lambda c: mutate(layout.maps(c))))
    assert differences(name, hf_source(name), mesh) != []


@pytest.mark.parametrize("name", ["qwen3-scanned", "gemma3-scanned"])
def test_a_wrong_layer_order_is_caught(name, hf_source, mesh, monkeypatch):
    layer_slots = maxtext.layer_slots
    monkeypatch.setattr(maxtext, "layer_slots", lambda *args: layer_slots(*args)[::-1])
    assert differences(name, hf_source(name), mesh) != []


def test_vocabulary_rows_the_checkpoint_lacks_load_as_zeros(tmp_path, hf_source, mesh):
    """MaxText's converter cuts Gemma 3's embedding to MaxText's vocab_size (262144 of 262208)."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.restore(items("gemma3-scanned"))
        tree["params"]["params"]["token_embedder"]["embedding"] = np.asarray(
            tree["params"]["params"]["token_embedder"]["embedding"]
        )[:240]
        checkpointer.save(tmp_path / "cut" / "0" / "items", tree)
    hf_dir = hf_source("gemma3-scanned")
    loaded, _ = loading.load_model("tiny-gemma3", tmp_path / "cut", mesh=mesh, dtype=jnp.float32, config_dir=hf_dir)
    reference, _ = loading.load_model("tiny-gemma3", hf_dir, mesh=mesh, dtype=jnp.float32)
    embedding, expected = params(loaded)["embedder.input_embedding"], params(reference)["embedder.input_embedding"]
    assert embedding.shape == expected.shape == (tiny.VOCAB_SIZE, 16)
    np.testing.assert_array_equal(embedding[:240], expected[:240])
    assert not embedding[240:].any()


# --- errors ------------------------------------------------------------------------------------


def test_other_shapes_name_the_parameter_and_both_shapes(tmp_path, mesh):
    wider = tiny.make_tiny_checkpoint("qwen3", tmp_path / "wider", seed=0, tokenizer=False)  # hidden 64, not 32
    with pytest.raises(weights.WeightsError) as error:
        loading.load_model("tiny-qwen3", items("qwen3-scanned"), mesh=mesh, config_dir=wider)
    message = str(error.value)
    assert "MaxText parameter " in message and "has shape (" in message and "implies (" in message
    assert "(256, 32)" in message and "(256, 64)" in message, message  # token_embedder.embedding


def test_another_family_is_refused(hf_source, mesh):
    gemma = hf_source("gemma3-scanned")
    with pytest.raises(weights.WeightsError, match=r"lacks \d+ parameters a gemma3 model .*is it a gemma3 MaxText"):
        loading.load_model("tiny-gemma3", items("qwen3-scanned"), mesh=mesh, config_dir=gemma)
    llama = hf_source("llama3-scanned")
    with pytest.raises(weights.WeightsError, match=r"holds 2 decoder parameters a llama3 model .* does not have"):
        loading.load_model("tiny-llama3", items("qwen3-scanned"), mesh=mesh, config_dir=llama)


def test_decoder_arrays_the_config_lacks_are_refused(tmp_path, hf_source, mesh):
    """A Qwen3 checkpoint under a Llama-shaped config would otherwise drop its q/k norms silently."""
    source = json.loads((hf_source("qwen3-scanned") / "config.json").read_text())
    as_llama = tiny.tiny_config("llama3", **{k: source[k] for k in ("hidden_size", "intermediate_size", "head_dim")})
    (tmp_path / "config.json").write_text(json.dumps(as_llama | {"tie_word_embeddings": False}))
    with pytest.raises(weights.WeightsError, match=r"does not have, e\.g\. \[.*query_norm"):
        loading.load_model("tiny-llama3", items("qwen3-scanned"), mesh=mesh, config_dir=tmp_path)


def test_a_missing_config_json_fails_before_loading_and_says_what_to_set(tmp_path, mesh, monkeypatch):
    monkeypatch.setattr(maxtext, "load_state", lambda *a, **k: pytest.fail("weights were read"))
    tokenizer_only = tiny.write_tiny_tokenizer(tmp_path / "tokenizer")
    with pytest.raises(weights.WeightsError) as error:
        loading.load_model("tiny-qwen3", items("qwen3-scanned"), mesh=mesh, config_dir=tokenizer_only)
    message = str(error.value)
    assert str(tokenizer_only / "config.json") in message and "tokenizer_path" in message, message
    with pytest.raises(weights.WeightsError, match="carries no config.json; set tokenizer_path"):
        loading.load_model("tiny-qwen3", items("qwen3-scanned"), mesh=mesh)


# --- training and export -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-scanned", "gemma3-scanned"])
def test_training_on_a_maxtext_base_runs_and_exports(name, hf_source, tmp_path, caplog):
    hf_dir = hf_source(name)
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(40))
    args = base_args(
        items(name), tmp_path / "out", train_file,
        f"model_name={model_name(name)}", f"tokenizer_path={hf_dir}", "steps=2", "dtype=float32",
        "checkpoint_period=2", "lora.lora_alpha=64",
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        assert train_lib.main(args) == 0, caplog.text
    checkpoints = tmp_path / "out" / "run" / "checkpoints"

    export_args = ["--checkpoint", str(checkpoints), "--merged"]
    export.main([*export_args, "--out", str(tmp_path / "hf"), "--base-config", str(hf_dir)])
    export.main([*export_args, "--out", str(tmp_path / "via-hf"), "--base", str(hf_dir)])
    merged = load_file(tmp_path / "hf" / "merged" / "model.safetensors")
    reference = load_file(tmp_path / "via-hf" / "merged" / "model.safetensors")
    tolerance = GEMMA_NORM_ROUNDING if record(name)["family"] == "gemma3" else 0.0
    assert sorted(merged) == sorted(reference)
    for key, value in reference.items():
        np.testing.assert_allclose(merged[key], value, rtol=0, atol=tolerance, err_msg=key)
    base = load_file(hf_dir / "model.safetensors")
    assert any(not np.array_equal(merged[key], base[key]) for key in base)  # the adapter changed something
    assert json.loads((tmp_path / "hf" / "merged" / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    assert (tmp_path / "hf" / "merged" / "tokenizer.json").is_file()
    assert json.loads((tmp_path / "hf" / "adapter_config.json").read_text())["r"] == 4

    # Without --base-config, export takes the config directory from the checkpoint metadata.
    adapters, metadata = lora.load_adapter_checkpoint(checkpoints)
    for recorded in (str(hf_dir), ""):
        lora.save_adapter_checkpoint(
            tmp_path / f"recorded-{bool(recorded)}", adapters, dataclasses.replace(metadata, tokenizer_path=recorded)
        )
    export.main(["--checkpoint", str(tmp_path / "recorded-True"), "--out", str(tmp_path / "recorded"), "--merged"])
    recorded = load_file(tmp_path / "recorded" / "merged" / "model.safetensors")
    assert all(np.array_equal(recorded[key], value) for key, value in merged.items())
    with pytest.raises(SystemExit, match="carries no config.json; set tokenizer_path .*--base-config"):
        export.main(["--checkpoint", str(tmp_path / "recorded-False"), "--out", str(tmp_path / "none"), "--merged"])


def test_training_without_a_config_json_exits_with_the_model_code_naming_tokenizer_path(tmp_path, capsys, caplog):
    tokenizer_only = tiny.write_tiny_tokenizer(tmp_path / "tokenizer")
    train_file = write_jsonl(tmp_path / "train.jsonl", arithmetic_rows(8))
    args = base_args(
        items("qwen3-scanned"), tmp_path / "out", train_file, f"tokenizer_path={tokenizer_only}", "steps=1"
    )
    with caplog.at_level(logging.ERROR):
        assert train_lib.main(args) == exit_codes.MODEL
    assert "set tokenizer_path" in capsys.readouterr().err + caplog.text


# --- gs:// -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-scanned", "qwen3-scanned-ocdbt", "gemma3-unscanned"])
def test_maxtext_base_loads_from_gs(name, gcs, hf_source, mesh):
    shutil.copytree(FIXTURES / name, gcs / "bucket" / "maxtext")
    shutil.copytree(hf_source(name), gcs / "bucket" / "hf")
    from_gs, spec = loading.load_model(
        model_name(name), "gs://bucket/maxtext", mesh=mesh, dtype=jnp.float32, config_dir="gs://bucket/hf"
    )
    local, _ = loading.load_model(
        model_name(name), items(name), mesh=mesh, dtype=jnp.float32, config_dir=hf_source(name)
    )
    assert str(spec.checkpoint) == "gs://bucket/maxtext/0/items"
    for key, value in params(local).items():
        np.testing.assert_array_equal(params(from_gs)[key], value)


def test_our_orbax_base_loads_from_gs_and_hf_on_gs_is_refused(gcs, hf_source, mesh):
    hf_dir = hf_source("qwen3-scanned")
    shutil.copytree(hf_dir, gcs / "bucket" / "hf")
    convert.main(["base", "--model-name", "tiny-qwen3", "--hf", "gs://bucket/hf", "--out", "gs://bucket/base",
                  "--dtype", "float32"])  # fmt: skip
    from_gs, spec = loading.load_model("tiny-qwen3", "gs://bucket/base", mesh=mesh, dtype=jnp.float32)
    local, _ = loading.load_model("tiny-qwen3", hf_dir, mesh=mesh, dtype=jnp.float32)
    assert spec.format == "orbax" and str(spec.tokenizer_path) == "gs://bucket/base"
    for key, value in params(local).items():
        np.testing.assert_array_equal(params(from_gs)[key], value)
    with pytest.raises(weights.WeightsError, match="on gs://.*convert it first"):
        loading.load_model("tiny-qwen3", "gs://bucket/hf", mesh=mesh)


# --- several devices ---------------------------------------------------------------------------

MULTI_DEVICE_SCRIPT = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from flax import nnx
from lorajob_trainer import loading, maxtext, weights
restore = weights.restore_orbax_params
restored_shards = {}
def recording_restore(location, targets, **kwargs):
    arrays = restore(location, targets, **kwargs)
    restored_shards.update({k: [list(s.data.shape) for s in a.addressable_shards] for k, a in arrays.items()})
    return arrays
weights.restore_orbax_params = recording_restore
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("fsdp", "tp"))
model, _ = loading.load_model("tiny-qwen3", sys.argv[1], mesh=mesh, dtype=jnp.float32, config_dir=sys.argv[2])
q = model.layers[1].attn.q_proj.w.get_value()
print(json.dumps({
    "query_shards": restored_shards["params.params.decoder.layers.self_attention.query.kernel"],
    "q_proj_shards": [list(s.data.shape) for s in q.addressable_shards],
    "params": {weights.path_key(p): np.asarray(v.get_value()).tolist() for p, v in nnx.to_flat_state(nnx.state(model))},
}))
"""


def test_maxtext_arrays_are_restored_sharded_over_a_2x2_mesh(hf_source, mesh):
    """Each device receives only its shard of the stacked MaxText arrays, and the result matches one device."""
    env = trainer_env(devices=4)
    hf_dir = hf_source("qwen3-scanned")
    result = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE_SCRIPT, str(items("qwen3-scanned")), str(hf_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    # query kernel [embed 32, layers 2, heads 4, head_dim 8]: embed over fsdp, heads over tp, like q_proj [32, 4, 8]
    assert report["query_shards"] == [[16, 2, 2, 8]] * 4
    assert report["q_proj_shards"] == [[16, 2, 8]] * 4
    reference, _ = loading.load_model("tiny-qwen3", hf_dir, mesh=mesh, dtype=jnp.float32)
    for key, value in params(reference).items():
        np.testing.assert_array_equal(np.array(report["params"][key], dtype=np.float32), value, err_msg=key)
