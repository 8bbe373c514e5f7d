"""convert/export with gs:// URIs, Hugging Face repo ids and Hub pushes (storage.py).

gs:// runs through the real etils.epath fsspec backend, pointed at a bucket kept on local disk
(the `gcs` fixture of conftest.py); the Hub is replaced by recorders, so nothing here uses the network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from lorajob_trainer import convert, export, lora, storage, tiny, weights
from safetensors.numpy import load_file, save_file

RANK, HIDDEN, LAYERS = 2, 64, 2  # tiny qwen3: q_proj maps 64 -> 4 heads x 16


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return tiny.make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), seed=4)


def peft_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(LAYERS):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((RANK, HIDDEN)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((HIDDEN, RANK)).astype(np.float32)
    return tensors


def write_peft_adapter(directory: Path) -> Path:
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 4, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(peft_tensors(), directory / "adapter_model.safetensors")
    return directory


@pytest.fixture(scope="module")
def checkpoint(qwen3_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    adapter = write_peft_adapter(root / "adapter")
    return convert.convert_adapter("tiny-qwen3", qwen3_dir, adapter, root / "checkpoints")


def assert_same_tensors(directory: Path) -> None:
    exported = load_file(directory / "adapter_model.safetensors")
    expected = peft_tensors()
    assert sorted(exported) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(exported[name], value)


# --- gs:// ------------------------------------------------------------------------------------


def test_gs_uris_reach_storage_intact_and_round_trip(qwen3_dir, gcs, tmp_path, capsys):
    shutil.copytree(qwen3_dir, gcs / "bucket" / "hf")
    write_peft_adapter(gcs / "bucket" / "adapter")

    convert.main(["base", "--model-name", "tiny-qwen3", "--hf", "gs://bucket/hf", "--out", "gs://bucket/base"])
    assert json.loads((gcs / "bucket" / "base" / weights.BASE_MARKER).read_text())["family"] == "qwen3"
    assert (gcs / "bucket" / "base" / "params").is_dir() and (gcs / "bucket" / "base" / "tokenizer.json").is_file()
    with pytest.raises(SystemExit, match="convert failed: gs://bucket/base already holds a base checkpoint"):
        convert.main(["base", "--model-name", "tiny-qwen3", "--hf", "gs://bucket/hf", "--out", "gs://bucket/base"])

    capsys.readouterr()
    convert.main(
        [
            "adapter", "--model-name", "tiny-qwen3", "--base", "gs://bucket/base",
            "--adapter", "gs://bucket/adapter", "--out", "gs://bucket/run/checkpoints",
        ]
    )  # fmt: skip
    assert capsys.readouterr().out.strip() == "gs://bucket/run/checkpoints/0"
    _, metadata = lora.load_adapter_checkpoint(gcs / "bucket" / "run" / "checkpoints")
    assert metadata.load_parameters_path == "gs://bucket/base"

    export.main(["--checkpoint", "gs://bucket/run/checkpoints", "--out", "gs://bucket/run/huggingface"])
    assert capsys.readouterr().out.strip() == "gs://bucket/run/huggingface"
    assert_same_tensors(gcs / "bucket" / "run" / "huggingface")


def test_a_failed_conversion_leaves_nothing_at_the_uri(qwen3_dir, gcs, tmp_path):
    adapter = write_peft_adapter(tmp_path / "adapter")  # says DoRA, but holds no magnitudes: refused mid-way
    config = json.loads((adapter / "adapter_config.json").read_text()) | {"use_dora": True}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a DoRA adapter needs .*lora_magnitude_vector"):
        convert.convert_adapter("tiny-qwen3", qwen3_dir, adapter, "gs://bucket/checkpoints")
    assert not (gcs / "bucket").exists()


def test_a_missing_uri_is_named(gcs, tmp_path):
    with pytest.raises(SystemExit, match="export failed: gs://bucket/nothing does not exist"):
        export.main(["--checkpoint", "gs://bucket/nothing", "--out", str(tmp_path / "out")])


# --- Hugging Face repo ids ----------------------------------------------------------------------


@pytest.fixture
def downloads(monkeypatch, qwen3_dir, tmp_path) -> list[tuple[str, tuple[str, ...]]]:
    """Calls of storage.download_hf_repo, which serves tiny-qwen3 for models and a PEFT adapter for adapters."""
    calls = []
    adapter = write_peft_adapter(tmp_path / "hub-adapter")

    def download(repo_id: str, patterns) -> Path:
        calls.append((repo_id, tuple(patterns)))
        return adapter if tuple(patterns) == storage.ADAPTER_FILES else qwen3_dir

    monkeypatch.setattr(storage, "download_hf_repo", download)
    return calls


def test_a_repo_id_is_downloaded(downloads, tmp_path):
    out = convert.convert_base("tiny-qwen3", "Qwen/Qwen3-0.6B", tmp_path / "base")
    assert (out / "params").is_dir()
    step = convert.convert_adapter("tiny-qwen3", out, "someone/my-adapter", tmp_path / "checkpoints")
    assert downloads == [("Qwen/Qwen3-0.6B", storage.MODEL_FILES), ("someone/my-adapter", storage.ADAPTER_FILES)]
    exported = export.export_adapter(step, tmp_path / "exported")
    assert_same_tensors(exported)


def test_existing_paths_and_uris_are_not_downloaded(downloads, qwen3_dir, gcs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(qwen3_dir, tmp_path / "Qwen" / "Qwen3-0.6B")  # a relative path shaped like a repo id
    shutil.copytree(qwen3_dir, gcs / "bucket" / "hf")
    for source in ("Qwen/Qwen3-0.6B", str(qwen3_dir), "gs://bucket/hf"):
        with storage.local_input(source, patterns=storage.MODEL_FILES, hub=True) as local:
            assert (local / "config.json").read_text() == (qwen3_dir / "config.json").read_text()
    assert downloads == []


def test_what_is_neither_path_uri_nor_repo_id_is_rejected(downloads):
    with pytest.raises(SystemExit, match="no/such/dir does not exist: expected a local path, a gs:// URI or a Hug"):
        convert.main(["base", "--model-name", "tiny-qwen3", "--hf", "no/such/dir", "--out", "out"])
    assert downloads == []


def test_a_failed_download_is_reported(monkeypatch):
    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach huggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(storage.StorageError, match="'org/model', and downloading it from the Hugging Face Hub failed"):
        storage.download_hf_repo("org/model", storage.MODEL_FILES)


# --- Hub push -----------------------------------------------------------------------------------


class RecordingHfApi:
    """Records what export asks of huggingface_hub.HfApi, with the files the folder holds at upload time."""

    calls: list[tuple] = []

    def __init__(self, token=None):
        self.token = token

    def create_repo(self, repo_id, **options):
        self.calls.append(("create_repo", repo_id, self.token, options.get("repo_type")))

    def upload_folder(self, *, folder_path, repo_id, **options):
        files = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        self.calls.append(("upload_folder", repo_id, self.token, folder_path, files))


@pytest.fixture
def hub(monkeypatch) -> list[tuple]:
    monkeypatch.setattr(RecordingHfApi, "calls", [])
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingHfApi)
    return RecordingHfApi.calls


def test_export_pushes_the_folder_to_the_hub(checkpoint, hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--hub-repo", "org/adapter"])
    files = ["adapter_config.json", "adapter_model.safetensors"]
    assert hub == [
        ("create_repo", "org/adapter", "hf_secret", "model"),
        ("upload_folder", "org/adapter", "hf_secret", str(tmp_path / "out"), files),
    ]


def test_hub_push_from_a_gs_export_uploads_the_finished_folder(checkpoint, hub, gcs, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    export.main(["--checkpoint", str(checkpoint), "--out", "gs://bucket/hf", "--hub-repo", "org/adapter"])
    assert [call[-1] for call in hub if call[0] == "upload_folder"] == [
        ["adapter_config.json", "adapter_model.safetensors"]
    ]
    assert_same_tensors(gcs / "bucket" / "hf")


def test_hub_push_without_a_token_fails_before_any_work(checkpoint, hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="export failed: pushing to the Hugging Face Hub needs a token in .*HF_TOKEN"):
        export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--hub-repo", "org/adapter"])
    assert hub == [] and not (tmp_path / "out").exists()


# --- the operator's export command --------------------------------------------------------------


def test_the_rendered_export_command_passes_uris_and_hub_repo_through(monkeypatch):
    import yaml
    from lorajob_operator import names, step_commands, validation

    body = yaml.safe_load((Path(__file__).parents[2] / "examples" / "qwen3-gsm8k.yaml").read_text())
    body["spec"]["export"] = {"hubRepo": "org/adapter"}
    spec, errors = validation.parse_spec(body)
    assert spec is not None, errors
    job = step_commands.Job(body["metadata"]["name"], "team-a", "uid-1")
    command = step_commands.export_command(spec, names.run_name(spec, body["metadata"]["name"]), job)
    assert command[:3] == ["python", "-m", "lorajob_trainer.export"]
    calls = []
    monkeypatch.setattr(export, "export", lambda *args, **kwargs: calls.append((args, kwargs)))
    export.main(command[3:])
    ((args, kwargs),) = calls
    assert args == ("gs://my-bucket/lorajob/qwen3-gsm8k/checkpoints", "gs://my-bucket/lorajob/qwen3-gsm8k/huggingface")
    assert kwargs["hub_repo"] == "org/adapter"
