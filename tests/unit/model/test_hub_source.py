"""A model source given as a Hub id (workers/model/hub_source.py): told apart from paths,
resolved from huggingface_hub's cache with the network off (`HF_HUB_OFFLINE=1`), and a
clear error naming the id, the cache and what was looked for when nothing fits."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import write_tiny_model_dir
from workers.model.hub_source import HubId
from workers.model.loader import load_model, prepare_model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cached_repo(cache, repo: str, with_weights: bool = True):
    """`repo` at COMMIT in huggingface_hub's cache layout, as a download leaves it."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = write_tiny_model_dir(folder / "snapshots" / COMMIT)
    if not with_weights:
        for weights in snapshot.glob("*.safetensors"):
            weights.unlink()
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_are_told_apart_from_paths(tmp_path, monkeypatch):
    assert HubId.parse("Qwen/Qwen2.5-0.5B-Instruct") == HubId("Qwen/Qwen2.5-0.5B-Instruct")
    assert HubId.parse("org/name@v1.2") == HubId("org/name", "v1.2")
    assert str(HubId.parse(f"org/name@{COMMIT}")) == f"org/name@{COMMIT}"
    for path in ("/models/m", "models/m/v1", "./m", "org/model.gguf", "builtin:smollm2-135m-instruct", "m"):
        assert HubId.parse(path) is None, path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert HubId.parse("org/name") is None  # a directory here wins


def test_a_cached_hub_model_loads_with_the_network_off(offline_cache):
    snapshot = cached_repo(offline_cache, "org/tiny")
    assert prepare_model_dir("org/tiny") == snapshot
    assert prepare_model_dir(f"org/tiny@{COMMIT}") == snapshot
    loaded = load_model("org/tiny", dtype="float32")
    assert loaded.path == snapshot and loaded.model.config.num_hidden_layers >= 1


def test_a_hub_id_with_nothing_to_serve_names_the_id_the_cache_and_why(offline_cache):
    with pytest.raises(FileNotFoundError, match=r"'org/absent' \(a Hub id\): no snapshot of revision main in "
                       r"huggingface_hub's cache at .*hub, and HF_HUB_OFFLINE is set"):
        prepare_model_dir("org/absent")
    cached_repo(offline_cache, "org/gguf-only", with_weights=False)
    with pytest.raises(FileNotFoundError, match="has no config.json and safetensors weights"):
        prepare_model_dir("org/gguf-only")
