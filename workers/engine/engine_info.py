"""What the engine says about itself: its fixed shape (`EngineDescription`) and its load
(`EngineStats`), for the worker's info and stats and for benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineDescription:
    max_model_len: int
    vocab_size: int  # logits columns the engine samples from
    block_size: int
    num_blocks: int  # KV pool blocks
    dtype: str  # what the weights run in, e.g. "bfloat16"
    decode_attention: str  # "triton": the paged kernel (CUDA); "sdpa": over a gather
    cuda_graph_max_batch: int  # decode steps up to this batch replay CUDA graphs (0: none)


@dataclass(frozen=True)
class EngineStats:
    active_requests: int
    waiting: int
    running: int  # sequences (choices, beams)
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_query_tokens: int  # counters: prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # ... and found there
