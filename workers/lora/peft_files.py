"""Reading a PEFT LoRA adapter directory: adapter_config.json and adapter_model.safetensors.

chatserve computes plain LoRA: `W x + (alpha / r) * B A x` on linear layers (rsLoRA's
`alpha / sqrt(r)` too; per-module ranks and alphas from `rank_pattern` / `alpha_pattern`).
Everything else PEFT can save (biases, DoRA, extra trained modules, token tables, ...)
changes the math, so such an adapter is refused by name rather than served wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from workers.contract.lora import LoraAdapterError, LoraRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# adapter_config.json keys whose non-empty values change what the adapter computes.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "lora_bias": "lora_bias",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "target_parameters",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
}

# A saved LoRA tensor: "base_model.model.<module path>.lora_A.weight" (PEFT drops the
# adapter's own name when it saves).
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])\.weight")


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear: `a` [r, in], `b` [out, r] with the scale folded in (float32, CPU)."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter's weights by module path in the base model (e.g. "model.layers.0.self_attn.q_proj")."""

    request: LoraRequest
    modules: dict[str, LoraModule]

    @property
    def name(self) -> str:
        return self.request.name

    @property
    def key(self) -> str:
        return self.request.key

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def read_peft_adapter(request: LoraRequest) -> LoraAdapter:
    """The adapter at `request.path`; raises LoraAdapterError naming it for anything missing,
    malformed or unsupported."""
    try:
        return _read(request)
    except LoraAdapterError as exc:
        raise LoraAdapterError(f"LoRA adapter {request.name!r}: {exc}") from None


def _read(request: LoraRequest) -> LoraAdapter:
    path = Path(request.path)
    config = _read_config(path / CONFIG_FILE)
    tensors = _read_tensors(path / WEIGHTS_FILE)
    modules = {}
    for module, (a, b) in _pairs(tensors).items():
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
        rank = a.shape[0]
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[module] = LoraModule(a=a.float().contiguous(), b=(b.float() * scale).contiguous())
    if not modules:
        raise LoraAdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoraAdapter(request=request, modules=modules)


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise LoraAdapterError(f"no {CONFIG_FILE} in its directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraAdapterError(f"{CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    if config.get("bias", "none") != "none":
        raise LoraAdapterError(f"bias {config.get('bias')!r} is not supported (only 'none')")
    for option, what in UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise LoraAdapterError(f"{what} is not supported")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise LoraAdapterError(f"lora_alpha must be a positive number, not {alpha!r}")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise LoraAdapterError(f"no {WEIGHTS_FILE} in its directory (only safetensors weights are read)")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoraAdapterError(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B) by module path; every tensor must be one of a complete, consistent pair."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise LoraAdapterError(f"tensor {key!r} is not a LoRA A or B weight (not supported)")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoraAdapterError(f"tensor {key!r} is not a 2-D floating-point matrix")
        found.setdefault(match["module"], {})[match["which"]] = tensor
    pairs = {}
    for module, parts in found.items():
        if set(parts) != {"A", "B"}:
            raise LoraAdapterError(f"module {module!r} has lora_{next(iter(parts))} but not its partner")
        a, b = parts["A"], parts["B"]
        if a.shape[0] != b.shape[1] or a.shape[0] == 0:
            raise LoraAdapterError(f"module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                                   "do not share a rank")
        pairs[module] = (a, b)
    return pairs


def _pattern_value(patterns: dict, module: str, default: float) -> float:
    """PEFT's `alpha_pattern` lookup: the first key matching the end of the module path."""
    for pattern, value in patterns.items():
        try:
            matches = re.match(rf"(.*\.)?({pattern})$", module)
        except re.error as exc:
            raise LoraAdapterError(f"alpha_pattern key {pattern!r} is not a regular expression ({exc})") from None
        if matches:
            return value
    return default
