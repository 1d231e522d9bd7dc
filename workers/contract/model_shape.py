"""The sizes a tensor-parallel split divides, read from a model's config (a transformers
config object or its config.json as a dict), whether a split over N shards can divide
them, and which families can be split at all. Torch-free: the ingress checks a local
checkpoint's config at start with it, and each shard again before it reads its slices
(workers/parallel/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The families the direct forward runs (workers/model/direct_forward.py): split by tensors
# and by layers; other families with a transformers plan (follows_plan) by tensors only.
DIRECT_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def _reader(config: Any):
    if isinstance(config, dict):
        return config.get
    return lambda key, default=None: getattr(config, key, default)


@dataclass(frozen=True)
class SplitShape:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: Any) -> "SplitShape":
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        get = _reader(config)
        heads = get("num_attention_heads")
        head_dim = get("head_dim") or get("hidden_size") // heads
        return cls(heads, get("num_key_value_heads") or heads, head_dim, get("intermediate_size"), get("vocab_size"))


# A transformers tensor-parallel plan chatserve follows (tensor_split.py): column- and
# row-split products under Llama's module names; per-head norms stay whole.
PLAN_STYLES = {"colwise", "rowwise", "replicated_with_grad_allreduce"}
PLAN_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_norm", "k_norm"}


def follows_plan(config: Any) -> bool:
    """Whether a transformers config object's class carries a tensor-parallel plan of the
    kind chatserve splits by (its `base_model_tp_plan`: Gemma 1/2/3, OLMo, Granite, ...)."""
    plan = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                   "base_model_tp_plan", None)
    return bool(plan) and set(plan.values()) <= PLAN_STYLES and all(
        key.rsplit(".", 1)[-1] in PLAN_MODULES for key in plan)


def _kinds(config: Any, kinds: list[str] | None) -> list[str]:
    return kinds if kinds is not None else _reader(config)("architectures") or []


def is_direct_family(config: Any, kinds: list[str] | None = None) -> bool:
    return any(kind in DIRECT_FAMILIES for kind in _kinds(config, kinds))


def split_problem(config: Any, world: int, kinds: list[str] | None = None) -> str | None:
    """Why a model of this config (its classes `kinds`; default: the config's
    `architectures`) cannot be split over `world` tensor shards, or None. A config.json
    read as a dict carries no plan: only the sizes are checked for other families (the
    worker checks the family when it loads the config)."""
    kinds = _kinds(config, kinds)
    if world > 1 and not is_direct_family(config, kinds) and not isinstance(config, dict) \
            and not follows_plan(config):
        return f"tensor parallelism runs the direct forward's families ({', '.join(DIRECT_FAMILIES)}) and " \
               f"those whose transformers config has a column/row tensor-parallel plan, not {kinds}"
    shape = SplitShape.of(config)
    sizes = {"attention heads": shape.heads, "KV heads": shape.kv_heads, "intermediate size": shape.intermediate}
    uneven = [f"{size} {name}" for name, size in sizes.items() if size % world]
    if uneven:
        return f"tensor_parallel_size {world} does not divide the model's {', '.join(uneven)}"
    return None


def stage_problem(config: Any, stages: int) -> str | None:
    """Why a model of this config cannot run in `stages` pipeline stages, or None."""
    if stages == 1:
        return None
    if not is_direct_family(config):
        return f"pipeline parallelism runs the direct forward's families only ({', '.join(DIRECT_FAMILIES)}), " \
               f"not {_kinds(config, None)}"
    layers = _reader(config)("num_hidden_layers") or 0
    if stages > layers:
        return f"pipeline_parallel_size {stages} is more than the model's {layers} layers"
    return None


def local_split_problem(source: str, world: int, stages: int = 1) -> tuple[str, str] | None:
    """`split_problem` for a transformers directory on this machine (split over `world`
    tensor shards in each of `stages` pipeline stages), as the parallel field at fault and
    the reason; None when there is none, or when `source` is not such a directory (a GGUF
    file or the built-in model: the worker checks it when it loads it)."""
    config_file = Path(source) / "config.json"
    if world * stages == 1 or not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    problem = split_problem(config, world)
    if problem is not None:
        return "tensor_parallel_size", problem
    problem = stage_problem(config, stages)
    return ("pipeline_parallel_size", problem) if problem is not None else None
