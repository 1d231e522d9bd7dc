"""A model source given as a Hub id (workers/model/hub_source.py): told apart from paths,
resolved from huggingface_hub's cache with the network off (`HF_HUB_OFFLINE=1`), and a
clear error naming the id, the cache and what was looked for when nothing fits."""

from __future__ import annotations

import pytest

from tests.support.tiny_models import write_tiny_model_dir
from workers.model.hub_source import HubId
from workers.model.loader import load_model, prepare_model_dir, resolve_gguf

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


def cached_gguf_repo(cache, repo: str, names: list[str]):
    """A GGUF repository at COMMIT in huggingface_hub's cache layout (the files' bytes do
    not matter to resolving one)."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name in names:
        (snapshot / name).write_bytes(b"GGUF")
    return snapshot


def test_a_hub_gguf_tag_picks_one_file_of_the_repository(offline_cache):
    names = ["tiny-Q4_0.gguf", "tiny-Q4_K_M.gguf", "tiny-Q4_K_S.gguf", "tiny.Q8_0.gguf", "README.md"]
    snapshot = cached_gguf_repo(offline_cache, "org/tiny-GGUF", names)
    assert HubId.parse("org/tiny-GGUF:Q4_K_M") == HubId("org/tiny-GGUF", None, "Q4_K_M")
    assert str(HubId.parse("org/tiny-GGUF@main:q8_0")) == "org/tiny-GGUF@main:q8_0"
    assert resolve_gguf("org/tiny-GGUF:Q4_K_M") == snapshot / "tiny-Q4_K_M.gguf"
    assert resolve_gguf("org/tiny-GGUF:q8_0") == snapshot / "tiny.Q8_0.gguf"  # case aside
    assert resolve_gguf("org/tiny-GGUF:tiny-Q4_K_S.gguf") == snapshot / "tiny-Q4_K_S.gguf"
    assert resolve_gguf("org/tiny-GGUF") is None  # no tag: a transformers repository is looked for
    with pytest.raises(FileNotFoundError, match=r"several GGUF files fit the tag '_0'; the repository's GGUF "
                       r"files: tiny-Q4_0.gguf, tiny-Q4_K_M.gguf, tiny-Q4_K_S.gguf, tiny.Q8_0.gguf"):
        resolve_gguf("org/tiny-GGUF:_0")
    with pytest.raises(FileNotFoundError, match="no GGUF files fit the tag 'Q6_K'"):
        resolve_gguf("org/tiny-GGUF:Q6_K")
    with pytest.raises(FileNotFoundError, match=r"'org/absent:Q4_0' \(a Hub GGUF\): no snapshot .* HF_HUB_OFFLINE"):
        resolve_gguf("org/absent:Q4_0")


@pytest.mark.slow
def test_a_hub_gguf_loads_with_its_blocks_kept(offline_cache):
    """The default model's file as a Hub GGUF repository's (the cache holds a link to it):
    converted once, then its blocks swapped in, as for a local .gguf."""
    from workers.contract.model_config import BUILTIN_DEFAULT_MODEL
    from workers.quant.native_kernels import kernels
    from workers.quant.quantized_layers import QuantizedLinear

    builtin = resolve_gguf(BUILTIN_DEFAULT_MODEL)
    snapshot = cached_gguf_repo(offline_cache, "org/smol-GGUF", [])
    (snapshot / builtin.name).symlink_to(builtin)
    loaded = load_model("org/smol-GGUF:Q4_1", dtype="float32")
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == (121 if kernels() is not None else 0)  # 30 x (q/k/v, o, gate/up, down), the head
