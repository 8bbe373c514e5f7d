"""convert.py / export.py / weights.py: formats, round trips, paths and error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from lorajob_trainer import convert, export, loading, lora, models, tiny, weights
from lorajob_trainer.models.families import TensorMap
from safetensors.numpy import load_file, save_file
from trainer_testkit import trainer_env

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return tiny.make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), seed=4)


def logits(model, length: int = 16) -> np.ndarray:
    ids = jnp.asarray(np.random.default_rng(0).integers(0, tiny.VOCAB_SIZE, (2, length)))
    positions = jnp.tile(jnp.arange(length), (2, 1))
    return np.asarray(models.forward(model, ids, positions, jnp.ones_like(ids)))


# --- HF PEFT adapter -> trainer checkpoint -> HF PEFT adapter ----------------------------------


def make_peft_adapter(family: str, base: Path, out: Path, *, variant: str = "lora") -> Path:
    """A random PEFT adapter (rank 4, every A and B distinct) on the tiny `family` model at `base`, on the
    family's default targets (routed experts through PEFT's `target_parameters`); `variant` rslora: PEFT's
    use_rslora; dora: use_dora on the projections (no experts), each magnitude moved randomly by ~10 % off its
    start (the weight's norm with the random update; at ~30 % Gemma 4 E2B's logits drift 1.8e-4 from PEFT's in
    float32, each module alone under 1e-4: rounding that the magnitudes amplify)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    modules, parameters = lora.peft_target_lists(family, lora.default_targets(family))
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=modules,
        target_parameters=(parameters or None) if variant != "dora" else None,
        init_lora_weights=False,
        lora_dropout=0.0,
        use_rslora=variant == "rslora",
        use_dora=variant == "dora",
    )
    peft_model = get_peft_model(hf, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.mul_(1 + 0.1 * torch.randn_like(parameter))
    peft_model.save_pretrained(out)
    return out


@pytest.mark.torch
@pytest.mark.parametrize(("family", "variant"), [
    ("qwen3", "lora"), ("llama3", "lora"), ("gemma3", "lora"), ("qwen3-moe", "lora"), ("qwen3", "dora"), ("qwen3-moe", "dora"),
])
def test_peft_adapter_round_trips_bit_exactly(family, variant, tmp_path):
    base = tiny.make_tiny_checkpoint(family, tmp_path / "base", tokenizer=False)
    adapter = make_peft_adapter(family, base, tmp_path / "adapter", variant=variant)
    step_dir = convert.convert_adapter(f"tiny-{family}", base, adapter, tmp_path / "converted")
    exported = export.export_adapter(step_dir, tmp_path / "exported", base_name="my/base")

    original, again = (
        load_file(adapter / "adapter_model.safetensors"),
        load_file(exported / "adapter_model.safetensors"),
    )
    assert sorted(original) == sorted(again)
    for name in original:
        assert original[name].dtype == again[name].dtype and np.array_equal(original[name], again[name]), name
    config = json.loads((exported / "adapter_config.json").read_text())
    modules, parameters = lora.peft_target_lists(family, lora.default_targets(family))
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8.0, sorted(modules))
    assert config.get("target_parameters", []) == (parameters if variant == "lora" else [])
    assert config["base_model_name_or_path"] == "my/base" and config["use_dora"] == (variant == "dora")
    assert any(name.endswith("lora_magnitude_vector") for name in original) == (variant == "dora")


@pytest.mark.torch
def test_a_dora_adapter_without_its_magnitudes_is_refused(tmp_path):
    base = tiny.make_tiny_checkpoint("qwen3", tmp_path / "base", tokenizer=False)
    adapter = make_peft_adapter("qwen3", base, tmp_path / "adapter", variant="dora")
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "magnitude" not in k}, adapter / "adapter_model.safetensors")
    with pytest.raises(lora.LoraError, match=r"a DoRA adapter needs .*q_proj.lora_magnitude_vector with \d+ values"):
        convert.convert_adapter("tiny-qwen3", base, adapter, tmp_path / "out")


def write_adapter(directory: Path, config: dict, tensors: dict[str, np.ndarray]) -> Path:
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


