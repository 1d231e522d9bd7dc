"""The sizes a tensor-parallel split divides, read from a model's config (a transformers
config object or its config.json as a dict), and whether a split over N shards can divide
them. Torch-free: the ingress checks a local checkpoint's config at start with it, and
each shard again before it reads its slices (workers/parallel/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The families the direct forward runs (workers/model/direct_forward.py), the only ones split.
SPLITTABLE_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


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


def split_problem(config: Any, world: int, kinds: list[str] | None = None) -> str | None:
    """Why a model of this config (its classes `kinds`; default: the config's
    `architectures`) cannot be split over `world` shards, or None."""
    kinds = kinds if kinds is not None else _reader(config)("architectures") or []
    if not any(kind in SPLITTABLE_FAMILIES for kind in kinds):
        return f"tensor parallelism runs the direct forward's families only ({', '.join(SPLITTABLE_FAMILIES)}), " \
               f"not {kinds}"
    shape = SplitShape.of(config)
    sizes = {"attention heads": shape.heads, "KV heads": shape.kv_heads, "intermediate size": shape.intermediate}
    uneven = [f"{size} {name}" for name, size in sizes.items() if size % world]
    if uneven:
        return f"tensor_parallel_size {world} does not divide the model's {', '.join(uneven)}"
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
        return ("tensor_parallel_size" if world > 1 else "pipeline_parallel_size"), problem
    layers = config.get("num_hidden_layers") or 0
    if stages > 1 and stages > layers:
        return "pipeline_parallel_size", f"pipeline_parallel_size {stages} is more than the model's {layers} layers"
    return None
