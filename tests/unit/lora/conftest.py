"""Adapters for the LoRA tests: three PEFT adapters of the tiny model (different ranks and
targets), written once per session."""

from __future__ import annotations

import pytest

from tests.support.lora_adapters import write_peft_adapter
from workers.contract.lora import LoraRequest

ADAPTERS = {  # name -> (seed, rank, alpha, targets, extra config)
    "all-r4": (1, 4, 8, None, {}),
    "attn-r8": (2, 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], {"use_rslora": True}),
    "mlp-r2": (3, 2, 4, ["gate_proj", "down_proj"], {}),
}


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(tiny_model, root / name, seed, rank, alpha, targets, **extra)
            for name, (seed, rank, alpha, targets, extra) in ADAPTERS.items()}


@pytest.fixture(scope="session")
def adapter_requests(adapter_dirs):
    return {name: LoraRequest.of(name, str(path)) for name, path in adapter_dirs.items()}
