"""A verified registry (issue #37 item 3), on MLflow with a real SQLite backend store: every model
version records its files' digest, every download is checked against it (a replica refuses weights
that differ), a version's source must lie in the registry's own artifact store, and only
safetensors weights are registered or loaded."""

from pathlib import Path

import pytest

from raypai.artifacts import digest_dir
from raypai.errors import DataError, StoreError
from raypai.tracking import DIGEST_TAG, Tracker


def _model(folder: Path) -> Path:
    """A tiny HF-shaped folder: config and a real safetensors file."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def tracker(tmp_path):
    return Tracker(f"sqlite:///{tmp_path}/mlflow.db", artifact_root=tmp_path / "mlart")


def _uploaded(tracker: Tracker, name: str, version: int) -> Path:
    """The folder MLflow stored the version's files in (what a replica downloads)."""
    source = tracker.client.get_model_version(name, str(version)).source
    return Path(source.removeprefix("file://"))


def test_a_download_whose_files_differ_from_the_recorded_digest_is_refused(tracker, tmp_path):
    model = _model(tmp_path / "model")
    v = tracker.register_model(model, "tiny")
    assert tracker.resolve_model("tiny", v)[1][DIGEST_TAG] == digest_dir(model)[0]
    local = tracker.download_model("tiny", v, cache_dir=tmp_path / "cache")  # negative: whole weights load
    assert digest_dir(local)[0] == digest_dir(model)[0]

    stored = _uploaded(tracker, "tiny", v) / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the registry's copy: same size, other weights
    stored.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"model 'tiny' version 1 .* is not what was registered"):
        tracker.download_model("tiny", v, cache_dir=tmp_path / "fresh")
    assert not [p for p in (tmp_path / "fresh" / "tiny").iterdir()]  # the download was discarded


def test_the_model_server_refuses_weights_that_differ_from_the_recorded_digest(tracker, tmp_path, monkeypatch):
    """What a serving replica does first: download the version through the registry, which verifies it."""
    from raypai.serving.model_server import ModelServer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    v = tracker.register_model(_model(tmp_path / "model"), "tiny")
    stored = _uploaded(tracker, "tiny", v) / "config.json"
    stored.write_text('{"model_type": "gpt2"}')
    with pytest.raises(StoreError, match="is not what was registered"):
        ModelServer.func_or_class("tiny", v, tracker.uri)


def test_a_cached_copy_whose_file_sizes_differ_is_downloaded_again(tracker, tmp_path):
    model = _model(tmp_path / "model")
    v = tracker.register_model(model, "tiny")
    local = tracker.download_model("tiny", v, cache_dir=tmp_path / "cache")
    with open(local / "model.safetensors", "r+b") as f:
        f.truncate(10)
    again = tracker.download_model("tiny", v, cache_dir=tmp_path / "cache")
    assert again == local and digest_dir(again)[0] == digest_dir(model)[0]


def test_registering_a_folder_that_is_not_the_recorded_artifact_is_refused(tracker, tmp_path):
    model = _model(tmp_path / "model")
    with pytest.raises(StoreError, match="does not hold the model it is registered as"):
        tracker.register_model(model, "tiny", tags={DIGEST_TAG: "0" * 64})
    assert tracker.register_model(model, "tiny", tags={DIGEST_TAG: digest_dir(model)[0]}) == 1


def test_a_version_whose_source_lies_outside_the_registry_artifact_store_is_refused(tracker, tmp_path):
    """A version made by hand (MLflow's API) pointing at any folder, even one with a matching digest
    tag, is not loaded: raypai's registry holds only weights it uploaded itself."""
    elsewhere = _model(tmp_path / "elsewhere")
    run_id = tracker.start_run("raypai-models", "by-hand")
    tracker.client.create_registered_model("tiny")
    for source in (str(elsewhere), f"{tracker.get_run(run_id).info.artifact_uri}/../../../../elsewhere"):
        mv = tracker.client.create_model_version(
            "tiny", source, run_id=run_id, tags={DIGEST_TAG: digest_dir(elsewhere)[0]}
        )
        with pytest.raises(StoreError, match=r"its source .* lies outside the registry's artifact store"):
            tracker.download_model("tiny", mv.version, cache_dir=tmp_path / "cache")


def test_a_version_without_a_recorded_digest_is_refused(tracker, tmp_path):
    v = tracker.register_model(_model(tmp_path / "model"), "tiny")
    tracker.client.delete_model_version_tag("tiny", str(v), DIGEST_TAG)
    with pytest.raises(StoreError, match="has no recorded digest"):
        tracker.download_model("tiny", v, cache_dir=tmp_path / "cache")


def test_pickle_weights_are_refused_at_registration_and_at_download(tracker, tmp_path):
    import torch

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text('{"model_type": "llama"}')
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    with pytest.raises(DataError, match=r"pytorch_model.bin.*raypai loads only safetensors"):
        tracker.register_model(pickled, "tiny")

    # a .bin slipped into the registry's copy afterwards is refused before anything reads it
    v = tracker.register_model(_model(tmp_path / "model"), "tiny")
    torch.save({"w": torch.zeros(2)}, _uploaded(tracker, "tiny", v) / "pytorch_model.bin")
    with pytest.raises(DataError, match=r"pytorch_model.bin.*raypai loads only safetensors"):
        tracker.download_model("tiny", v, cache_dir=tmp_path / "cache")