@pytest.mark.parametrize(
    ("config_change", "message"),
    [
        ({"target_modules": "all-linear"}, "explicit list"),
        ({"target_modules": ["fc1"]}, "unknown target modules"),
        ({"peft_type": "IA3"}, "not LORA"),
    ],
    ids=["regex-targets", "unknown-module", "not-lora"],
)
def test_bad_adapter_configs_are_rejected(config_change, message, qwen3_dir, tmp_path):
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **config_change}
    adapter = write_adapter(tmp_path / "adapter", config, {"x": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=message):
        convert.convert_adapter("tiny-qwen3", qwen3_dir, adapter, tmp_path / "out")


def test_adapter_with_missing_tensor_is_rejected(qwen3_dir, tmp_path):
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    adapter = write_adapter(tmp_path / "adapter", config, {"x": np.zeros(1, np.float32)})
    with pytest.raises(lora.LoraError, match="adapter lacks base_model.model.model.layers.0.self_attn.q_proj"):
        convert.convert_adapter("tiny-qwen3", qwen3_dir, adapter, tmp_path / "out")


def test_missing_adapter_files_are_named(qwen3_dir, tmp_path):
    (tmp_path / "adapter").mkdir()
    with pytest.raises(convert.ConvertError, match="adapter_config.json is missing"):
        convert.convert_adapter("tiny-qwen3", qwen3_dir, tmp_path / "adapter", tmp_path / "out")


def test_export_cli_reports_a_non_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="export failed: .* is not a LoRA checkpoint"):
        export.main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "out")])


# --- base checkpoints --------------------------------------------------------------------------


def test_orbax_base_checkpoint_loads_the_same_model(qwen3_dir, mesh, tmp_path):
    converted = convert.convert_base("tiny-qwen3", qwen3_dir, tmp_path / "base", dtype=jnp.float32)
    from_hf, _ = loading.load_model("tiny-qwen3", qwen3_dir, mesh=mesh, dtype=jnp.float32)
    from_orbax, spec = loading.load_model("tiny-qwen3", converted, mesh=mesh, dtype=jnp.float32)
    assert spec.format == "orbax" and spec.tokenizer_path == converted
    np.testing.assert_array_equal(logits(from_orbax), logits(from_hf))
    with pytest.raises(convert.ConvertError, match="already holds"):
        convert.convert_base("tiny-qwen3", qwen3_dir, converted)


def test_command_lines_write_a_tiny_model_and_a_base_checkpoint(tmp_path, capsys):
    tiny.main(["--family", "llama3", "--out", str(tmp_path / "hf"), "--shards", "2"])
    convert.main(["base", "--model-name", "tiny-llama3", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "base")])
    assert json.loads((tmp_path / "base" / weights.BASE_MARKER).read_text())["family"] == "llama3"
    assert (tmp_path / "base" / "tokenizer.json").is_file() and (tmp_path / "base" / "params").is_dir()
    with pytest.raises(SystemExit, match="convert failed: .* holds a llama3 model but 'tiny-qwen3' is a qwen3"):
        convert.main(
            ["base", "--model-name", "tiny-qwen3", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "b2")]
        )


