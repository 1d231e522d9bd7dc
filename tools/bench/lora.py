"""LoRA throughput on CPU: the serving load with rows spread over several adapters, against
the same load on the base model alone (`python -m tools.bench.engine lora`).

Three engines take the same closed-loop load in turn (tools.bench.engine's `offline`
load: the templated prompt, temperature 0.8, ignore_eos, C requests in flight), each
round in the same order; the fastest round of each (on a shared machine, the least
disturbed) and the median are reported, the ratio from the fastest:
  plain       the model as the worker loads it without a `lora` config (no LoRA layers)
  base rows   the model with LoRA layers and adapters registered, every request on the base
  adapters    the same engine, requests spread round-robin over the adapters
The adapters are random PEFT-format directories written here (rank and targets as given):
their values change which tokens come out, not what a step computes.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from workers.contract.lora import LoraRequest
from workers.contract.model_config import LoraConfig, ModelConfig
from workers.lora.manager import LORA_TARGETS
from workers.lora.peft_files import read_peft_adapter


def write_random_adapter(model: torch.nn.Module, path: Path, seed: int, rank: int,
                         targets: tuple[str, ...] = LORA_TARGETS) -> Path:
    """A PEFT LoRA directory for `model` (before any LoRA wrapping) with random A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and hasattr(module, "in_features"):
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets), "bias": "none"}))
    return path


def with_lora(config: ModelConfig, adapters: int, rank: int) -> ModelConfig:
    return config.model_copy(update={"lora": LoraConfig(max_loras=adapters, max_lora_rank=rank)})


def register_adapters(engine, model: torch.nn.Module, count: int, rank: int,
                      targets: tuple[str, ...] = LORA_TARGETS) -> list[str]:
    """Write `count` random adapters of `model`, register them with `engine`; their keys."""
    root = Path(tempfile.mkdtemp(prefix="chatserve-lora-bench-"))
    keys = []
    for i in range(count):
        path = write_random_adapter(model, root / f"a{i}", seed=i, rank=rank, targets=targets)
        request = LoraRequest.of(f"bench-{i}", str(path))
        engine.add_lora(read_peft_adapter(request))
        keys.append(request.key)
    return keys


def compare(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, tuple[float, float]]:
    """Each run once per round, in order; (fastest, median) tok/s of each."""
    results: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            results[name].append(run())
    return {name: (max(values), statistics.median(values)) for name, values in results.items()}
