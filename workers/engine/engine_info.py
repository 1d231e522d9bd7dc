"""What the engine says about itself: its fixed shape (`EngineDescription`) and its load
(`EngineStats`), for the worker's info and stats and for benchmarks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.core.sequence import Sequence


@dataclass(frozen=True)
class EngineDescription:
    max_model_len: int
    vocab_size: int  # logits columns the engine samples from
    block_size: int
    num_blocks: int  # KV pool blocks
    dtype: str  # what the weights run in, e.g. "bfloat16"
    decode_attention: str  # "triton" / "cpu": the paged kernel (CUDA / C on CPU); "sdpa": over a gather
    cuda_graph_max_batch: int  # decode steps up to this batch replay CUDA graphs (0: none)
    deterministic: bool = False  # batch-invariant (engine.deterministic, `null` resolved)


@dataclass(frozen=True)
class EngineStats:
    active_requests: int
    waiting: int
    running: int  # sequences (choices, beams)
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_query_tokens: int  # counters: prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # ... and found there
    queued_prompt_tokens: int = 0  # prompt tokens not yet prefilled (recomputation after preemption included)
    # Speculative decoding (counters): verification chunks run, tokens proposed in them, accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


def queued_prompt_tokens(seqs: Iterable[Sequence]) -> int:
    """Prompt tokens still to prefill: every uncomputed token of a sequence that has not
    sampled yet; of one that has (preempted, resumed), all but the one its decode feeds."""
    return sum(max(0, s.num_uncomputed_tokens - (1 if s.num_output_tokens else 0)) for s in seqs)