def test_relative_paths_are_made_absolute(qwen3_dir, mesh, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    relative = Path(os.path.relpath(qwen3_dir, tmp_path))
    _, spec = loading.load_model("tiny-qwen3", relative, mesh=mesh, dtype=jnp.float32)
    assert spec.checkpoint.is_absolute() and spec.checkpoint == qwen3_dir.absolute()
    converted = convert.convert_base("tiny-qwen3", relative, Path("rel-base"), dtype=jnp.float32)
    assert converted == tmp_path / "rel-base"
    _, orbax_spec = loading.load_model("tiny-qwen3", Path("rel-base"), mesh=mesh, dtype=jnp.float32)
    assert orbax_spec.checkpoint == tmp_path / "rel-base"


def test_sharded_safetensors_load_like_one_file(qwen3_dir, mesh, tmp_path):
    sharded = tiny.make_tiny_checkpoint("qwen3", tmp_path / "sharded", seed=4, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    one, _ = loading.load_model("tiny-qwen3", qwen3_dir, mesh=mesh, dtype=jnp.float32)
    three, _ = loading.load_model("tiny-qwen3", sharded, mesh=mesh, dtype=jnp.float32)
    np.testing.assert_array_equal(logits(one), logits(three))


def test_bfloat16_safetensors_load(qwen3_dir, mesh, tmp_path):
    import ml_dtypes

    bf16 = tmp_path / "bf16"
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(qwen3_dir / "model.safetensors").items()}
    tiny.write_hf_checkpoint(bf16, json.loads((qwen3_dir / "config.json").read_text()), tensors)
    model, _ = loading.load_model("tiny-qwen3", bf16, mesh=mesh, dtype=jnp.bfloat16)
    assert model.layers[0].attn.q_proj.w.get_value().dtype == jnp.bfloat16
    assert np.isfinite(logits(model)).all()


@pytest.mark.parametrize(
    ("tmap", "shape"),
    [
        (TensorMap("q", ("q",), "(n h) d", "d n h"), (6, 4, 3)),
        (TensorMap("o", ("o",), "d (n h)", "n h d"), (4, 3, 6)),
        (TensorMap("kv", ("k", "v"), "(n h) d", "c n d h"), (2, 4, 6, 3)),
        (TensorMap("w", ("w",), "f d", "d f"), (6, 5)),
    ],
    ids=["q", "o", "stacked-kv", "linear"],
)
def test_read_slice_equals_slicing_the_whole_tensor(tmap, shape, tmp_path):
    full = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    save_file({name: part for name, part in zip(tmap.hf, weights.to_hf(tmap, full))}, tmp_path / "w.safetensors")
    source = weights.SafetensorsDir(tmp_path)
    rng = np.random.default_rng(1)
    for _ in range(20):
        index = []
        for dim in shape:
            start = int(rng.integers(0, dim))
            index.append(slice(start, int(rng.integers(start + 1, dim + 1))))
        index = tuple(index)
        np.testing.assert_array_equal(weights.read_slice(source, "", tmap, shape, index), full[index])


@pytest.mark.parametrize("chunk_bytes", [1, 40, 100, weights.SafetensorsDir.CHUNK_BYTES])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_chunked_reads_equal_slicing_the_whole_tensor(chunk_bytes, dtype, tmp_path, monkeypatch):
    """Reads go through bounded row chunks (down to one row per read); any slice equals numpy's."""
    monkeypatch.setattr(weights.SafetensorsDir, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(2)
    tensors = {"m": rng.standard_normal((13, 7, 5)).astype(dtype), "s": np.asarray(3.5, dtype=dtype)}
    save_file(tensors, tmp_path / "w.safetensors")
    source = weights.SafetensorsDir(tmp_path)
    np.testing.assert_array_equal(source.read("s"), tensors["s"])
    for _ in range(20):
        index = tuple(
            slice(start, int(rng.integers(start + 1, dim + 1)))
            for dim in tensors["m"].shape
            for start in [int(rng.integers(0, dim))]
        )
        np.testing.assert_array_equal(source.read("m", index), tensors["m"][index])


def test_truncated_safetensors_file_is_named(tmp_path):
    save_file({"m": np.ones((64, 64), np.float32)}, tmp_path / "w.safetensors")
    data = (tmp_path / "w.safetensors").read_bytes()
    (tmp_path / "w.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(weights.WeightsError, match="w.safetensors"):
        weights.SafetensorsDir(tmp_path).read("m")


def test_missing_tensor_is_named(qwen3_dir, mesh, tmp_path):
    tensors = load_file(qwen3_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    broken = tiny.write_hf_checkpoint(tmp_path / "broken", json.loads((qwen3_dir / "config.json").read_text()), tensors)
    with pytest.raises(weights.WeightsError, match="model.layers.1.mlp.up_proj.weight"):
        loading.load_model("tiny-qwen3", broken, mesh=mesh)


def test_shape_mismatch_is_named(qwen3_dir, mesh, tmp_path):
    config = json.loads((qwen3_dir / "config.json").read_text()) | {"intermediate_size": 96}
    broken = tiny.write_hf_checkpoint(tmp_path / "broken", config, load_file(qwen3_dir / "model.safetensors"))
    with pytest.raises(weights.WeightsError, match="mlp.*has shape .*config.json implies"):
        loading.load_model("tiny-qwen3", broken, mesh=mesh)


def test_corrupt_safetensors_header_is_reported(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(weights.WeightsError, match="corrupt safetensors header"):
        weights.SafetensorsDir(tmp_path)


def test_unknown_directory_format_is_reported(tmp_path, mesh):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(weights.WeightsError, match="neither an HF safetensors directory"):
        loading.load_model("tiny-qwen3", tmp_path, mesh=mesh)


MULTI_DEVICE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, jax
    from jax.sharding import Mesh
    sys.path.insert(0, sys.argv[1])
    from test_convert_export import adapted_logits
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("fsdp", "tp"))
    reports = []
    for directory in sys.argv[2:]:
        model, out = adapted_logits(directory, mesh)
        w = model.layers[0].attn.q_proj.w.get_value()
        b = model.layers[0].attn.q_proj.w_lora_b.get_value()
        shards = sorted({tuple(s.data.shape) for s in w.addressable_shards})
        lora_shards = sorted({tuple(s.data.shape) for s in b.addressable_shards})
        reports.append({"shards": shards, "lora_shards": lora_shards, "logits": out.tolist()})
    json.dump(reports, sys.stdout)
    """
)


def adapted_logits(directory, mesh):
    """(model, logits) of the tiny Qwen3 with deterministic non-zero adapters, on `mesh`."""
    from flax import nnx

    model, _ = loading.load_model("tiny-qwen3", directory, mesh=mesh, dtype=jnp.float32)
    model = lora.apply_lora(
        model, rank=4, alpha=8.0, target_regex=lora.module_path_regex("qwen3"), mesh=mesh, rngs=nnx.Rngs(0)
    )
    rng = np.random.default_rng(0)
    shapes = {key: value.shape for key, value in sorted(lora.get_lora_params(model).items())}
    lora.set_lora_params(
        model, {key: 0.3 * rng.standard_normal(shape).astype(np.float32) for key, shape in shapes.items()}
    )
    return model, logits(model)


def test_parameters_and_adapters_are_sharded_over_a_2x2_mesh(qwen3_dir, mesh, tmp_path):
    """HF safetensors and our Orbax base both load sharded on 4 devices and match one device."""
    orbax_dir = convert.convert_base("tiny-qwen3", qwen3_dir, tmp_path / "base", dtype=jnp.float32)
    env = trainer_env(devices=4)
    result = subprocess.run(
        [sys.executable, "-c", MULTI_DEVICE_SCRIPT, str(Path(__file__).parent), str(qwen3_dir), str(orbax_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, single = adapted_logits(qwen3_dir, mesh)
    for report in json.loads(result.stdout):
        assert report["shards"] == [[32, 2, 16]]  # q_proj [64, 4, 16] split over fsdp (2) and tp (2)
        # Its B [4, 4, 16] follows the heads axis over tp and splits its rank over fsdp (mesh._adapter_names).
        assert report["lora_shards"] == [[2, 2, 16]]
        np.testing.assert_allclose(np.array(report["logits"]), single, atol=1e-4, rtol=0)  # reduction order differs


def test_bfloat16_base_checkpoint_restores_as_float32(qwen3_dir, mesh, tmp_path):
    converted = convert.convert_base("tiny-qwen3", qwen3_dir, tmp_path / "base")  # bfloat16 by default
    restored, _ = loading.load_model("tiny-qwen3", converted, mesh=mesh, dtype=jnp.float32)
    original, _ = loading.load_model("tiny-qwen3", qwen3_dir, mesh=mesh, dtype=jnp.float32)
    w = restored.layers[1].mlp.down_proj.kernel.get_value()
    assert w.dtype == jnp.float32
    expected = original.layers[1].mlp.down_proj.kernel.get_value().astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(expected))
