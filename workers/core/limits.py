"""The engine's fixed limits, how a model's config sets them, and the error for a request
that can never fit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.contract.errors import WorkerError
from workers.contract.model_config import ModelConfig


@dataclass(frozen=True)
class LoraLimits:
    max_loras: int  # adapter slots: adapters resident at once
    max_rank: int  # the slots' rank; a larger adapter is refused


@dataclass(frozen=True)
class SpeculativeLimits:
    num_tokens: int  # proposed tokens a sequence feeds at most per step
    lookup_min: int  # ngram: the shortest suffix looked up
    lookup_max: int  # ngram: the longest
    disable_by_batch_size: int | None  # no proposals while this many sequences or more run (None: any batch)
    method: str = "ngram"  # or "draft": a draft model proposes (the engine is given it); "suffix": ngram + earlier answers
    history_requests: int = 0  # method suffix: finished answers kept to propose from


@dataclass(frozen=True)
class EngineLimits:
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    max_prefill_tokens_while_decoding: int | None = None  # see SchedulerConfig
    priority_scheduling: bool = False  # admit and preempt by the requests' priority (see SchedulerConfig)
    cuda_graph_max_batch: int = 0  # CUDA: decode steps up to this batch replay graphs (0: off)
    async_scheduling: bool = False  # launch the next decode step before reading this one's tokens
    direct_forward: bool = True  # CPU: Llama-shaped models skip transformers' modules (direct_forward.py)
    deterministic: bool | None = False  # CPU: batch-invariant linears and attention (workers/model/batch_invariant.py); None: where free
    lora: LoraLimits | None = None  # LoRA adapters served (None: no LoRA layers in the model)
    speculative: SpeculativeLimits | None = None  # speculative decoding (None: off)


def model_window(model: torch.nn.Module) -> int:
    """The longest context the model's positions allow (2048 when its config names none)."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2048


def engine_limits(config: ModelConfig, model_window: int) -> EngineLimits:
    """The limits a model's config asks for; `kv_cache_bytes` is left at its default, for
    kv_sizing to size. The worker and the offline benchmarks build engines alike."""
    eng = config.engine
    return EngineLimits(
        block_size=eng.block_size,
        max_num_seqs=eng.max_num_seqs,
        max_num_batched_tokens=eng.max_num_batched_tokens,
        max_model_len=min(eng.max_model_len or model_window, model_window),
        enable_prefix_caching=eng.enable_prefix_caching,
        max_prefill_tokens_while_decoding=eng.max_prefill_tokens_while_decoding,
        priority_scheduling=eng.scheduling_policy == "priority",
        cuda_graph_max_batch=eng.cuda_graph_max_batch_size,
        # No overlap to win on a CPU; with speculation each step's proposals come from the
        # previous step's tokens, which async scheduling has not read back yet.
        async_scheduling=eng.async_scheduling and config.device == "cuda" and config.speculative is None,
        direct_forward=eng.direct_forward,
        deterministic=eng.deterministic,
        lora=LoraLimits(config.lora.max_loras, config.lora.max_lora_rank) if config.lora is not None else None,
        speculative=_speculative_limits(config),
    )


def _speculative_limits(config: ModelConfig) -> SpeculativeLimits | None:
    spec = config.speculative
    if spec is None:
        return None
    return SpeculativeLimits(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                             spec.disable_by_batch_size, spec.method,
                             spec.suffix_decoding_max_cached_requests if spec.method == "suffix" else 0)


class CapacityError(WorkerError, ValueError):
    """The request can never fit in this engine (context window or KV pool). `param`:
    `max_tokens` when the output budget is what does not fit, else `prompt` (the prompt
    leaves no room for even one token)."""

    code = "context_length_exceeded"

    def __init__(self, message: str, prompt_alone: bool = False) -> None:
        super().__init__(message, param="prompt" if prompt_alone else "max_tokens")
        self.prompt_alone = prompt_alone


class PriorityError(WorkerError, ValueError):
    """A request with a priority on an engine that schedules first come, first served."""

    param = "priority"

    def __init__(self, priority: int) -> None:
        super().__init__(f"priority {priority} needs the model's engine.scheduling_policy to be `priority` "
                         "(it is `fcfs`); send priority 0 or leave it out")
