"""The torch-free LoRA contract: adapter keys, and where a runtime load may read."""

from __future__ import annotations

import os

import pytest

from workers.contract.lora import LoraAdapterError, LoraRequest, adapter_path_inside


def test_a_key_names_the_adapter_and_changes_with_its_path_or_registration():
    first = LoraRequest.of("a", "/x")
    assert first.key.startswith("a@") and first == LoraRequest.of("a", "/x")
    assert len({first.key, LoraRequest.of("a", "/y").key, LoraRequest.of("a", "/x", "load-2").key}) == 3


def test_paths_resolve_inside_the_adapter_dir_only(tmp_path):
    root = tmp_path / "adapters"
    (root / "one").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "link")
    assert adapter_path_inside(str(root), "one") == (root / "one").resolve()
    assert adapter_path_inside(str(root), str(root / "one")) == (root / "one").resolve()
    for path in ["../secret", str(tmp_path / "secret"), "link", "one/../../secret"]:
        with pytest.raises(LoraAdapterError, match="outside the adapter directory"):
            adapter_path_inside(str(root), path)
    with pytest.raises(LoraAdapterError, match="not a directory"):
        adapter_path_inside(str(root), "two")
    with pytest.raises(LoraAdapterError, match="loads no adapters at run time"):
        adapter_path_inside(None, "one")
