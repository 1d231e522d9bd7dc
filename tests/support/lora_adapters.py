"""PEFT LoRA adapters for the tiny models, made with peft itself, and peft's merged model as
the reference their outputs must equal."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_peft_adapter(base: torch.nn.Module, path: Path, seed: int, rank: int = 4, alpha: float = 8,
                       targets: list[str] | None = None, **config) -> Path:
    """Save a LoRA adapter of `base` (left untouched) with random, non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora_config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_PROJECTIONS,
                             init_lora_weights=False, **config)
    peft_model = get_peft_model(copy.deepcopy(base), lora_config)
    with torch.no_grad():  # B is zero at PEFT's usual init; init_lora_weights=False makes it random
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(str(path))
    return path


def merged_model(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """peft's own answer: the base with the adapter merged into its weights."""
    from peft import PeftModel

    merged = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir)).merge_and_unload()
    return merged.eval()


def edit_adapter_config(path: Path, **changes) -> Path:
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return path


def merged_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding of `model` (EOS disabled); uncached, unlike
    tests.support.engines.reference_greedy, whose cache is keyed by prompt alone."""
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
