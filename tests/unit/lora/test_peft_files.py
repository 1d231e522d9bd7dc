"""Reading PEFT adapter directories: the scale folded into B, and every unsupported or
broken adapter refused by name."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.lora_adapters import edit_adapter_config
from workers.contract.lora import LoraAdapterError, LoraRequest
from workers.lora.peft_files import read_peft_adapter

Q = "model.layers.0.self_attn.q_proj"


def _copy(adapter_dirs, tmp_path, name="all-r4"):
    return shutil.copytree(adapter_dirs[name], tmp_path / name)


def _read(path, name="x"):
    return read_peft_adapter(LoraRequest.of(name, str(path)))


def test_reads_modules_with_the_scale_folded_into_b(adapter_dirs):
    adapter = _read(adapter_dirs["all-r4"])
    raw = load_file(adapter_dirs["all-r4"] / "adapter_model.safetensors")
    assert len(adapter.modules) == 7 * 2 and adapter.rank == 4
    q = adapter.modules[Q]
    assert torch.equal(q.a, raw[f"base_model.model.{Q}.lora_A.weight"])
    assert torch.allclose(q.b, raw[f"base_model.model.{Q}.lora_B.weight"] * 8 / 4)  # alpha / r


def test_rslora_and_alpha_pattern_scales(adapter_dirs, tmp_path):
    rs = _read(adapter_dirs["attn-r8"])  # use_rslora: alpha / sqrt(r)
    raw = load_file(adapter_dirs["attn-r8"] / "adapter_model.safetensors")
    assert torch.allclose(rs.modules[Q].b, raw[f"base_model.model.{Q}.lora_B.weight"] * 16 / math.sqrt(8))
    path = edit_adapter_config(_copy(adapter_dirs, tmp_path), alpha_pattern={"q_proj": 2})
    patterned = _read(path)
    raw = load_file(path / "adapter_model.safetensors")
    assert torch.allclose(patterned.modules[Q].b, raw[f"base_model.model.{Q}.lora_B.weight"] * 2 / 4)
    k = Q.replace("q_proj", "k_proj")
    assert torch.allclose(patterned.modules[k].b, raw[f"base_model.model.{k}.lora_B.weight"] * 8 / 4)


@pytest.mark.parametrize("changes, message", [
    ({"bias": "all"}, "bias 'all' is not supported"),
    ({"use_dora": True}, "DoRA is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"lora_alpha": "big"}, "lora_alpha must be a positive number"),
])
def test_unsupported_configs_are_refused_by_name(adapter_dirs, tmp_path, changes, message):
    path = edit_adapter_config(_copy(adapter_dirs, tmp_path), **changes)
    with pytest.raises(LoraAdapterError, match=f"LoRA adapter 'mine': .*{message}"):
        _read(path, "mine")


def test_missing_and_broken_files(adapter_dirs, tmp_path):
    path = _copy(adapter_dirs, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraAdapterError, match="not a readable safetensors file"):
        _read(path)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(LoraAdapterError, match="no adapter_model.safetensors"):
        _read(path)
    (path / "adapter_config.json").write_text("{")
    with pytest.raises(LoraAdapterError, match="not readable JSON"):
        _read(path)
    with pytest.raises(LoraAdapterError, match="no adapter_config.json"):
        _read(tmp_path / "nowhere")


def test_tensors_other_than_lora_pairs_are_refused(adapter_dirs, tmp_path):
    path = _copy(adapter_dirs, tmp_path)
    weights = load_file(path / "adapter_model.safetensors")
    save_file({**weights, "base_model.model.lm_head.weight": torch.zeros(4, 4)}, path / "adapter_model.safetensors")
    with pytest.raises(LoraAdapterError, match="lm_head.weight' is not a LoRA A or B weight"):
        _read(path)
    del weights[f"base_model.model.{Q}.lora_B.weight"]
    save_file(weights, path / "adapter_model.safetensors")
    with pytest.raises(LoraAdapterError, match="has lora_A but not its partner"):
        _read(path)


def test_the_config_is_read_not_trusted_for_shapes(adapter_dirs, tmp_path):
    # `r` in the config says 64; the tensors say 4: the tensors are what is computed.
    path = edit_adapter_config(_copy(adapter_dirs, tmp_path), r=64)
    assert _read(path).rank == 4
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 64
